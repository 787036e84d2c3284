"""A route as data: what the one request path (request_path.py) needs to know of it.

parse        body -> model, stream and cost (prompt tokens, expected output, sequences)
usage        where the answer's token counts are (its `usage` object's keys)
stream       how its stream is read: the event that carries the usage, the event that
             is the first token, the event a refusing backend sends first
errors       the shape of its errors (OpenAI's or Anthropic's: error_shapes.py)
fallback     how a non-core feature's static fallback is written (None: no text
             fallback makes sense, e.g. an embedding; the breaker's answer is a 503)
queued       False for the routes that cost nothing on the GPU (tokenize, count_tokens,
             a stored response): they need a key but bypass the queues and the limiter
prefill_only the request holds KV for its prompt only and finishes in one step
             (embeddings, rerank, score, classify): the core costs it so
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import orjson

from sluice.gateway.error_shapes import OPENAI, ErrorShape

if TYPE_CHECKING:
    from aiohttp import web
    from multidict import CIMultiDictProxy

    from sluice.gateway.request_body import ParsedRequest

Usage = tuple[int | None, int | None]
_NO_USAGE: Usage = (None, None)
_EVENT_END = b"\n\n"


def _count(value: object) -> int | None:
    # exactly int: not a bool (orjson makes no other int subclass)
    return value if type(value) is int else None


@dataclass(frozen=True, slots=True)
class UsageShape:
    """The keys of an answer's `usage` object: the prompt's (added up: Anthropic counts
    cached input apart) and the output's (None: the route generates nothing). `nested`:
    where the `usage` object sits when it is not at the top (a Responses stream's
    `response.completed` event holds it under `response`)."""

    prompt_keys: tuple[str, ...] = ("prompt_tokens",)
    completion_key: str | None = "completion_tokens"
    nested: str | None = None

    def read(self, data: bytes) -> Usage:
        """The token counts of an answer. Fast path: parse only the last `"usage": {...}`
        (a raw `"usage"` is a key: inside a JSON string its quotes would be escaped);
        anything unexpected there falls back to parsing the whole answer."""
        at = data.rfind(b'"usage"')
        if at < 0:
            return _NO_USAGE
        start = data.find(b"{", at)
        end = data.find(b"}", start)
        if start > 0 and end > 0 and data[at + 7 : start].strip() == b":":
            try:
                usage = orjson.loads(data[start : end + 1])
            except orjson.JSONDecodeError:
                usage = None  # nested objects inside usage (token details)
            if type(usage) is dict and self.prompt_keys[0] in usage:
                return self._counts(usage)
        try:
            body = orjson.loads(data)
        except orjson.JSONDecodeError:
            return _NO_USAGE
        if self.nested is not None and isinstance(body, dict):
            body = body.get(self.nested, body)
        usage = body.get("usage") if isinstance(body, dict) else None
        return self._counts(usage) if isinstance(usage, dict) else _NO_USAGE

    def _counts(self, usage: dict[str, object]) -> Usage:
        keys = self.prompt_keys
        prompt = _count(usage.get(keys[0]))
        if prompt is not None and len(keys) > 1:
            for key in keys[1:]:
                extra = _count(usage.get(key))
                if extra is not None:
                    prompt += extra
        key = self.completion_key
        return prompt, None if key is None else _count(usage.get(key))


@dataclass(frozen=True, slots=True)
class StreamShape:
    """How a route's SSE stream is read, event by event (the relay relays whole events)."""

    usage_marker: bytes  # an event holding the usage contains these bytes
    refusal_prefix: bytes  # a stream whose first event starts so is the backend refusing
    # the first event that holds a token contains these bytes (None: the first event)
    first_token_marker: bytes | None = None
    # The gateway asks for the usage (stream_options.include_usage) and cuts the
    # usage-only event out for a client that did not ask (chat and completions).
    asks_usage: bool = False

    def take_usage(
        self, events: bytes, usage: UsageShape, strip: bool, seen: Usage
    ) -> tuple[bytes, Usage]:
        """Read the usage of the events that hold it (the last count of each kind wins;
        one missing keeps what an earlier event said), and cut the usage-only event out
        when `strip`."""
        kept = []
        prompt, completion = seen
        for event in events.split(_EVENT_END):
            if not event:
                continue
            if self.usage_marker in event and (at := event.find(b"data: {")) >= 0:
                p, c = usage.read(event[at + 6 :])
                prompt = p if p is not None else prompt
                completion = c if c is not None else completion
                if strip:
                    continue
            kept.append(event + _EVENT_END)
        return b"".join(kept), (prompt, completion)


# A static fallback: (request, parsed body, text, headers) -> the answer.
StaticFallback = Callable[
    ["web.Request", "ParsedRequest", str, dict[str, str]], Awaitable["web.StreamResponse"]
]


@dataclass(frozen=True, slots=True)
class RouteSpec:
    name: str  # its label in the access log and the metrics
    # where it goes on the backend; None: the request's own path and query
    upstream_path: str | None
    # (body, the request's headers) -> model, stream, cost; raises BadRequest
    parse: Callable[[bytes, CIMultiDictProxy[str]], ParsedRequest]
    usage: UsageShape = UsageShape()
    stream: StreamShape | None = None  # None: never streamed
    errors: ErrorShape = OPENAI
    fallback: StaticFallback | None = None
    queued: bool = True
    prefill_only: bool = False
    # where the client's key may come from besides `Authorization: Bearer`
    key_header: str | None = None
    # client headers passed upstream as they came (besides the W3C trace context)
    forwarded_headers: tuple[str, ...] = ()
    # the body goes upstream with the client's Content-Type (a multipart upload)
    client_content_type: bool = False
    method: str = "POST"
    # the Responses API's stored responses: remembered, found, continued on their backend
    stores_responses: bool = False
