"""Fallback answers for non-core features (docs/degradation.md): a pre-arranged static text, in
OpenAI's shape so that callers need no special case, streamed or not."""

from __future__ import annotations

import itertools
import time

import orjson
from aiohttp import web

from sluice.gateway.request_body import ParsedRequest

_ids = itertools.count(1)


def _usage(parsed: ParsedRequest, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": parsed.prompt_tokens_est,
        "completion_tokens": completion_tokens,
        "total_tokens": parsed.prompt_tokens_est + completion_tokens,
    }


def _completion_tokens(text: str) -> int:
    return max(1, (len(text) + 3) // 4)


async def static_fallback(
    request: web.Request, parsed: ParsedRequest, text: str, chat: bool, headers: dict[str, str]
) -> web.StreamResponse:
    created = int(time.time())
    ident = f"{'chatcmpl' if chat else 'cmpl'}-sluice-fallback-{next(_ids)}"
    usage = _usage(parsed, _completion_tokens(text))
    headers = {**headers, "X-Sluice-Fallback": "static"}
    if not parsed.stream:
        if chat:
            choice = {
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "logprobs": None,
                "finish_reason": "stop",
            }
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": "stop"}
        body = {
            "id": ident,
            "object": "chat.completion" if chat else "text_completion",
            "created": created,
            "model": parsed.model,
            "choices": [choice],
            "usage": usage,
        }
        return web.Response(
            body=orjson.dumps(body), content_type="application/json", headers=headers
        )

    obj = "chat.completion.chunk" if chat else "text_completion"

    def chunk(choices: list[dict[str, object]], **extra: object) -> bytes:
        payload = {
            "id": ident,
            "object": obj,
            "created": created,
            "model": parsed.model,
            "choices": choices,
            **extra,
        }
        return b"data: " + orjson.dumps(payload) + b"\n\n"

    if chat:
        events = [
            chunk(
                [
                    {
                        "index": 0,
                        "delta": {"role": "assistant", "content": ""},
                        "logprobs": None,
                        "finish_reason": None,
                    }
                ]
            ),
            chunk(
                [{"index": 0, "delta": {"content": text}, "logprobs": None, "finish_reason": None}]
            ),
            chunk([{"index": 0, "delta": {}, "logprobs": None, "finish_reason": "stop"}]),
        ]
    else:
        events = [
            chunk([{"index": 0, "text": text, "logprobs": None, "finish_reason": None}]),
            chunk([{"index": 0, "text": "", "logprobs": None, "finish_reason": "stop"}]),
        ]
    if parsed.include_usage:
        events.append(chunk([], usage=usage))
    events.append(b"data: [DONE]\n\n")
    return await write_events(request, headers, b"".join(events))


async def write_events(
    request: web.Request, headers: dict[str, str], events: bytes
) -> web.StreamResponse:
    """A fallback's whole event stream, written at once (every route's static fallback)."""
    response = web.StreamResponse(
        headers={**headers, "Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
    )
    await response.prepare(request)
    await response.write(events)
    await response.write_eof()
    return response
