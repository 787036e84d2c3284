"""Request validation, token counting and the bytes of answers, without a server."""

from __future__ import annotations

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sluice.sim import tokens
from sluice.sim.openai_api import (
    CHAT,
    COMPLETION,
    ApiError,
    ResponseFormatter,
    parse_request,
)


def parse(kind: str, body: object, max_model_len: int = 100) -> object:
    return parse_request(kind, orjson.dumps(body), served_model="m", max_model_len=max_model_len)


def test_text_tokens_are_four_bytes_each_rounded_up() -> None:
    assert tokens.count_text_tokens("") == 0
    assert tokens.count_text_tokens("abc") == 1
    assert tokens.count_text_tokens("abcd") == 1
    assert tokens.count_text_tokens("abcde") == 2
    assert tokens.count_text_tokens("你好") == 2  # 6 bytes of UTF-8


def test_chat_tokens_add_the_template_overhead() -> None:
    one = [{"role": "user", "content": "abcd" * 3}]
    assert tokens.count_chat_tokens(one) == 5 + 5 + 3
    parts = [{"role": "user", "content": [{"type": "text", "text": "abcd"}, {"type": "image"}]}]
    assert tokens.count_chat_tokens(parts) == 5 + 5 + 1
    two = [{"role": "system", "content": "abcd"}, {"role": "user", "content": None}]
    assert tokens.count_chat_tokens(two) == 5 + 5 + 1 + 5


def test_chat_request_defaults_and_overrides() -> None:
    g = parse(CHAT, {"messages": [{"role": "user", "content": "abcd"}]})
    assert (g.prompt_tokens, g.max_tokens, g.stream, g.ignore_eos) == (11, 89, False, False)
    g = parse(
        CHAT,
        {
            "model": "m",
            "messages": [{"role": "user", "content": "abcd"}],
            "max_tokens": 50,
            "max_completion_tokens": 7,
            "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True},
            "ignore_eos": True,
            "min_tokens": 3,
            "whatever": {"unused": 1},
        },
    )
    assert (g.max_tokens, g.min_tokens, g.ignore_eos) == (7, 3, True)
    assert (g.stream, g.include_usage, g.continuous_usage) == (True, True, True)


def test_completion_request_defaults_to_16_tokens() -> None:
    g = parse(COMPLETION, {"prompt": "abcdabcd"})
    assert (g.prompt_tokens, g.max_tokens) == (2, 16)
    assert parse(COMPLETION, {"prompt": [5, 6, 7]}).prompt_tokens == 3
    assert parse(COMPLETION, {"prompt": ["abcd"]}).prompt_tokens == 1


@pytest.mark.parametrize(
    ("kind", "body", "status", "needle"),
    [
        (CHAT, {"messages": [{"role": "user", "content": "a" * 400}]}, 400, "has 110 input"),
        (CHAT, {"messages": [{"role": "user", "content": "a"}], "max_tokens": 90}, 400, "101"),
        (CHAT, {"model": "other", "messages": []}, 404, "`other` does not exist"),
        (CHAT, {"messages": "hi"}, 400, "non-empty list"),
        (CHAT, {"messages": [{"role": "user", "content": 5}]}, 400, "content"),
        (CHAT, {"messages": [{"role": "u"}], "max_tokens": "9"}, 400, "integer"),
        (CHAT, {"messages": [{"role": "u"}], "n": 2}, 400, "n > 1"),
        (CHAT, {"messages": [{"role": "u"}], "stream": "yes"}, 400, "boolean"),
        (COMPLETION, {"prompt": ["a", "b"]}, 400, "batched"),
        (COMPLETION, {"prompt": 5}, 400, "prompt must be"),
    ],
)
def test_bad_requests(kind: str, body: object, status: int, needle: str) -> None:
    with pytest.raises(ApiError) as info:
        parse(kind, body)
    assert info.value.status == status
    assert needle in info.value.message
    shape = orjson.loads(info.value.body())
    assert set(shape["error"]) == {"message", "type", "param", "code"}


def test_stream_chunks_are_valid_json_in_vllm_shape() -> None:
    fmt = ResponseFormatter(CHAT, "chatcmpl-1", 'odd"name', prompt_tokens=12)
    role = orjson.loads(fmt.role_chunk()[len(b"data: ") :])
    assert role["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert role["model"] == 'odd"name'
    mid = orjson.loads(fmt.token_chunk(0, None)[len(b"data: ") :])
    assert mid["choices"][0]["delta"]["content"] == tokens.word(fmt.offset, 0)
    assert mid["choices"][0]["finish_reason"] is None
    last = orjson.loads(fmt.token_chunk_with_usage(2, "length")[len(b"data: ") :])
    assert last["choices"][0]["finish_reason"] == "length"
    assert last["usage"] == {"prompt_tokens": 12, "total_tokens": 15, "completion_tokens": 3}
    usage = orjson.loads(fmt.usage_chunk(3)[len(b"data: ") :])
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 3
    assert fmt.token_chunk(1, None).endswith(b"\n\n")


def test_whole_answers_carry_the_text_and_usage() -> None:
    fmt = ResponseFormatter(COMPLETION, "cmpl-1", "m", prompt_tokens=4)
    body = orjson.loads(fmt.full_response(3, "stop"))
    assert body["object"] == "text_completion"
    assert body["choices"][0]["text"] == "".join(tokens.word(fmt.offset, i) for i in range(3))
    assert body["choices"][0]["finish_reason"] == "stop"
    assert body["usage"] == {"prompt_tokens": 4, "total_tokens": 7, "completion_tokens": 3}
    assert ResponseFormatter(COMPLETION, "cmpl-1", "m", 4).role_chunk() == b""


_json = st.recursive(
    st.none() | st.booleans() | st.integers(-5, 5000) | st.floats(allow_nan=False) | st.text(),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4)
    ),
    max_leaves=12,
)
_field = st.sampled_from(
    ["messages", "prompt", "max_tokens", "max_completion_tokens", "stream", "stream_options",
     "model", "n", "min_tokens", "ignore_eos", "role", "content", "tool_calls", "name"]
)  # fmt: skip
_message = st.dictionaries(_field, _json, max_size=4).map(lambda m: {"role": "user", **m})


@settings(max_examples=150, deadline=None)
@given(
    st.sampled_from([CHAT, COMPLETION]),
    st.dictionaries(_field, _json | st.lists(_message, max_size=3), max_size=6),
)
def test_any_json_body_is_either_accepted_or_a_clear_error(kind: str, body: dict) -> None:
    try:
        g = parse(kind, body, max_model_len=2048)
    except ApiError as err:
        assert err.status in (400, 404) and err.message
        return
    assert g.prompt_tokens >= 1 and g.max_tokens >= 1
    assert g.prompt_tokens + g.max_tokens <= 2048
    assert 0 <= g.min_tokens <= g.max_tokens


def test_greedy_or_seeded_requests_get_a_sample_key_from_their_prompt() -> None:
    msgs = [{"role": "user", "content": "abcd"}]
    assert parse(CHAT, {"messages": msgs}).sample_key is None
    assert parse(CHAT, {"messages": msgs, "temperature": 0.7}).sample_key is None
    greedy = parse(CHAT, {"messages": msgs, "temperature": 0}).sample_key
    seeded = parse(CHAT, {"messages": msgs, "seed": 7, "temperature": 1.0}).sample_key
    assert greedy is not None and seeded is not None and greedy != seeded
    assert parse(CHAT, {"messages": msgs, "seed": 7}).sample_key == seeded
    other = [{"role": "user", "content": "abce"}]
    assert parse(CHAT, {"messages": other, "seed": 7}).sample_key != seeded
    a = ResponseFormatter(CHAT, "chatcmpl-1", "m", 3, sample_key=seeded)
    b = ResponseFormatter(CHAT, "chatcmpl-2", "m", 3, sample_key=seeded)
    assert a.text(10) == b.text(10)
