"""Stage 8: the core's admission and the wait for a slot, attempt by attempt.

The request is given to the Controller (through the dispatch bridge); refused at once or
dropped from its queue, it gets its 429 with Retry-After (stages/refusal.py); placed, the
context names its backend and the relay runs. A request that failed before anything
reached its client is tried once more on another backend (`retry_after_failure`, the
one-retry rule); after the first byte it is never replayed. The retry is the gateway's own
idea: it waits for a slot no longer than RETRY_WAIT_S nor past the client's deadline, and
if it finds none, the client gets the first attempt's answer.

A request that brings back a booking token (gateway/returns.py) claims its return slot on
its first attempt only: the gateway's own retry is a fresh arrival."""

from __future__ import annotations

import itertools
import os
import time

from aiohttp import web
from multidict import CIMultiDictProxy

from sluice.core.clock import Clock
from sluice.core.types import Rejection, RequestInfo
from sluice.gateway.backend_pool import BackendPool
from sluice.gateway.dispatch_bridge import DispatchBridge
from sluice.gateway.relay import RelayResult
from sluice.gateway.request_context import RequestContext
from sluice.gateway.returns import BookingTokens
from sluice.gateway.stages.refusal import Refusal
from sluice.gateway.telemetry import Telemetry

# When a request sets no max_tokens, assume this much output for its cost estimate.
DEFAULT_MAX_TOKENS = 1024
# Attempts per request when a backend fails before anything reached the client.
MAX_ATTEMPTS = 2
# A retry waits for a slot at most this long (the Retry-After of the answer it replaces).
RETRY_WAIT_S = 1.0


def retry_attempt(headers: CIMultiDictProxy[str]) -> tuple[int, str] | None:
    """Which retry this is, and which client made it: Sluice's SDK sends X-Sluice-Retry,
    the openai SDK x-stainless-retry-count (0 on a first attempt)."""
    value = headers.get("X-Sluice-Retry")
    if value is not None and value.isdigit() and int(value) > 0:
        return min(int(value), 1000), "sluice-sdk"
    value = headers.get("X-Stainless-Retry-Count")
    if value is not None and value.isdigit() and int(value) > 0:
        return min(int(value), 1000), "openai-sdk"
    return None


def request_info(ctx: RequestContext, request_id: str, deadline: float | None) -> RequestInfo:
    """What the core is told of the request (an attempt of it, with its own id and the
    time after which it will not wait)."""
    tenant, parsed = ctx.tenant, ctx.parsed
    return RequestInfo(
        request_id=request_id,
        tenant=tenant.name,
        priority=ctx.priority,
        model=parsed.model,
        prompt_tokens=parsed.prompt_tokens_est,
        max_tokens=parsed.max_tokens or DEFAULT_MAX_TOKENS,
        sequences=parsed.sequences,
        weight=tenant.weight,
        client_deadline=deadline,
        feature=ctx.feature_name,
        retry_attempt=ctx.retry_attempt,
        first_token_visible=ctx.stream,
        prefill_only=ctx.route.prefill_only,
        backend=ctx.pinned_backend,
        booking=ctx.booking if ctx.failed is None else None,
        booked_slot=ctx.booked_slot,
        give_up_at=ctx.deadline,
    )


class Admission:
    def __init__(
        self,
        bridge: DispatchBridge,
        pool: BackendPool,
        telemetry: Telemetry,
        clock: Clock,
        refusal: Refusal,
        tokens: BookingTokens,
        expose_backend: bool = True,
    ) -> None:
        self.bridge = bridge
        # expose.backendNames: the answer names its backend (X-Sluice-Backend)
        self.expose_backend = expose_backend
        self.pool = pool
        self.telemetry = telemetry
        self.clock = clock
        self.refusal = refusal
        self.tokens = tokens
        self._ids = itertools.count(1)
        self._id_prefix = f"{os.getpid():x}-{int(time.time()) & 0xFFFFFF:x}"

    def begin(self, ctx: RequestContext) -> None:
        """Before the first attempt: the request's id, whether a client retries it, and
        the return slot it claims (a booking token this gateway can verify)."""
        headers = ctx.request.headers
        retry = retry_attempt(headers)
        if retry:
            ctx.retry_attempt = retry[0]
            self.telemetry.retries.labels(str(ctx.priority), retry[1]).inc()
        ctx.booking, ctx.booked_slot = self.tokens.return_claim(
            headers, ctx.tenant.name, ctx.priority
        )
        base_id = ctx.base_id = f"{self._id_prefix}-{next(self._ids)}"
        ctx.headers["X-Request-Id"] = base_id
        ctx.fields.update(
            request_id=base_id, model=ctx.parsed.model, stream=ctx.stream, feature=ctx.feature_name
        )

    async def run(self, ctx: RequestContext) -> web.StreamResponse | None:
        """Wait for this attempt's slot: None once ctx.backend holds it, else the answer
        (a refusal, or for a retry that found no slot, the first attempt's answer)."""
        attempt = ctx.attempt
        request_id = ctx.request_id = ctx.base_id if attempt == 0 else f"{ctx.base_id}-r{attempt}"
        patience = ctx.wait_deadline
        if ctx.failed is not None:
            patience = self.clock.now() + RETRY_WAIT_S
            if ctx.wait_deadline is not None:
                patience = min(patience, ctx.wait_deadline)
        admission = self.bridge.arrive(request_info(ctx, request_id, patience))
        if not admission.admitted:
            assert admission.code is not None
            if ctx.failed is not None:
                return self._retry_gave_up(ctx)
            ctx.fields["outcome"] = admission.code.value
            return self.refusal.run(ctx, admission.code, admission.retry_after_s, admission)
        decision = admission.assignment or await self.bridge.wait(request_id)
        waited = decision.queued_s
        queued_s = ctx.queued_s = ctx.queued_s + waited
        headers, fields = ctx.headers, ctx.fields
        headers["X-Sluice-Queue-Ms"] = str(round(queued_s * 1000))
        fields["queue_ms"] = round(queued_s * 1000, 1)
        self.telemetry.observe_queue_wait[ctx.metric_key](waited)
        if isinstance(decision, Rejection):
            if ctx.failed is not None:
                return self._retry_gave_up(ctx)
            fields["outcome"] = decision.code.value
            return self.refusal.run(ctx, decision.code, decision.retry_after_s, decision)
        backend = decision.backend
        if self.expose_backend:
            headers["X-Sluice-Backend"] = backend
        # the outcome stays "cancelled" until the relay says otherwise
        fields.update(backend=backend, attempt=attempt + 1, outcome="cancelled")
        ctx.backend = self.pool.backends[backend]
        ctx.early_head = decision.early_head
        return None

    def retry_after_failure(self, ctx: RequestContext, result: RelayResult) -> bool:
        """The one-retry rule: a failure before anything reached the client is tried
        once more on another backend, while the client's deadline allows."""
        if ctx.attempt + 1 < MAX_ATTEMPTS and (
            ctx.deadline is None or self.clock.now() < ctx.deadline
        ):
            self.telemetry.count[ctx.metric_key, "retried_on_other_backend"](1)
            ctx.failed = result
            ctx.attempt += 1
            return True
        return False

    def _retry_gave_up(self, ctx: RequestContext) -> web.StreamResponse:
        """A retry found no slot in time: the client gets the first attempt's answer."""
        failed = ctx.failed
        assert failed is not None
        ctx.fields["outcome"] = failed.outcome.value
        if "X-Sluice-Queue-Ms" in ctx.headers:
            failed.response.headers["X-Sluice-Queue-Ms"] = ctx.headers["X-Sluice-Queue-Ms"]
        self.telemetry.count[ctx.metric_key, failed.outcome.value](1)
        self.telemetry.observe_latency[ctx.metric_key](self.clock.now() - ctx.started)
        return failed.response
