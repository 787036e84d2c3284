"""Stage 3: while the gateway shuts down it takes no new request (503, Retry-After 1:
another replica will); what is in flight may finish within server.shutdownGrace. The
queued ones are handed back at SIGTERM (`Controller.hand_over`: 503 `shutting_down`)."""

from __future__ import annotations

from aiohttp import web

from sluice.gateway.request_context import RequestContext


def shutting_down(ctx: RequestContext) -> web.Response:
    return ctx.route.errors.response(
        503,
        "The gateway is shutting down; retry on another replica.",
        "shutting_down",
        {**ctx.headers, "Retry-After": "1"},
    )
