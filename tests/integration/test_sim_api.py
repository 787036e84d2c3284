"""vLLM's OpenAI surface of a real `sluice sim` process: answers, streams, errors, metrics."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from tests.integration.conftest import SimProcess, start_sim

from sluice.bench.prom_text import parse_metrics

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def shared_sim() -> Iterator[SimProcess]:
    """One tiny simulator for the tests that do not look at its counters."""
    sim = start_sim("--profile", "tiny")
    yield sim
    sim.stop()


USER = [{"role": "user", "content": "x" * 40}]  # 10 tokens + 5 (message) + 5 (prompt)


def post(sim: SimProcess, path: str, body: Any) -> httpx.Response:
    return httpx.post(sim.url + path, json=body, timeout=10)


def sse_events(response: httpx.Response) -> list[Any]:
    events = []
    for line in response.iter_lines():
        if not line:
            continue
        assert line.startswith("data: ")
        data = line[len("data: ") :]
        events.append(data if data == "[DONE]" else json.loads(data))
    return events


def test_models_health_and_version(shared_sim: SimProcess) -> None:
    models = httpx.get(shared_sim.url + "/v1/models").json()
    assert models["object"] == "list"
    assert [m["id"] for m in models["data"]] == ["sluice-sim"]
    assert models["data"][0]["max_model_len"] == 2048
    assert httpx.get(shared_sim.url + "/health").status_code == 200
    assert httpx.get(shared_sim.url + "/version").json() == {"version": "sluice-sim"}


def test_chat_completion_counts_prompt_tokens_and_honours_max_tokens(
    shared_sim: SimProcess,
) -> None:
    body = {"model": "sluice-sim", "messages": USER, "max_tokens": 7, "ignore_eos": True}
    answer = post(shared_sim, "/v1/chat/completions", body).json()
    assert answer["object"] == "chat.completion"
    assert answer["id"].startswith("chatcmpl-")
    assert answer["usage"] == {"prompt_tokens": 20, "completion_tokens": 7, "total_tokens": 27}
    choice = answer["choices"][0]
    assert choice["finish_reason"] == "length"
    assert choice["message"]["role"] == "assistant"
    assert len(choice["message"]["content"].split()) == 7


def test_max_completion_tokens_wins_over_max_tokens(shared_sim: SimProcess) -> None:
    body = {"messages": USER, "max_tokens": 50, "max_completion_tokens": 3, "ignore_eos": True}
    answer = post(shared_sim, "/v1/chat/completions", body).json()
    assert answer["usage"]["completion_tokens"] == 3


def test_output_without_ignore_eos_stops_at_or_before_max_tokens(shared_sim: SimProcess) -> None:
    reasons = set()
    for _ in range(12):
        answer = post(
            shared_sim, "/v1/chat/completions", {"messages": USER, "max_tokens": 64}
        ).json()
        n = answer["usage"]["completion_tokens"]
        reason = answer["choices"][0]["finish_reason"]
        assert 1 <= n <= 64
        assert reason == ("length" if n == 64 else "stop")
        reasons.add(reason)
    assert "stop" in reasons


def test_greedy_or_seeded_requests_repeat_their_answer(shared_sim: SimProcess) -> None:
    body = {"messages": USER, "max_tokens": 400, "seed": 7, "temperature": 0}
    first = post(shared_sim, "/v1/chat/completions", body).json()
    again = post(shared_sim, "/v1/chat/completions", body).json()
    assert first["choices"][0]["message"] == again["choices"][0]["message"]
    assert first["usage"] == again["usage"]
    with httpx.stream(
        "POST", shared_sim.url + "/v1/chat/completions", json={**body, "stream": True}
    ) as r:
        streamed = "".join(
            e["choices"][0]["delta"].get("content", "")
            for e in sse_events(r)
            if e != "[DONE]" and e["choices"]
        )
    assert streamed == first["choices"][0]["message"]["content"]
    # sampled requests (no seed, temperature > 0) vary
    lengths = {
        post(shared_sim, "/v1/chat/completions", {"messages": USER, "max_tokens": 400}).json()[
            "usage"
        ]["completion_tokens"]
        for _ in range(5)
    }
    assert len(lengths) > 1


def test_content_as_parts_and_unknown_fields_are_accepted(shared_sim: SimProcess) -> None:
    body = {
        "messages": [
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": [{"type": "text", "text": "x" * 40}]},
        ],
        "max_tokens": 2,
        "temperature": 0.3,
        "top_p": 0.9,
        "seed": 5,
        "user": "someone",
        "response_format": {"type": "text"},
        "logit_bias": {},
    }
    answer = post(shared_sim, "/v1/chat/completions", body).json()
    # 5 + (5 + 2) + (5 + 10)
    assert answer["usage"]["prompt_tokens"] == 27


def test_completions_endpoint(shared_sim: SimProcess) -> None:
    answer = post(shared_sim, "/v1/completions", {"prompt": "y" * 80, "max_tokens": 4}).json()
    assert answer["object"] == "text_completion"
    assert answer["usage"]["prompt_tokens"] == 20
    assert answer["choices"][0]["text"]
    # token ids are counted as they are
    answer = post(shared_sim, "/v1/completions", {"prompt": [1, 2, 3], "max_tokens": 1}).json()
    assert answer["usage"]["prompt_tokens"] == 3


def test_chat_stream_is_shaped_like_vllm(shared_sim: SimProcess) -> None:
    body = {
        "messages": USER,
        "max_tokens": 5,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    with httpx.stream("POST", shared_sim.url + "/v1/chat/completions", json=body, timeout=10) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        events = sse_events(r)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    content = [c for c in chunks if c["choices"]]
    assert len(content) == 1 + 5
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert len({c["id"] for c in chunks}) == 1
    assert [c["choices"][0]["finish_reason"] for c in content[1:]] == [None] * 4 + ["length"]
    usage = chunks[-1]
    assert usage["choices"] == []
    assert usage["usage"] == {"prompt_tokens": 20, "completion_tokens": 5, "total_tokens": 25}


def test_completion_stream_with_continuous_usage(shared_sim: SimProcess) -> None:
    body = {
        "prompt": "z" * 40,
        "max_tokens": 3,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    }
    with httpx.stream("POST", shared_sim.url + "/v1/completions", json=body, timeout=10) as r:
        events = sse_events(r)
    assert events[-1] == "[DONE]"
    tokens = [e for e in events[:-1] if e["choices"]]
    assert [e["usage"]["completion_tokens"] for e in tokens] == [1, 2, 3]
    assert all(e["object"] == "text_completion" for e in tokens)
    assert events[-2]["usage"]["total_tokens"] == 10 + 3


def test_stream_without_usage_has_no_usage_chunk(shared_sim: SimProcess) -> None:
    body = {"messages": USER, "max_tokens": 2, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", shared_sim.url + "/v1/chat/completions", json=body, timeout=10) as r:
        events = sse_events(r)
    assert events[-1] == "[DONE]"
    assert all(e["choices"] and "usage" not in e for e in events[:-1])


@pytest.mark.parametrize(
    ("path", "raw", "status", "needle"),
    [
        ("/v1/chat/completions", b"{not json", 400, "Invalid JSON"),
        ("/v1/chat/completions", b"[1, 2]", 400, "JSON object"),
        ("/v1/chat/completions", b'{"max_tokens": 3}', 400, "messages"),
        ("/v1/chat/completions", b'{"messages": []}', 400, "messages"),
        ("/v1/chat/completions", b'{"messages": [{"content": "hi"}]}', 400, "role"),
        ("/v1/chat/completions", b'{"model": "gpt-9", "messages": []}', 404, "gpt-9"),
        ("/v1/completions", b'{"max_tokens": 3}', 400, "prompt"),
        (
            "/v1/chat/completions",
            b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}',
            400,
            "max_tokens",
        ),
        (
            "/v1/chat/completions",
            b'{"messages": [{"role": "user", "content": "hi"}], "stream_options": '
            b'{"include_usage": true}}',
            400,
            "stream=True",
        ),
    ],
)
def test_bad_requests_get_vllm_errors(
    shared_sim: SimProcess, path: str, raw: bytes, status: int, needle: str
) -> None:
    response = httpx.post(
        shared_sim.url + path, content=raw, headers={"Content-Type": "application/json"}, timeout=10
    )
    assert response.status_code == status
    error = response.json()["error"]
    assert needle in error["message"]
    assert error["code"] == status
    assert error["type"] == ("NotFoundError" if status == 404 else "BadRequestError")


def test_a_prompt_longer_than_max_model_len_is_a_400_with_a_message(shared_sim: SimProcess) -> None:
    long_prompt = [{"role": "user", "content": "w" * 4 * 2100}]
    response = post(shared_sim, "/v1/chat/completions", {"messages": long_prompt})
    assert response.status_code == 400
    message = response.json()["error"]["message"]
    assert "maximum context length is 2048 tokens" in message
    assert "2110 input tokens" in message
    response = post(shared_sim, "/v1/chat/completions", {"messages": USER, "max_tokens": 2040})
    assert response.status_code == 400
    assert (
        "you requested 2060 tokens (20 in the messages, 2040 in the completion)"
        in (response.json()["error"]["message"])
    )
    # the simulator is still fine
    assert (
        post(shared_sim, "/v1/chat/completions", {"messages": USER, "max_tokens": 1}).status_code
        == 200
    )


def test_unknown_route_is_a_json_404(shared_sim: SimProcess) -> None:
    response = httpx.get(shared_sim.url + "/v1/nothing")
    assert response.status_code == 404
    assert response.json()["error"]["code"] == 404


def test_metrics_use_vllm_names_and_labels(sim: SimProcess) -> None:
    post(sim, "/v1/chat/completions", {"messages": USER, "max_tokens": 4, "ignore_eos": True})
    text = sim.metrics_text()
    m = parse_metrics(text)
    labels = 'engine="0",model_name="sluice-sim"'
    for gauge in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc"):
        assert m[f"vllm:{gauge}{{{labels}}}"] == 0.0
    assert m["vllm:num_preemptions_total"] == 0.0
    assert m["vllm:prompt_tokens_total"] == 20.0
    assert m["vllm:generation_tokens_total"] == 4.0
    success = (
        'vllm:request_success_total{{engine="0",finished_reason="{}",model_name="sluice-sim"}}'
    )
    assert m[success.format("length")] == 1.0
    assert m[success.format("stop")] == m[success.format("abort")] == 0.0
    for hist in (
        "time_to_first_token_seconds",
        "request_time_per_output_token_seconds",
        "e2e_request_latency_seconds",
        "request_queue_time_seconds",
    ):
        assert m[f"vllm:{hist}_count"] == 1.0, hist
    assert m["vllm:inter_token_latency_seconds_count"] == 3.0
    assert 0 < m["vllm:time_to_first_token_seconds_sum"] < 1.0
    info = next(line for line in text.splitlines() if line.startswith("vllm:cache_config_info{"))
    assert 'num_gpu_blocks="256"' in info and 'block_size="16"' in info


def test_overrides_show_in_metrics_and_models(sim_factory: Any) -> None:
    sim = sim_factory(
        "--profile", "tiny", "--kv-blocks", "64", "--block-size", "32", "--model", "my-llm"
    )
    assert "64 KV blocks x 32 tokens" in sim.ready_line
    assert httpx.get(sim.url + "/v1/models").json()["data"][0]["id"] == "my-llm"
    info = next(
        line for line in sim.metrics_text().splitlines() if line.startswith("vllm:cache_config")
    )
    assert 'num_gpu_blocks="64"' in info and 'block_size="32"' in info
    body = {"model": "my-llm", "messages": USER, "max_tokens": 1}
    assert post(sim, "/v1/chat/completions", body).status_code == 200
