"""`POST /v1/load_lora_adapter` and `/v1/unload_lora_adapter`, for the admin key only: a
LoRA adapter changes what a backend serves, which is an operator's decision, not a
tenant's. The call goes to every backend (or the one `?backend=NAME` names), each answer
is reported, and each backend's model list is read again, so that requests for the
adapter are routed to the backends that have it. 200 when every backend took it; else the
status of the first that did not (502 if it could not be reached)."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
from aiohttp import web

from sluice.gateway.backend_pool import BackendHandle, BackendPool
from sluice.gateway.error_shapes import OPENAI

ADMIN_CALL_TIMEOUT_S = 60.0  # loading an adapter reads its weights


async def _call(
    session: aiohttp.ClientSession, h: BackendHandle, path: str, body: bytes
) -> tuple[int, str]:
    try:
        async with session.post(
            h.url + path,
            data=body,
            headers=h.post_headers,
            timeout=aiohttp.ClientTimeout(total=ADMIN_CALL_TIMEOUT_S),
        ) as up:
            text = (await up.read()).decode("utf-8", "replace")
            return up.status, text[:1000]
    except (aiohttp.ClientError, TimeoutError, OSError) as exc:
        return 502, f"the backend could not be reached: {type(exc).__name__}"


async def lora_call(
    request: web.Request, pool: BackendPool, session: aiohttp.ClientSession, path: str
) -> web.Response:
    body = await request.read()
    only = request.query.get("backend")
    targets = [h for h in pool.backends.values() if only is None or h.name == only]
    if not targets:
        return OPENAI.response(404, f"No backend is named {only!r}.", "backend_not_found")
    answers = await asyncio.gather(*(_call(session, h, path, body) for h in targets))
    await asyncio.gather(*(pool.refresh_models(h) for h in targets))
    results: list[dict[str, Any]] = [
        {"backend": h.name, "status": status, "answer": text}
        for h, (status, text) in zip(targets, answers, strict=True)
    ]
    failed = [r for r in results if r["status"] != 200]
    status = 200 if not failed else int(failed[0]["status"])
    return web.json_response({"ok": not failed, "backends": results}, status=status)
