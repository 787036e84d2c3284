"""The answer of a non-core feature whose breaker is open, or whose request failed:
its static text (gateway/fallback.py) or the same request on its small model's backend
(docs/degradation.md). Never queued: the fallback exists to keep capacity for core
traffic."""

from __future__ import annotations

import itertools

import orjson
from aiohttp import web

from sluice.gateway.backend_pool import BackendPool
from sluice.gateway.fallback import static_fallback
from sluice.gateway.relay import Relay
from sluice.gateway.request_body import ParsedRequest, upstream_body
from sluice.gateway.request_context import RequestContext
from sluice.gateway.telemetry import Telemetry


def _no_first_token() -> None:
    pass


class Fallback:
    def __init__(self, telemetry: Telemetry, pool: BackendPool, relay: Relay) -> None:
        self.telemetry = telemetry
        self.pool = pool
        self.relay = relay
        self._ids = itertools.count(1)

    async def run(self, ctx: RequestContext) -> web.StreamResponse:
        feature, parsed = ctx.feature, ctx.parsed
        assert feature is not None and feature.fallback is not None
        self.telemetry.fallbacks.labels(feature.name).inc()
        self.telemetry.outcome(ctx.priority, "fallback")
        if feature.fallback.static is not None:
            return await static_fallback(
                ctx.request, parsed, feature.fallback.static, ctx.route.chat, ctx.headers
            )
        assert feature.fallback.backend
        small = RequestContext(ctx.request, ctx.route, ctx.started)
        small.priority = ctx.priority
        small.backend = handle = self.pool.handle(feature.fallback.backend)
        body = dict(parsed.body)
        if handle.models:
            body["model"] = sorted(handle.models)[0]
        small.parsed = ParsedRequest(
            body=body,
            model=body["model"],
            stream=parsed.stream,
            include_usage=parsed.include_usage,
            max_tokens=parsed.max_tokens,
            prompt_tokens_est=parsed.prompt_tokens_est,
        )
        small.request_id = f"fallback-{next(self._ids)}"
        small.body = upstream_body(small.parsed, orjson.dumps(body))
        small.stream = ctx.stream
        small.strip_usage = ctx.strip_usage
        small.headers = {**ctx.headers, "X-Sluice-Fallback": "model"}
        result = await self.relay.forward(small, on_first_token=_no_first_token)
        return result.response
