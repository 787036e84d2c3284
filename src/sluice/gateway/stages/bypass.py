"""Stage 8 for the routes that cost nothing on the GPU (RouteSpec.queued False: tokenize,
detokenize, count_tokens, a stored response's GET and cancel): a key and a class like any
request, but no queue, no slot and no limiter; a healthy backend serving the model answers
(a stored response's own backend: stages/stored_responses.py). The backend's health still
learns from the answer."""

from __future__ import annotations

from aiohttp import web

from sluice.core.types import RejectCode
from sluice.gateway.backend_pool import BackendPool
from sluice.gateway.relay import Relay, RelayResult
from sluice.gateway.request_context import RequestContext
from sluice.gateway.stages.forward import no_first_token
from sluice.gateway.stages.refusal import Refusal


class Bypass:
    def __init__(
        self, pool: BackendPool, relay: Relay, refusal: Refusal, expose_backend: bool = True
    ) -> None:
        self.pool = pool
        self.relay = relay
        self.refusal = refusal
        self.expose_backend = expose_backend  # expose.backendNames

    def place(self, ctx: RequestContext) -> web.Response | None:
        backend = self.pool.pick(ctx.parsed.model)
        if backend is None:
            ctx.fields["outcome"] = RejectCode.NO_BACKEND.value
            return self.refusal.run(ctx, RejectCode.NO_BACKEND, 2.0)
        ctx.backend = backend
        return None

    async def forward(self, ctx: RequestContext) -> RelayResult:
        backend = ctx.backend
        ctx.request_id = ctx.base_id
        if self.expose_backend:
            ctx.headers["X-Sluice-Backend"] = backend.name
        ctx.fields["backend"] = backend.name
        ctx.fields["outcome"] = "cancelled"  # until the relay says otherwise
        result = await self.relay.forward(ctx, on_first_token=no_first_token)
        self.pool.record(backend, result.outcome, lost=result.backend_lost)
        return result
