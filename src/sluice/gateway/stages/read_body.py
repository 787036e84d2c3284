"""Stage 4: the body, within server.maxBodyBytes (413) and server.readTimeout (408)."""

from __future__ import annotations

import asyncio

from aiohttp import web

from sluice.config import ServerPolicy
from sluice.gateway.request_context import RequestContext


class ReadBody:
    def __init__(self, server: ServerPolicy) -> None:
        self.server = server

    async def run(self, ctx: RequestContext) -> web.Response | None:
        request = ctx.request
        try:
            if request.content.is_eof():
                ctx.raw = await request.read()  # all here already: no timer needed
            else:
                async with asyncio.timeout(self.server.read_timeout):
                    ctx.raw = await request.read()
        except web.HTTPRequestEntityTooLarge:
            return ctx.route.errors.response(
                413,
                f"the body is larger than {self.server.max_body_bytes} bytes",
                "body_too_large",
                ctx.headers,
            )
        except TimeoutError:
            return ctx.route.errors.response(
                408, "the request body was not received in time", "request_timeout", ctx.headers
            )
        return None
