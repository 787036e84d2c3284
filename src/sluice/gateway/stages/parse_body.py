"""Stage 5: the body read by the route's rules (model, stream, cost), the client's
deadlines from its headers (400 if they are not numbers), and the model: one no backend
serves is a 404 (one whose backends are all down is the core's 503 later)."""

from __future__ import annotations

from aiohttp import web
from multidict import CIMultiDictProxy

from sluice.core.types import RejectCode
from sluice.gateway.backend_pool import BackendPool, ModelLookup
from sluice.gateway.request_body import BadRequest, upstream_body
from sluice.gateway.request_context import RequestContext
from sluice.gateway.stages.refusal import Refusal

_NEITHER = (None, None)
_NO_DEADLINE: tuple[float | None, float | None] = (None, None)
SERVED = ModelLookup.SERVED


def client_timeouts(headers: CIMultiDictProxy[str]) -> tuple[float | None, float | None]:
    """The client's own deadlines in seconds: (for the first byte, for the whole call).
    X-Request-Timeout and the openai SDK's X-Stainless-Timeout bound the whole call;
    X-Stainless-Read-Timeout bounds each read, so only the wait for the first byte (the
    queue wait). The smallest applicable one wins. X-Request-Timeout is the caller's own
    word: not a positive number of seconds, it is a 400. The X-Stainless ones are what an
    SDK writes by itself, and the anthropic SDK writes `NOT_GIVEN` when no timeout was
    set: such a value says nothing and is ignored."""
    whole = headers.get("X-Request-Timeout"), headers.get("X-Stainless-Timeout")
    read = headers.get("X-Stainless-Read-Timeout")
    if whole == _NEITHER and read is None:
        return _NO_DEADLINE
    total = None if whole[0] is None else _seconds("X-Request-Timeout", whole[0])
    if whole[1] is not None and (seconds := _hint(whole[1])) is not None:
        total = seconds if total is None else min(total, seconds)
    first = total
    if read is not None and (seconds := _hint(read)) is not None:
        first = seconds if first is None else min(first, seconds)
    return first, total


def _seconds(name: str, value: str) -> float:
    try:
        seconds = float(value)
    except ValueError:
        raise BadRequest(f"{name} must be a number of seconds") from None
    if not 0 < seconds < float("inf"):
        raise BadRequest(f"{name} must be a positive number of seconds")
    return seconds


def _hint(value: str) -> float | None:
    """An SDK's timeout header: its seconds, or None if it says none."""
    try:
        seconds = float(value)
    except ValueError:
        return None
    return seconds if 0 < seconds < float("inf") else None


class ParseBody:
    def __init__(self, pool: BackendPool, refusal: Refusal) -> None:
        self.pool = pool
        self.refusal = refusal

    def run(self, ctx: RequestContext) -> web.Response | None:
        route = ctx.route
        headers = ctx.request.headers
        try:
            parsed = route.parse(ctx.raw, headers)
            first_byte_s, total_s = client_timeouts(headers)
        except BadRequest as exc:
            code = getattr(exc, "code", "invalid_request")
            return route.errors.response(400, str(exc), code, ctx.headers)
        if parsed.model and (lookup := self.pool.lookup(parsed.model)) is not SERVED:
            if lookup is ModelLookup.NOT_YET_KNOWN:  # a backend that is down may serve it
                ctx.fields["outcome"] = RejectCode.NO_BACKEND.value
                return self.refusal.run(ctx, RejectCode.NO_BACKEND, 2.0)
            return route.errors.response(
                404, f"The model `{parsed.model}` does not exist.", "model_not_found", ctx.headers
            )
        ctx.parsed = parsed
        ctx.body = ctx.raw
        shape = route.stream
        # a route that is never streamed is relayed whole, whatever the body says
        if parsed.stream and shape is not None:
            ctx.stream = True
            if shape.asks_usage and not parsed.include_usage:
                # the gateway needs the counts: it asks, and cuts them out for the client
                ctx.strip_usage = True
                ctx.body = upstream_body(parsed, ctx.raw)
        # The core drops a queued request its client will no longer wait for; the relay
        # stops an upstream call at the client's overall deadline.
        if first_byte_s is not None:
            ctx.wait_deadline = ctx.started + first_byte_s
        if total_s is not None:
            ctx.deadline = ctx.started + total_s
        return None
