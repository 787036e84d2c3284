"""Bare pass-through proxy as a raw ASGI app (no framework), for uvicorn and granian.

Same behaviour as passthrough_aiohttp.py: forward the POST body over a pooled
aiohttp.ClientSession, relay the answer, SSE chunk by chunk as it arrives. The upstream
comes from the environment variable BENCH_UPSTREAM.

Run: BENCH_UPSTREAM=http://127.0.0.1:8001 uvicorn --http httptools --loop uvloop \
         --no-access-log --port 9001 bench.overhead.passthrough_asgi:app
     BENCH_UPSTREAM=... granian --interface asgi --loop uvloop --workers 1 --port 9002 \
         bench.overhead.passthrough_asgi:app
"""

from __future__ import annotations

import os
from typing import Any

import aiohttp

UPSTREAM = os.environ.get("BENCH_UPSTREAM", "http://127.0.0.1:8001").rstrip("/")
_session: aiohttp.ClientSession | None = None


def _get_session() -> aiohttp.ClientSession:
    # Created lazily inside the server's running loop; one pool for the process.
    global _session
    if _session is None:
        connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=60)
        _session = aiohttp.ClientSession(connector=connector, auto_decompress=False)
    return _session


async def _read_body(receive: Any) -> bytes:
    parts: list[bytes] = []
    while True:
        msg = await receive()
        if msg["type"] == "http.disconnect":
            raise ConnectionResetError("client went away")
        parts.append(msg.get("body", b""))
        if not msg.get("more_body"):
            return b"".join(parts)


async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    if scope["type"] == "lifespan":
        while True:
            msg = await receive()
            if msg["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            elif msg["type"] == "lifespan.shutdown":
                if _session is not None:
                    await _session.close()
                await send({"type": "lifespan.shutdown.complete"})
                return
    if scope["type"] != "http":
        return
    body = await _read_body(receive)
    session = _get_session()
    headers = {"Content-Type": "application/json"}
    async with session.post(UPSTREAM + scope["path"], data=body, headers=headers) as up:
        ctype = up.headers.get("Content-Type", "application/json")
        start = {
            "type": "http.response.start",
            "status": up.status,
            "headers": [(b"content-type", ctype.encode())],
        }
        if not ctype.startswith("text/event-stream"):
            payload = await up.read()
            start["headers"].append((b"content-length", str(len(payload)).encode()))
            await send(start)
            await send({"type": "http.response.body", "body": payload})
            return
        await send(start)
        async for chunk in up.content.iter_any():
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b""})
