"""Token counts read from a backend's answer: they settle tenant quotas and teach the token
cost model, so they must be right whatever the backend's JSON looks like."""

from __future__ import annotations

import orjson
import pytest
from hypothesis import given
from hypothesis import strategies as st

from sluice.gateway.routes import CHAT

# chat's rules (routes/openai_api.py): the usage object's keys, and its stream's usage event
_usage_of = CHAT.usage.read


def _take_usage(events: bytes, strip: bool) -> tuple[bytes, tuple[int | None, int | None]]:
    assert CHAT.stream is not None
    return CHAT.stream.take_usage(events, CHAT.usage, strip, (None, None))


def answer(usage: object, content: str = "hello") -> bytes:
    return orjson.dumps(
        {
            "id": "x",
            "object": "chat.completion",
            "choices": [{"index": 0, "message": {"role": "assistant", "content": content}}],
            "usage": usage,
        }
    )


def test_vllm_usage_is_read() -> None:
    body = answer(
        {
            "prompt_tokens": 12,
            "total_tokens": 42,
            "completion_tokens": 30,
            "prompt_tokens_details": None,
        }
    )
    assert _usage_of(body) == (12, 30)


def test_nested_details_and_spaces_are_read() -> None:
    nested = {
        "prompt_tokens_details": {"cached_tokens": 4},
        "prompt_tokens": 7,
        "completion_tokens": 3,
    }
    assert _usage_of(answer(nested)) == (7, 3)
    spaced = b'{"choices": [], "usage" : {"prompt_tokens": 5, "completion_tokens": 2}}'
    assert _usage_of(spaced) == (5, 2)


def test_content_that_mentions_usage_does_not_fool_it() -> None:
    body = answer(
        {"prompt_tokens": 1, "completion_tokens": 2},
        content='"usage": {"prompt_tokens": 999, "completion_tokens": 999}',
    )
    assert _usage_of(body) == (1, 2)
    # usage first, a quoted look-alike after it in the text
    tricky = (
        b'{"usage": {"prompt_tokens": 3, "completion_tokens": 4}, "choices": [{"text": '
        b'"\\"usage\\": {\\"prompt_tokens\\": 9}"}]}'
    )
    assert _usage_of(tricky) == (3, 4)


@pytest.mark.parametrize(
    "body",
    [
        b"",
        b"not json",
        b'{"usage": null}',
        b'{"usage": 5}',
        b'{"usage": {"prompt_tokens": "7", "completion_tokens": true}}',
        answer({}),
        b'{"choices": []}',
    ],
)
def test_missing_or_odd_usage_gives_none(body: bytes) -> None:
    assert _usage_of(body) == (None, None)


@given(
    prompt=st.integers(0, 10**7),
    completion=st.integers(0, 10**7),
    content=st.text(max_size=200),
    details=st.one_of(
        st.none(), st.dictionaries(st.text(max_size=8), st.integers(0, 10**9), max_size=3)
    ),
)
def test_any_answer_is_read_as_a_full_parse_would(
    prompt: int, completion: int, content: str, details: object
) -> None:
    usage = {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "prompt_tokens_details": details,
    }
    assert _usage_of(answer(usage, content)) == (prompt, completion)


def test_the_usage_chunk_is_cut_from_a_stream_the_client_did_not_ask_it_for() -> None:
    events = (
        b'data: {"choices":[{"delta":{"content":"x"}}]}\n\n'
        b'data: {"choices":[],"usage":{"prompt_tokens":3,"completion_tokens":1}}\n\n'
    )
    kept, usage = _take_usage(events, strip=True)
    assert usage == (3, 1)
    assert kept == b'data: {"choices":[{"delta":{"content":"x"}}]}\n\n'
    kept, usage = _take_usage(events, strip=False)
    assert usage == (3, 1) and kept == events
