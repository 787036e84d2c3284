"""Stage 7: with `redis:` configured, the tenant's shared quota is charged in Redis
before the request queues (gateway/shared_quota.py); a tenant over it gets the 429
`tenant_quota` here. The ticket gives back what the request did not use when the access
record is written (stages/access_record.py), on every way out."""

from __future__ import annotations

from aiohttp import web

from sluice.core.types import RejectCode
from sluice.gateway.request_context import RequestContext
from sluice.gateway.shared_quota import SharedQuotaGate
from sluice.gateway.stages.refusal import Refusal

# When a request sets no max_tokens, assume this much output for its cost estimate.
DEFAULT_MAX_TOKENS = 1024


class QuotaTicketStage:
    def __init__(self, gate: SharedQuotaGate, refusal: Refusal) -> None:
        self.gate = gate
        self.refusal = refusal

    async def run(self, ctx: RequestContext) -> web.Response | None:
        tenant, parsed = ctx.tenant, ctx.parsed
        if not self.gate.limits(tenant.name):
            return None
        ticket = await self.gate.acquire(
            tenant.name, parsed.prompt_tokens_est + (parsed.max_tokens or DEFAULT_MAX_TOKENS)
        )
        if not ticket.ok:
            ctx.fields["outcome"] = RejectCode.TENANT_QUOTA.value
            return self.refusal.run(ctx, RejectCode.TENANT_QUOTA, ticket.retry_after_s)
        ctx.ticket = ticket
        return None
