"""The 429 (or 503 no_backend) a refused request gets, with its Retry-After, counted in
the metrics and, for a non-core feature, in its breaker (shed for overload)."""

from __future__ import annotations

from aiohttp import web

from sluice.config import Policy
from sluice.core.types import RejectCode
from sluice.gateway.request_context import RequestContext
from sluice.gateway.telemetry import Telemetry


class Refusal:
    def __init__(self, telemetry: Telemetry, policy: Policy) -> None:
        self.telemetry = telemetry
        self.policy = policy

    def run(self, ctx: RequestContext, code: RejectCode, retry_after_s: float) -> web.Response:
        breaker = ctx.breaker
        if breaker is not None and code is not RejectCode.TENANT_QUOTA:
            breaker.record_shed()
        self.telemetry.rejected(ctx.metric_key, code.value)
        self.telemetry.count[ctx.metric_key, "rejected"](1)
        queue = self.policy.queue(ctx.priority).name
        return ctx.route.errors.reject(code, retry_after_s, queue, ctx.headers)
