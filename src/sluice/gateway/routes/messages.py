"""Anthropic's Messages API as vLLM 0.32 serves it (vllm/entrypoints/anthropic/:
api_router.py, protocol.py, serving.py): `POST /v1/messages` (stream and not) and
`POST /v1/messages/count_tokens`, used by the anthropic SDK and Claude Code.

- The key may come as `x-api-key` (the anthropic SDK's header) as well as
  `Authorization: Bearer`; `anthropic-version` and `anthropic-beta` go upstream as sent.
- Cost: `system`, every message's content blocks (text, tool use and results, an image
  at a floor) and `tools`; output up to `max_tokens`.
- Usage: `input_tokens` (plus the cached input Anthropic counts apart) and
  `output_tokens`; in a stream, `message_start` holds the input and `message_delta` the
  final counts. vLLM sends `message_start` with the first token; the gateway takes the
  first `content_block_delta` as the first token, which holds for any engine.
- Errors in Anthropic's shape, overload as 529 `overloaded_error` (error_shapes.py).
- count_tokens runs nothing on the GPU: it needs a key and bypasses the queues."""

from __future__ import annotations

import itertools
from typing import Any

import orjson
from aiohttp import web
from multidict import CIMultiDictProxy

from sluice.gateway.error_shapes import ANTHROPIC
from sluice.gateway.fallback import write_events
from sluice.gateway.request_body import BadRequest, ParsedRequest, json_object
from sluice.gateway.routes import bodies
from sluice.gateway.routes.spec import RouteSpec, StreamShape, UsageShape

ANTHROPIC_USAGE = UsageShape(
    ("input_tokens", "cache_read_input_tokens", "cache_creation_input_tokens"), "output_tokens"
)
ANTHROPIC_STREAM = StreamShape(
    usage_marker=b'"usage":{',
    refusal_prefix=b"event: error",
    first_token_marker=b"event: content_block_delta",
)
ANTHROPIC_HEADERS = ("anthropic-version", "anthropic-beta")


def _prompt_tokens(body: dict[str, Any]) -> int:
    prompt = bodies.messages_tokens(body.get("messages"))
    system = body.get("system")
    if system is not None:
        prompt += bodies.MESSAGE_TOKENS + bodies.input_tokens(system)
    return prompt + bodies.input_tokens(body.get("tools"))


def parse_messages(raw: bytes, _headers: CIMultiDictProxy[str]) -> ParsedRequest:
    body = json_object(raw)
    return bodies.parsed(
        body,
        bodies.model_of(body),
        _prompt_tokens(body),
        stream=bodies.stream_of(body),
        max_tokens=bodies.positive_int(body, "max_tokens"),
    )


def parse_count_tokens(raw: bytes, _headers: CIMultiDictProxy[str]) -> ParsedRequest:
    body = json_object(raw)
    if not isinstance(body.get("messages"), list):
        raise BadRequest("'messages' must be a list")
    return bodies.parsed(body, bodies.model_of(body), 0)


_ids = itertools.count(1)


async def messages_fallback(
    request: web.Request, parsed: ParsedRequest, text: str, headers: dict[str, str]
) -> web.StreamResponse:
    """A non-core feature's static text as a finished message (or its event stream)."""
    output_tokens = max(1, (len(text) + 3) // 4)
    message: dict[str, Any] = {
        "id": f"msg_sluice_fallback_{next(_ids)}",
        "type": "message",
        "role": "assistant",
        "content": [{"type": "text", "text": text}],
        "model": parsed.model,
        "stop_reason": "end_turn",
        "stop_sequence": None,
        "usage": {"input_tokens": parsed.prompt_tokens_est, "output_tokens": output_tokens},
    }
    headers = {**headers, "X-Sluice-Fallback": "static"}
    if not parsed.stream:
        return web.Response(
            body=orjson.dumps(message), content_type="application/json", headers=headers
        )
    start = {
        **message,
        "content": [],
        "stop_reason": None,
        "usage": {"input_tokens": parsed.prompt_tokens_est, "output_tokens": 0},
    }
    events: list[tuple[str, dict[str, Any]]] = [
        ("message_start", {"message": start}),
        ("content_block_start", {"index": 0, "content_block": {"type": "text", "text": ""}}),
        ("content_block_delta", {"index": 0, "delta": {"type": "text_delta", "text": text}}),
        ("content_block_stop", {"index": 0}),
        (
            "message_delta",
            {"delta": {"stop_reason": "end_turn", "stop_sequence": None},
             "usage": message["usage"]},
        ),
        ("message_stop", {}),
    ]  # fmt: skip
    data = b"".join(
        b"event: %s\ndata: %s\n\n" % (kind.encode(), orjson.dumps({"type": kind, **payload}))
        for kind, payload in events
    )
    return await write_events(request, headers, data)


MESSAGES = RouteSpec(
    "messages",
    "/v1/messages",
    parse_messages,
    usage=ANTHROPIC_USAGE,
    stream=ANTHROPIC_STREAM,
    errors=ANTHROPIC,
    fallback=messages_fallback,
    key_header="x-api-key",
    forwarded_headers=ANTHROPIC_HEADERS,
)
COUNT_TOKENS = RouteSpec(
    "count_tokens",
    "/v1/messages/count_tokens",
    parse_count_tokens,
    errors=ANTHROPIC,
    queued=False,
    key_header="x-api-key",
    forwarded_headers=ANTHROPIC_HEADERS,
)
