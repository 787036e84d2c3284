"""What differs per route, as data (gateway/routes/): each route's cost from its body, its
usage from its answer and its stream, its error shape, and the stored-response registry."""

from __future__ import annotations

import io
import wave

import orjson
import pytest
from multidict import CIMultiDict, CIMultiDictProxy

from sluice.core.types import RejectCode
from sluice.gateway.error_shapes import ANTHROPIC, OPENAI, OPENAI_RESPONSES
from sluice.gateway.request_body import BadRequest
from sluice.gateway.response_store import ResponseStore
from sluice.gateway.routes import PROXIED, audio, messages, openai_api, pooling, responses
from sluice.gateway.routes.bodies import Unsupported, input_tokens

NO_HEADERS: CIMultiDictProxy[str] = CIMultiDictProxy(CIMultiDict())


def _raw(body: object) -> bytes:
    return orjson.dumps(body)


def test_every_route_has_a_name_and_one_handler_per_path() -> None:
    paths = [(method, path) for method, path, _ in PROXIED]
    assert len(paths) == len(set(paths))
    names = {spec.name for _, _, spec in PROXIED}
    assert {"chat", "responses", "messages", "embeddings", "rerank", "tokenize"} <= names


# --- cost -----------------------------------------------------------------------------------


def test_responses_cost_counts_input_instructions_and_tools() -> None:
    text = "x" * 40  # 10 tokens at 4 characters a token
    plain = responses.parse_responses(_raw({"model": "m", "input": text}), NO_HEADERS)
    assert plain.prompt_tokens_est == 10 and plain.max_tokens is None and not plain.stream
    items = [
        {"role": "user", "content": [{"type": "input_text", "text": text}]},
        {"type": "function_call_output", "call_id": "c1", "output": text},
    ]
    body = {
        "model": "m",
        "input": items,
        "instructions": text,
        "tools": [{"type": "function", "name": "f"}],
        "max_output_tokens": 64,
        "stream": True,
    }
    parsed = responses.parse_responses(_raw(body), NO_HEADERS)
    # two items (4 template tokens each + 10), instructions (4 + 10), a tool (its name)
    assert parsed.prompt_tokens_est == 2 * 14 + 14 + 1
    assert parsed.max_tokens == 64 and parsed.stream


def test_a_background_response_is_refused_with_its_own_code() -> None:
    with pytest.raises(Unsupported) as refused:
        responses.parse_responses(
            _raw({"model": "m", "input": "x", "background": True}), NO_HEADERS
        )
    assert refused.value.code == "background_not_supported"
    with pytest.raises(BadRequest, match="'input'"):
        responses.parse_responses(_raw({"model": "m"}), NO_HEADERS)


def test_messages_cost_counts_system_blocks_and_tools() -> None:
    text = "y" * 20  # 5 tokens
    body = {
        "model": "m",
        "max_tokens": 100,
        "system": [{"type": "text", "text": text}],
        "messages": [
            {"role": "user", "content": text},
            {"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "f",
                                               "input": {"q": text}}]},
            {"role": "user", "content": [{"type": "image", "source": {"data": "z" * 9000}}]},
        ],
    }  # fmt: skip
    parsed = messages.parse_messages(_raw(body), NO_HEADERS)
    # system 4 + 5; messages: 4 + 5, 4 + (name 1 + input 5), 4 + an image's floor (256)
    assert parsed.prompt_tokens_est == 9 + 9 + 10 + 4 + 256
    assert parsed.max_tokens == 100


def test_pooling_cost_is_every_input_and_every_pair() -> None:
    embed = pooling.parse_inputs(_raw({"model": "m", "input": ["a" * 8, "b" * 4]}), NO_HEADERS)
    assert (embed.prompt_tokens_est, embed.sequences) == (3, 2)
    ids = pooling.parse_inputs(_raw({"model": "m", "input": [[1, 2, 3], [4]]}), NO_HEADERS)
    assert (ids.prompt_tokens_est, ids.sequences) == (4, 2)
    # a query against three documents: three sequences, each holding the query
    rerank = {"model": "m", "query": "q" * 8, "documents": ["d" * 4, "d" * 4, "d" * 8]}
    pairs = pooling.parse_pairs(_raw(rerank), NO_HEADERS)
    assert (pairs.prompt_tokens_est, pairs.sequences) == (3 * 2 + 4, 3)
    with pytest.raises(BadRequest):
        pooling.parse_pairs(_raw({"model": "m", "query": "q"}), NO_HEADERS)
    assert all(spec.prefill_only for _, path, spec in PROXIED if spec.parse is pooling.parse_pairs)


def test_a_batch_is_one_sequence_per_conversation() -> None:
    body = {"model": "m", "max_tokens": 8, "messages": [[{"content": "a" * 4}], [{"content": "b"}]]}
    parsed = openai_api.parse_chat_batch(_raw(body), NO_HEADERS)
    assert (parsed.prompt_tokens_est, parsed.sequences, parsed.max_tokens) == (10, 2, 8)


def _wav(seconds: float, rate: int = 16000) -> bytes:
    out = io.BytesIO()
    with wave.open(out, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(b"\0\0" * int(rate * seconds))
    return out.getvalue()


def _form(upload: bytes, **fields: str) -> tuple[bytes, CIMultiDictProxy[str]]:
    boundary = "sluiceboundary"
    parts = [
        f'--{boundary}\r\nContent-Disposition: form-data; name="{k}"\r\n\r\n{v}\r\n'.encode()
        for k, v in fields.items()
    ]
    parts.append(
        f'--{boundary}\r\nContent-Disposition: form-data; name="file"; filename="a"\r\n'
        "Content-Type: application/octet-stream\r\n\r\n".encode()
        + upload
        + b"\r\n"
    )
    headers = CIMultiDict({"Content-Type": f"multipart/form-data; boundary={boundary}"})
    return b"".join(parts) + f"--{boundary}--\r\n".encode(), CIMultiDictProxy(headers)


def test_audio_is_costed_by_its_duration_in_30_second_windows() -> None:
    assert audio.audio_duration(_wav(12.5)) == pytest.approx(12.5)
    assert audio.audio_duration(b"\xff" * 32_000) == 2.0  # compressed: 16 kB a second
    assert audio.audio_duration(b"\xff" * 10**8) == 600.0  # the backend's limit
    raw, headers = _form(_wav(65.0), model="whisper", stream="true")
    parsed = audio.parse_audio(raw, headers)
    assert parsed.model == "whisper" and parsed.stream
    assert parsed.sequences == 3  # 30 + 30 + 5 seconds
    assert parsed.prompt_tokens_est == 3 * audio.WINDOW_TOKENS
    assert parsed.max_tokens == 87  # 4 tokens a second of its audio, per window
    with pytest.raises(BadRequest, match="model"):
        audio.parse_audio(*_form(_wav(1.0)))
    with pytest.raises(BadRequest, match="multipart"):
        audio.parse_audio(b"{}", NO_HEADERS)


def test_input_tokens_skip_structure_keys() -> None:
    assert input_tokens({"type": "input_text", "role": "user", "text": "abcd"}) == 1
    assert input_tokens([[1, 2], "abcdefgh", None, True]) == 4


# --- usage ----------------------------------------------------------------------------------


def test_each_route_finds_its_usage_in_its_answer() -> None:
    chat = _raw({"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": 3}})
    assert openai_api.CHAT.usage.read(chat) == (7, 3)
    answer = {
        "id": "resp_1",
        "usage": {
            "input_tokens": 11,
            "input_tokens_details": {"cached_tokens": 2},
            "output_tokens": 5,
        },
    }
    assert responses.RESPONSES.usage.read(_raw(answer)) == (11, 5)
    message = {"usage": {"input_tokens": 4, "cache_read_input_tokens": 6, "output_tokens": 9}}
    assert messages.MESSAGES.usage.read(_raw(message)) == (10, 9)  # cached input counts
    embedded = _raw({"data": [], "usage": {"prompt_tokens": 12, "total_tokens": 12}})
    assert pooling.EMBEDDINGS.usage.read(embedded) == (12, None)


def _events(*events: tuple[str, dict[str, object]]) -> bytes:
    return b"".join(b"event: %s\ndata: %s\n\n" % (k.encode(), orjson.dumps(v)) for k, v in events)


def test_each_route_finds_its_usage_in_its_stream() -> None:
    usage = {"input_tokens": 8, "input_tokens_details": {"cached_tokens": 0}, "output_tokens": 4}
    completed = {"type": "response.completed", "response": {"id": "resp_1", "usage": usage}}
    stream = _events(
        ("response.created", {"type": "response.created", "response": {"usage": None}}),
        ("response.output_text.delta", {"delta": "hi"}),
        ("response.completed", completed),
    )
    shape = responses.RESPONSES_STREAM
    kept, usage = shape.take_usage(stream, responses.RESPONSES_USAGE, False, (None, None))
    assert usage == (8, 4) and kept == stream  # nothing cut from a Responses stream
    anthropic = _events(
        ("message_start", {"type": "message_start", "message": {"usage": {"input_tokens": 6,
                                                                           "output_tokens": 0}}}),
        ("content_block_delta", {"delta": {"text": "x"}}),
        ("message_delta", {"type": "message_delta", "usage": {"output_tokens": 12}}),
    )  # fmt: skip
    _, usage = messages.ANTHROPIC_STREAM.take_usage(
        anthropic, messages.ANTHROPIC_USAGE, False, (None, None)
    )
    # the input from message_start, the output from message_delta
    assert usage == (6, 12)


def test_a_stored_response_is_found_by_its_id_in_an_answer_or_a_stream() -> None:
    assert responses.response_id_of(b'{"id":"resp_abc","object":"response"}') == "resp_abc"
    head = b'event: response.created\ndata: {"response":{"id":"resp_x1","output":[]}}\n\n'
    assert responses.response_id_of(head) == "resp_x1"
    assert responses.response_id_of(b'{"id":"chatcmpl-1"}') is None


# --- errors ---------------------------------------------------------------------------------


def _body(response: object) -> dict[str, object]:
    return orjson.loads(response.body)  # type: ignore[attr-defined, no-any-return]


def test_anthropic_overload_is_529_and_its_quota_429() -> None:
    full = ANTHROPIC.reject(RejectCode.QUEUE_FULL, 2.2, "p0", {"X-Sluice-Priority": "0"})
    assert full.status == 529 and full.headers["Retry-After"] == "3"
    assert full.headers["retry-after-ms"] == "2200" and full.headers["X-Sluice-Priority"] == "0"
    body = _body(full)
    assert body["type"] == "error"
    assert body["error"] == {
        "type": "overloaded_error",
        "message": "The p0 queue is full; retry after the indicated delay (code: queue_full).",
    }
    quota = ANTHROPIC.reject(RejectCode.TENANT_QUOTA, 1.0, "p0", {})
    assert quota.status == 429 and _body(quota)["error"]["type"] == "rate_limit_error"  # type: ignore[index]
    assert ANTHROPIC.overloaded("busy", {}).status == 529
    # OpenAI's shape keeps its own statuses
    assert OPENAI.reject(RejectCode.QUEUE_FULL, 1.0, "p0", {}).status == 429
    assert OPENAI.reject(RejectCode.NO_BACKEND, 1.0, "p0", {}).status == 503
    assert OPENAI.overloaded("busy", {}).status == 503


def test_a_broken_stream_ends_with_the_routes_own_error_event() -> None:
    chat = OPENAI.stream_failure(502, "cut", "upstream_error")
    assert chat.startswith(b"data: {") and chat.endswith(b"data: [DONE]\n\n")
    kind, data = OPENAI_RESPONSES.stream_failure(502, "cut", "upstream_error").split(b"\n", 1)
    assert kind == b"event: error"
    assert orjson.loads(data.removeprefix(b"data: "))["type"] == "error"
    kind, data = ANTHROPIC.stream_failure(502, "cut", "upstream_error").split(b"\n", 1)
    event = orjson.loads(data.removeprefix(b"data: "))
    assert kind == b"event: error" and event["error"]["type"] == "api_error"


# --- the stored-response registry ---------------------------------------------------------


def test_stored_responses_are_found_only_by_their_tenant() -> None:
    store = ResponseStore(limit=2)
    store.remember("resp_a", "b0", "alice", 30)
    found = store.locate("resp_a", "alice")
    assert found is not None and (found.backend, found.tokens) == ("b0", 30)
    assert store.locate("resp_a", "bob") is None
    store.remember("resp_b", "b1", "alice", 1)
    store.remember("resp_c", "b1", "alice", 1)
    assert store.locate("resp_a", "alice") is None and len(store) == 2  # the oldest forgotten
