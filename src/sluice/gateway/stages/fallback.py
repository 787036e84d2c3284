"""The answer of a non-core feature whose breaker is open, or whose request failed:
its static text (gateway/fallback.py) or the same request on its small model's backend
(docs/degradation.md). Never queued: the fallback exists to keep capacity for core
traffic."""

from __future__ import annotations

import itertools

import orjson
from aiohttp import web

from sluice.gateway.backend_pool import BackendPool
from sluice.gateway.errors import retry_after_headers
from sluice.gateway.relay import Relay
from sluice.gateway.request_body import ParsedRequest, upstream_body
from sluice.gateway.request_context import RequestContext
from sluice.gateway.stages.forward import no_first_token
from sluice.gateway.telemetry import Telemetry


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
        self.telemetry.count[ctx.metric_key, "fallback"](1)
        if feature.fallback.static is not None:
            write = ctx.route.fallback
            if write is None:  # an embedding, a score: no text can stand in for one
                return ctx.route.errors.response(
                    503,
                    f"The feature {feature.name} is degraded and this route has no text "
                    "fallback; retry after the indicated delay.",
                    "feature_degraded",
                    {**ctx.headers, **retry_after_headers(5.0)},
                )
            return await write(ctx.request, parsed, feature.fallback.static, ctx.headers)
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
            sequences=parsed.sequences,
        )
        small.request_id = f"fallback-{next(self._ids)}"
        small.body = upstream_body(small.parsed, orjson.dumps(body))
        small.stream = ctx.stream
        small.strip_usage = ctx.strip_usage
        small.headers = {**ctx.headers, "X-Sluice-Fallback": "model"}
        result = await self.relay.forward(small, on_first_token=no_first_token)
        return result.response
