"""Stage 9: the relay to the attempt's backend, and what the core and the backend pool
learn from it: the first token (a stream's), the finish with its usage, the backend's
health evidence. The slot comes back on every way out, the client's hang-up included."""

from __future__ import annotations

from collections.abc import Callable

from sluice.core.clock import Clock
from sluice.core.controller import Controller
from sluice.core.types import Outcome
from sluice.gateway.backend_pool import BackendPool
from sluice.gateway.dispatch_bridge import DispatchBridge
from sluice.gateway.relay import Relay, RelayResult
from sluice.gateway.request_context import RequestContext
from sluice.gateway.telemetry import Telemetry


def no_first_token() -> None:
    """An answer relayed whole has no first token to report."""


class Forward:
    def __init__(
        self,
        relay: Relay,
        controller: Controller,
        bridge: DispatchBridge,
        pool: BackendPool,
        telemetry: Telemetry,
        clock: Clock,
    ) -> None:
        self.relay = relay
        self.controller = controller
        self.bridge = bridge
        self.pool = pool
        self.telemetry = telemetry
        self.clock = clock

    async def run(self, ctx: RequestContext) -> RelayResult:
        backend = ctx.backend
        request_id = ctx.request_id
        if ctx.ticket is not None:
            # it reached a backend: a hang-up from now on is charged (the ticket's rule)
            ctx.ticket.ran = True
        try:
            # only a stream's first token is seen (relayed whole, an answer has none)
            first_token = self._first_token(ctx) if ctx.stream else no_first_token
            result = await self.relay.forward(ctx, first_token)
        except BaseException:
            # The client went away (the handler is cancelled) or something unexpected:
            # the slot comes back either way.
            self.controller.cancel(request_id)
            self.telemetry.count[ctx.metric_key, Outcome.CANCELLED.value](1)
            self.bridge.pump()
            raise
        self.controller.on_finish(
            request_id, result.outcome, result.prompt_tokens, result.completion_tokens
        )
        self.pool.record(backend, result.outcome, lost=result.backend_lost)
        self.bridge.pump()
        return result

    def _first_token(self, ctx: RequestContext) -> Callable[[], None]:
        def on_first_token() -> None:
            self.controller.on_first_token(ctx.request_id)
            self.telemetry.observe_ttft[ctx.metric_key](self.clock.now() - ctx.started)
            self.bridge.pump()  # its prompt left the backend's prefill bound

        return on_first_token
