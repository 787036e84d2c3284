"""Bare pass-through proxy on aiohttp.web + uvloop: the Python floor for the gateway.

No auth, no logic: forward the POST body to the upstream over a pooled
aiohttp.ClientSession and relay the answer; an SSE answer is relayed chunk by chunk as it
arrives, never buffered. A client that goes away cancels the handler, which closes the
upstream response (the abort the gateway relies on).

Run: python bench/overhead/passthrough_aiohttp.py --port 9000 --upstream http://127.0.0.1:8001
"""

from __future__ import annotations

import argparse

import aiohttp
import uvloop
from aiohttp import web

UPSTREAM = web.AppKey("upstream", str)
SESSION = web.AppKey("session", aiohttp.ClientSession)


async def relay(request: web.Request) -> web.StreamResponse:
    session = request.app[SESSION]
    body = await request.read()
    headers = {"Content-Type": request.headers.get("Content-Type", "application/json")}
    url = request.app[UPSTREAM] + request.path
    async with session.post(url, data=body, headers=headers) as up:
        ctype = up.headers.get("Content-Type", "")
        if not ctype.startswith("text/event-stream"):
            return web.Response(
                body=await up.read(), status=up.status, content_type=ctype.split(";")[0]
            )
        resp = web.StreamResponse(status=up.status, headers={"Content-Type": ctype})
        await resp.prepare(request)
        async for chunk in up.content.iter_any():
            await resp.write(chunk)
        await resp.write_eof()
        return resp


async def _session_ctx(app: web.Application):  # type: ignore[no-untyped-def]
    connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=60)
    app[SESSION] = aiohttp.ClientSession(connector=connector, auto_decompress=False)
    yield
    await app[SESSION].close()


def make_app(upstream: str) -> web.Application:
    app = web.Application()
    app[UPSTREAM] = upstream.rstrip("/")
    app.cleanup_ctx.append(_session_ctx)
    app.router.add_post("/v1/chat/completions", relay)
    app.router.add_post("/v1/completions", relay)
    return app


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--upstream", required=True)
    args = parser.parse_args()
    web.run_app(
        make_app(args.upstream),
        host=args.host,
        port=args.port,
        print=None,
        access_log=None,
        loop=uvloop.new_event_loop(),
    )


if __name__ == "__main__":
    main()
