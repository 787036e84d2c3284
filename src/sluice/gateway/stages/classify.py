"""Stage 2: the request's class. The tenant's own, or a lower one it asks for with
`X-Priority: 0|1|2` (a higher number; asking above the tenant's class is a 403)."""

from __future__ import annotations

from aiohttp import web

from sluice.gateway.request_context import RequestContext

_VALID = ("0", "1", "2")


def classify(ctx: RequestContext) -> web.Response | None:
    priority = ctx.tenant.priority
    asked = ctx.request.headers.get("X-Priority")
    if asked is not None:
        asked = asked.strip()
        if asked not in _VALID:
            return ctx.route.errors.response(
                400,
                "X-Priority must be 0, 1 or 2",
                "invalid_priority",
                {"X-Sluice-Priority": str(priority)},
            )
        if int(asked) < priority:
            return ctx.route.errors.response(
                403,
                f"this key may ask for priority {priority} or lower (a higher number), not {asked}",
                "priority_not_allowed",
                {"X-Sluice-Priority": str(priority)},
            )
        priority = int(asked)
    ctx.priority = priority
    ctx.metric_key = (priority, ctx.route.name)
    ctx.headers["X-Sluice-Priority"] = str(priority)
    ctx.fields["priority"] = priority
    return None
