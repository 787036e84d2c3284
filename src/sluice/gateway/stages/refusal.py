"""The 429 (or 503 no_backend) a refused request gets, with its Retry-After, counted in
the metrics and, for a non-core feature, in its breaker (shed for overload). A refusal by
the core that booked a return slot adds its booking token and return window
(gateway/returns.py); a Retry-After within the client's deadline stays within it in whole
seconds (errors.retry_after_headers); `cannot_serve_in_time` carries none."""

from __future__ import annotations

from aiohttp import web

from sluice.config import Policy
from sluice.core.clock import Clock
from sluice.core.types import Admission, RejectCode, Rejection
from sluice.gateway.request_context import RequestContext
from sluice.gateway.returns import BookingTokens
from sluice.gateway.telemetry import Telemetry


class Refusal:
    def __init__(
        self, telemetry: Telemetry, policy: Policy, tokens: BookingTokens, clock: Clock
    ) -> None:
        self.telemetry = telemetry
        self.policy = policy
        self.tokens = tokens
        self.clock = clock

    def run(
        self,
        ctx: RequestContext,
        code: RejectCode,
        retry_after_s: float,
        refusal: Admission | Rejection | None = None,
    ) -> web.Response:
        """`refusal`: the core's answer, when the core refused (it may carry a booking)."""
        breaker = ctx.breaker
        if breaker is not None and code is not RejectCode.TENANT_QUOTA:
            breaker.record_shed()
        priority = ctx.priority
        self.telemetry.rejected(ctx.metric_key, code.value)
        self.telemetry.count[ctx.metric_key, "rejected"](1)
        if code is not RejectCode.CANNOT_SERVE_IN_TIME:
            self.telemetry.retry_after.labels(str(priority)).observe(retry_after_s)
        headers = ctx.headers
        if refusal is not None:
            headers.update(self.tokens.refusal_headers(refusal, priority, ctx.tenant.name))
        queue = self.policy.queue(priority).name
        within_s = None if ctx.deadline is None else ctx.deadline - self.clock.now()
        return ctx.route.errors.reject(code, retry_after_s, queue, headers, within_s)
