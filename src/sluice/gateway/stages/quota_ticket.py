"""Stage 7: with `redis:` configured, the tenant's shared quota is charged in Redis
before the request queues (gateway/shared_quota.py); a tenant over it gets the 429
`tenant_quota` here (`cannot_serve_in_time` when its quota refills past the client's
deadline). The ticket gives back what the request did not use when the access
record is written (stages/access_record.py), on every way out."""

from __future__ import annotations

from aiohttp import web

from sluice.core.controller import Controller
from sluice.core.retry_after import deadline_code
from sluice.core.types import RejectCode
from sluice.gateway.request_context import RequestContext
from sluice.gateway.shared_quota import SharedQuotaGate
from sluice.gateway.stages.admission import request_info
from sluice.gateway.stages.refusal import Refusal


class QuotaTicketStage:
    def __init__(self, gate: SharedQuotaGate, controller: Controller, refusal: Refusal) -> None:
        self.gate = gate
        self.controller = controller
        self.refusal = refusal

    async def run(self, ctx: RequestContext) -> web.Response | None:
        tenant = ctx.tenant
        if not self.gate.limits(tenant.name):
            return None
        # charged as the core charges the local quotas (one rule: Controller.cost_of)
        cost = self.controller.cost_of(request_info(ctx, ctx.base_id, None))
        ticket = await self.gate.acquire(tenant.name, cost)
        if not ticket.ok:
            # past the client's deadline: it cannot be served in time (retry_after.py)
            code = deadline_code(
                RejectCode.TENANT_QUOTA,
                ticket.retry_after_s,
                self.refusal.clock.now(),
                ctx.deadline,
            )
            ctx.fields["outcome"] = code.value
            return self.refusal.run(ctx, code, ticket.retry_after_s)
        ctx.ticket = ticket
        return None
