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
from dataclasses import dataclass, field
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


class UsageShape:
    """The keys of an answer's `usage` object: the prompt's (added up: Anthropic counts
    cached input apart) and the output's (None: the route generates nothing). `nested`:
    where the `usage` object sits when it is not at the top (a Responses stream's
    `response.completed` event holds it under `response`). Made once per route; read on
    every answer, so its fast path is written out."""

    __slots__ = ("completion_key", "extra_prompt_keys", "nested", "prompt_key")

    def __init__(
        self,
        prompt_keys: tuple[str, ...] = ("prompt_tokens",),
        completion_key: str | None = "completion_tokens",
        nested: str | None = None,
    ) -> None:
        self.prompt_key = prompt_keys[0]
        self.extra_prompt_keys = prompt_keys[1:]
        self.completion_key = completion_key
        self.nested = nested

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
            if type(usage) is dict and self.prompt_key in usage:
                if self.extra_prompt_keys:
                    return self._counts(usage)
                # exactly int: not a bool (orjson makes no other int subclass)
                prompt = usage[self.prompt_key]
                key = self.completion_key
                completion = None if key is None else usage.get(key)
                return (
                    prompt if type(prompt) is int else None,
                    completion if type(completion) is int else None,
                )
        try:
            body = orjson.loads(data)
        except orjson.JSONDecodeError:
            return _NO_USAGE
        if self.nested is not None and isinstance(body, dict):
            body = body.get(self.nested, body)
        usage = body.get("usage") if isinstance(body, dict) else None
        return self._counts(usage) if isinstance(usage, dict) else _NO_USAGE

    def _counts(self, usage: dict[str, object]) -> Usage:
        prompt = _count(usage.get(self.prompt_key))
        if prompt is not None:
            for key in self.extra_prompt_keys:
                extra = _count(usage.get(key))
                if extra is not None:
                    prompt += extra
        done = self.completion_key
        return prompt, None if done is None else _count(usage.get(done))


OPENAI_USAGE = UsageShape()  # `prompt_tokens`, `completion_tokens`


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
    usage: UsageShape = OPENAI_USAGE
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
    # POST of a JSON body to a fixed path, no client header passed on: the relay's fast path
    plain_post: bool = field(init=False)

    def __post_init__(self) -> None:
        plain = (
            self.method == "POST"
            and self.upstream_path is not None
            and not self.forwarded_headers
            and not self.client_content_type
        )
        object.__setattr__(self, "plain_post", plain)
