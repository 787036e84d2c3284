"""Stage 11, on every way out: the access record (one per request, whatever happened to
it) and the shared-quota ticket's settlement."""

from __future__ import annotations

from aiohttp import web

from sluice.core.stall_log import StallSource
from sluice.gateway.logs import access
from sluice.gateway.request_context import RequestContext
from sluice.gateway.stall_watch import MIN_S as STALL_MIN_S


def write_access_record(
    ctx: RequestContext,
    response: web.StreamResponse | None,
    now: float,
    stalls: StallSource | None = None,
) -> None:
    fields = ctx.fields
    # 499: the client went away before the answer was complete (nginx's usage).
    fields["status"] = response.status if response is not None else 499
    took = now - ctx.started
    fields["duration_ms"] = round(took * 1000, 1)
    # The part of duration_ms the host did not run the gateway (a busy or paused host): a
    # slow answer the gateway could not have helped. Only for requests longer than the
    # shortest stall the watch records (a shorter one holds no whole stall; it costs the
    # fastest answers nothing).
    if (
        stalls is not None
        and took > STALL_MIN_S
        and (stalled := stalls.stalled(ctx.started, now)) > 0
    ):
        fields["host_stall_ms"] = round(stalled * 1000, 1)
    access(fields)
    ticket = ctx.ticket
    if ticket is not None:
        ticket.close()  # gives back to the shared quota what was not used
