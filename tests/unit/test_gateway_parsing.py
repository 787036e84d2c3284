"""The gateway's pure helpers: request bodies, keys, error shapes, backend metrics."""

from __future__ import annotations

import hashlib

import orjson
import pytest

from sluice.config import parse_policy
from sluice.core.types import RejectCode
from sluice.gateway.auth import KeyRing
from sluice.gateway.engines.vllm import VllmAdapter
from sluice.gateway.errors import reject_response, retry_after_headers
from sluice.gateway.request_body import BadRequest, parse_request, upstream_body


def _chat(**fields: object) -> bytes:
    body = {"model": "m", "messages": [{"role": "user", "content": "x" * 40}], **fields}
    return orjson.dumps(body)


def test_chat_request_fields_and_estimate() -> None:
    req = parse_request(_chat(max_completion_tokens=64, stream=True), chat=True)
    assert (req.model, req.stream, req.max_tokens, req.include_usage) == ("m", True, 64, False)
    assert req.prompt_tokens_est == 4 + 10  # template overhead + 40 chars / 4


def test_content_parts_and_unknown_fields_pass() -> None:
    raw = orjson.dumps(
        {
            "model": "m",
            "ignore_eos": True,
            "stream_options": {"continuous_usage_stats": True},
            "messages": [{"role": "user", "content": [{"type": "text", "text": "abcdefgh"}]}],
        }
    )
    req = parse_request(raw, chat=True)
    assert req.prompt_tokens_est == 4 + 2
    assert upstream_body(req, raw) == raw  # not a stream: forwarded byte for byte


def test_stream_without_usage_asks_upstream_for_it_and_keeps_other_fields() -> None:
    raw = _chat(stream=True, ignore_eos=True, stream_options={"continuous_usage_stats": True})
    sent = orjson.loads(upstream_body(parse_request(raw, chat=True), raw))
    assert sent["stream_options"] == {"continuous_usage_stats": True, "include_usage": True}
    assert sent["ignore_eos"] is True


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        (b"{not json", "not valid JSON"),
        (b"[1]", "must be a JSON object"),
        (orjson.dumps({"messages": [{"role": "user", "content": "x"}]}), "'model' is required"),
        (orjson.dumps({"model": "m"}), "'messages' must be a non-empty list"),
        (orjson.dumps({"model": "m", "messages": [{"content": 3}]}), "string or a list"),
        (_chat(max_tokens=0), "'max_tokens' must be a positive integer"),
        (_chat(stream="yes"), "'stream' must be a boolean"),
    ],
)
def test_bad_bodies(raw: bytes, message: str) -> None:
    with pytest.raises(BadRequest, match=message):
        parse_request(raw, chat=True)


def test_completions_prompt_forms() -> None:
    assert parse_request(b'{"model":"m","prompt":"abcd"}', chat=False).prompt_tokens_est == 1
    assert parse_request(b'{"model":"m","prompt":[1,2,3]}', chat=False).prompt_tokens_est == 3
    with pytest.raises(BadRequest):
        parse_request(b'{"model":"m","prompt":7}', chat=False)


def test_keyring_plaintext_and_sha256() -> None:
    digest = hashlib.sha256(b"prod-key").hexdigest()
    policy = parse_policy(f"""
tenants:
  - {{name: dev, apiKeys: [dev-key], priority: 0}}
  - {{name: prod, apiKeySha256: ["{digest.upper()}"], priority: 2}}
admin: {{apiKeys: [adm]}}
""")
    ring = KeyRing(policy)
    assert ring.tenant_for("dev-key").name == "dev"
    assert ring.tenant_for("prod-key").name == "prod"
    assert ring.tenant_for("nope") is None
    assert ring.is_admin("adm") and not ring.is_admin("dev-key")
    assert KeyRing.bearer("Bearer  abc ") == "abc"
    assert KeyRing.bearer("Basic abc") is None and KeyRing.bearer("Bearer ") is None


def test_retry_after_headers_are_whole_seconds_at_least_one() -> None:
    assert retry_after_headers(0.2) == {"Retry-After": "1", "retry-after-ms": "200"}
    assert retry_after_headers(2.01) == {"Retry-After": "3", "retry-after-ms": "2010"}


def test_a_retry_after_within_the_clients_deadline_stays_within_it_in_whole_seconds() -> None:
    # 2.75 s to a slot, 2.9 s left: "3" would point past the deadline
    assert retry_after_headers(2.75, within_s=2.9) == {
        "Retry-After": "2",
        "retry-after-ms": "2750",
    }
    assert retry_after_headers(1.3, within_s=1.8) == {
        "Retry-After": "1",
        "retry-after-ms": "1300",
    }
    assert retry_after_headers(2.75, within_s=3.0)["Retry-After"] == "3"  # it fits
    # never below 1, whatever is left (HTTP: whole seconds, at least 1); with less
    # than 1 s left the core answers cannot_serve_in_time instead (test_core_retry_after)
    assert retry_after_headers(0.4, within_s=0.9) == {
        "Retry-After": "1",
        "retry-after-ms": "400",
    }
    assert retry_after_headers(0.0, within_s=0.5) == {"Retry-After": "1", "retry-after-ms": "1"}
    # a rule with no deadline bound (fixed, drain) is not rewritten into another promise
    assert retry_after_headers(60.0, within_s=5.0)["Retry-After"] == "60"


def test_cannot_serve_in_time_has_no_retry_after_and_says_not_to_retry() -> None:
    resp = reject_response(RejectCode.CANNOT_SERVE_IN_TIME, 41.2, "batch-extraction", {})
    assert resp.status == 429
    assert "Retry-After" not in resp.headers and "retry-after-ms" not in resp.headers
    assert resp.headers["x-should-retry"] == "false"
    body = orjson.loads(resp.body)
    assert body["error"]["code"] == "cannot_serve_in_time"
    assert "about 42 s" in body["error"]["message"]


def test_reject_response_shape() -> None:
    resp = reject_response(
        RejectCode.FAST_REJECT, 4.5, "batch-extraction", {"X-Sluice-Priority": "2"}
    )
    assert resp.status == 429
    assert resp.headers["Retry-After"] == "5" and resp.headers["retry-after-ms"] == "4500"
    body = orjson.loads(resp.body)
    assert body["error"]["code"] == "fast_reject"
    assert body["error"]["type"] == "rate_limit_error"
    assert "batch-extraction" in body["error"]["message"]


VLLM_METRICS = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 7.0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="m"} 3.0
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.93
# TYPE vllm:num_preemptions_total counter
vllm:num_preemptions_total{engine="0",model_name="m"} 12.0
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="16",num_gpu_blocks="2048",engine="0"} 1.0
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_bucket{le="0.1",model_name="m"} {a}
vllm:time_to_first_token_seconds_bucket{le="0.5",model_name="m"} {b}
vllm:time_to_first_token_seconds_bucket{le="+Inf",model_name="m"} {c}
vllm:time_to_first_token_seconds_count{model_name="m"} {c}
vllm:time_to_first_token_seconds_sum{model_name="m"} 1.0
"""


def _metrics(a: int, b: int, c: int) -> str:
    return VLLM_METRICS.replace("{a}", str(a)).replace("{b}", str(b)).replace("{c}", str(c))


def test_vllm_metrics_parse_with_windowed_p95() -> None:
    parser = VllmAdapter()
    m = parser.read({"/metrics": _metrics(100, 100, 100)}, at=1.0)
    assert (m.running, m.waiting, m.kv_usage, m.preemptions_total) == (7.0, 3.0, 0.93, 12.0)
    assert (m.num_gpu_blocks, m.block_size) == (2048, 16)
    assert m.ttft_p95_s == pytest.approx(0.095)
    # In the next window all 20 new requests were slower than 0.1 s.
    m2 = parser.read({"/metrics": _metrics(100, 120, 120)}, at=1.25)
    assert m2.ttft_p95_s == pytest.approx(0.1 + 0.4 * 0.95)


def test_older_vllm_names_and_unknown_fields() -> None:
    text = "vllm:gpu_cache_usage_perc 0.5\nvllm:num_requests_running 2\n"
    m = VllmAdapter().read({"/metrics": text}, at=0.0)
    assert (m.kv_usage, m.running, m.waiting, m.num_gpu_blocks) == (0.5, 2.0, None, None)


# -- issue 14, item 10: every field that becomes prompt tokens, every sequence -------------


def test_tools_count_as_the_prompt_they_become() -> None:
    """20 kB in a tool's description costs what 20 kB in a message does (the chat template
    renders the tools into the prompt): within 5 %."""
    text = "lorem ipsum dolor sit amet " * 750  # ~20 kB
    user = [{"role": "user", "content": "hi"}]
    in_message = parse_request(
        orjson.dumps({"model": "m", "messages": [{"role": "user", "content": text}]}), chat=True
    )
    tool = {"type": "function", "function": {"name": "f", "description": text, "parameters": {}}}
    in_tools = parse_request(
        orjson.dumps({"model": "m", "messages": user, "tools": [tool]}), chat=True
    )
    assert in_tools.prompt_tokens_est == pytest.approx(in_message.prompt_tokens_est, rel=0.05)
    legacy = parse_request(
        orjson.dumps({"model": "m", "messages": user, "functions": [tool["function"]]}),
        chat=True,
    )
    assert legacy.prompt_tokens_est == pytest.approx(in_message.prompt_tokens_est, rel=0.05)


def test_tool_calls_and_names_in_messages_count_too() -> None:
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "x" * 4000}}
    messages = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "y" * 400},
    ]
    req = parse_request(orjson.dumps({"model": "m", "messages": messages}), chat=True)
    assert req.prompt_tokens_est > 1000 + 100


@pytest.mark.parametrize(
    ("fields", "chat", "sequences"),
    [
        ({}, True, 1),
        ({"n": 4}, True, 4),
        ({"n": 2, "best_of": 5}, False, 5),
        ({"prompt": ["a", "b", "c"], "n": 2}, False, 6),  # three prompts, two each
        ({"prompt": [1, 2, 3]}, False, 1),  # one prompt of token ids
        ({"prompt": [[1, 2], [3]]}, False, 2),
    ],
)
def test_every_sequence_the_engine_runs_is_counted(
    fields: dict[str, object], chat: bool, sequences: int
) -> None:
    body: dict[str, object] = {"model": "m", "max_tokens": 10}
    if chat:
        body["messages"] = [{"role": "user", "content": "hi"}]
    else:
        body["prompt"] = "hi"
    body.update(fields)
    assert parse_request(orjson.dumps(body), chat=chat).sequences == sequences


def test_n_must_be_a_positive_integer() -> None:
    with pytest.raises(BadRequest, match="'n' must be a positive integer"):
        parse_request(_chat(n=0), chat=True)


def test_the_core_charges_each_sequence_its_output() -> None:
    from sluice.core.token_cost import TokenCostModel

    model = TokenCostModel()
    assert model.footprint("t", "m", 100, 200, sequences=4) == 100 + 4 * 100
    model.observe("t", "m", 100, 100, 400, sequences=4)  # usage sums the four
    assert model.expected_output("t", "m", 200) == 100.0
