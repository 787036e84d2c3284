"""Stage 11, on every way out: the access record (one per request, whatever happened to
it) and the shared-quota ticket's settlement."""

from __future__ import annotations

from aiohttp import web

from sluice.core.stall_log import StallSource
from sluice.gateway.logs import access
from sluice.gateway.request_context import RequestContext


def write_access_record(
    ctx: RequestContext,
    response: web.StreamResponse | None,
    now: float,
    stalls: StallSource | None = None,
) -> None:
    fields = ctx.fields
    # 499: the client went away before the answer was complete (nginx's usage).
    fields["status"] = response.status if response is not None else 499
    fields["duration_ms"] = round((now - ctx.started) * 1000, 1)
    if stalls is not None and (stalled := stalls.stalled(ctx.started, now)) > 0:
        # the part of duration_ms the host did not run the gateway (a busy or paused
        # host): a slow answer the gateway could not have helped
        fields["host_stall_ms"] = round(stalled * 1000, 1)
    access(fields)
    ticket = ctx.ticket
    if ticket is not None:
        ticket.close()  # gives back to the shared quota what was not used
