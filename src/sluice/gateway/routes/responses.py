"""OpenAI's Responses API as vLLM 0.32 serves it (vllm/entrypoints/openai/responses/:
api_router.py, protocol.py, serving.py): `POST /v1/responses` (stream and not),
`GET /v1/responses/{id}` and `POST /v1/responses/{id}/cancel`.

- Cost: `input` (a string or a list of items: messages, function calls and their
  outputs, ...) and `instructions` and `tools`, plus, for `previous_response_id`, what the
  stored response it continues held (prompt and answer: vLLM puts them before the new
  input); output up to `max_output_tokens`.
- Usage: `input_tokens` / `output_tokens`; in a stream, in the `response.completed` (or
  `.incomplete`, `.failed`) event's `response`. The first token is the first `.delta`
  event (`response.created` and `.in_progress` come before any token).
- Stored responses (`store`, on by default in the API; vLLM keeps them only when started
  with VLLM_ENABLE_RESPONSES_API_STORE=1) live on the backend that made them: the gateway
  remembers which one (response_store.py), sends GET, cancel and a continuation
  (`previous_response_id`) there, and only for the tenant that made it.
- `background: true` is refused with a 400 (`background_not_supported`): a background
  response answers at once and then generates for minutes on the backend with nobody
  waiting, outside the gateway's admission, limiter and KV budget, which is exactly the
  traffic Sluice exists to keep in sight. Run it against the backend directly, or send it
  without `background` (and with `stream` if the client must not wait silently)."""

from __future__ import annotations

import itertools
import time
from typing import Any

import orjson
from aiohttp import web
from multidict import CIMultiDictProxy

from sluice.gateway.error_shapes import OPENAI_RESPONSES
from sluice.gateway.fallback import write_events
from sluice.gateway.request_body import BadRequest, ParsedRequest, _text_tokens, json_object
from sluice.gateway.routes import bodies
from sluice.gateway.routes.spec import RouteSpec, StreamShape, UsageShape

RESPONSES_USAGE = UsageShape(("input_tokens",), "output_tokens", nested="response")
RESPONSES_STREAM = StreamShape(
    usage_marker=b'"usage":{', refusal_prefix=b"event: error", first_token_marker=b".delta\n"
)


def parse_responses(raw: bytes, _headers: CIMultiDictProxy[str]) -> ParsedRequest:
    body = json_object(raw)
    if body.get("background") is True:
        raise bodies.Unsupported(
            "Sluice does not queue background responses: a background response would "
            "keep generating on the backend outside the gateway's admission and limits. "
            "Send it without `background` (with `stream: true` to see it as it comes), "
            "or to the backend directly.",
            "background_not_supported",
        )
    value = body.get("input")
    if isinstance(value, str):
        prompt = _text_tokens(value)
    elif isinstance(value, list) and value:
        prompt = sum(bodies.MESSAGE_TOKENS + bodies.input_tokens(item) for item in value)
    else:
        raise BadRequest("'input' must be a string or a non-empty list of items")
    instructions = body.get("instructions")
    if isinstance(instructions, str):
        prompt += bodies.MESSAGE_TOKENS + _text_tokens(instructions)
    prompt += bodies.input_tokens(body.get("tools"))
    previous = body.get("previous_response_id")
    if previous is not None and not isinstance(previous, str):
        raise BadRequest("'previous_response_id' must be a string")
    return bodies.parsed(
        body,
        bodies.model_of(body),
        prompt,
        stream=bodies.stream_of(body),
        max_tokens=bodies.positive_int(body, "max_output_tokens"),
    )


def parse_nothing(_raw: bytes, _headers: CIMultiDictProxy[str]) -> ParsedRequest:
    """GET and cancel of a stored response: no body, no model (its backend is known)."""
    return bodies.parsed({}, "", 0)


def response_id_of(data: bytes) -> str | None:
    """The id of the response an answer (a body, or a stream's first events) carries."""
    at = data.find(b'"id":"resp')
    if at < 0:
        return None
    end = data.find(b'"', at + 6)
    return data[at + 6 : end].decode() if end > 0 else None


_ids = itertools.count(1)


async def responses_fallback(
    request: web.Request, parsed: ParsedRequest, text: str, headers: dict[str, str]
) -> web.StreamResponse:
    """A non-core feature's static text as a completed response (or its stream)."""
    n = next(_ids)
    output_tokens = max(1, (len(text) + 3) // 4)
    message = {
        "id": f"msg_sluice_fallback_{n}",
        "type": "message",
        "status": "completed",
        "role": "assistant",
        "content": [{"type": "output_text", "text": text, "annotations": []}],
    }
    response: dict[str, Any] = {
        "id": f"resp_sluice_fallback_{n}",
        "object": "response",
        "created_at": int(time.time()),
        "status": "completed",
        "model": parsed.model,
        "output": [message],
        "usage": {
            "input_tokens": parsed.prompt_tokens_est,
            "output_tokens": output_tokens,
            "total_tokens": parsed.prompt_tokens_est + output_tokens,
        },
        "error": None,
        "incomplete_details": None,
        "parallel_tool_calls": True,
        "tool_choice": "auto",
        "tools": [],
    }
    headers = {**headers, "X-Sluice-Fallback": "static"}
    if not parsed.stream:
        return web.Response(
            body=orjson.dumps(response), content_type="application/json", headers=headers
        )
    seq = itertools.count()
    part = {"type": "output_text", "text": "", "annotations": []}
    pending = {**message, "status": "in_progress", "content": []}
    created = {**response, "status": "in_progress", "output": [], "usage": None}
    events: list[tuple[str, dict[str, Any]]] = [
        ("response.created", {"response": created}),
        ("response.output_item.added", {"output_index": 0, "item": pending}),
        ("response.content_part.added", {"item_id": message["id"], "output_index": 0,
                                         "content_index": 0, "part": part}),
        ("response.output_text.delta", {"item_id": message["id"], "output_index": 0,
                                        "content_index": 0, "delta": text}),
        ("response.output_text.done", {"item_id": message["id"], "output_index": 0,
                                       "content_index": 0, "text": text}),
        ("response.content_part.done", {"item_id": message["id"], "output_index": 0,
                                        "content_index": 0, "part": {**part, "text": text}}),
        ("response.output_item.done", {"output_index": 0, "item": message}),
        ("response.completed", {"response": response}),
    ]  # fmt: skip
    data = b"".join(
        b"event: %s\ndata: %s\n\n"
        % (kind.encode(), orjson.dumps({"type": kind, **payload, "sequence_number": next(seq)}))
        for kind, payload in events
    )
    return await write_events(request, headers, data)


RESPONSES = RouteSpec(
    "responses",
    "/v1/responses",
    parse_responses,
    usage=RESPONSES_USAGE,
    stream=RESPONSES_STREAM,
    errors=OPENAI_RESPONSES,
    fallback=responses_fallback,
    stores_responses=True,
)
# GET /v1/responses/{id} (maybe ?stream=true) and POST /v1/responses/{id}/cancel: to the
# backend that made the response, outside the queues (nothing runs on the GPU).
RESPONSE_GET = RouteSpec(
    "response_get",
    None,
    parse_nothing,
    usage=RESPONSES_USAGE,
    stream=RESPONSES_STREAM,
    errors=OPENAI_RESPONSES,
    queued=False,
    method="GET",
    stores_responses=True,
)
RESPONSE_CANCEL = RouteSpec(
    "response_cancel",
    None,
    parse_nothing,
    usage=RESPONSES_USAGE,
    errors=OPENAI_RESPONSES,
    queued=False,
    stores_responses=True,
)
