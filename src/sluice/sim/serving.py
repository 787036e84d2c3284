"""What the simulator's route modules share: reading a request, answering JSON or an
error, running engine requests to their end, and streaming one generation.

Every engine request is aborted when its HTTP handler ends without it (the client went
away: aiohttp cancels the handler, see `server.create_sim_app`), so its KV blocks are freed
at the next engine step, as vLLM's `with_cancellation` and its stream generators do.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import orjson
from aiohttp import web

from sluice.sim import fields
from sluice.sim.driver import EngineDriver, RequestHandle
from sluice.sim.engine import FINISH_ABORT, EngineRequest
from sluice.sim.openai_api import ApiError

SSE_HEADERS = {
    "Content-Type": "text/event-stream; charset=utf-8",
    "Cache-Control": "no-cache",
}
_engine_ids = itertools.count()


def engine_id(api_id: str) -> str:
    """An engine request id that is unique even when clients reuse X-Request-Id (vLLM
    also keeps its internal ids apart from the ones it answers with)."""
    return f"{api_id}#{next(_engine_ids)}"


def header_request_id(request: web.Request) -> str | None:
    """vLLM answers with the client's X-Request-Id when it sends one (`_base_request_id`)."""
    return request.headers.get("X-Request-Id")


async def read_json(request: web.Request) -> dict[str, Any]:
    return fields.json_body(await request.read(), request.headers.get("Content-Type"))


def json_response(obj: Any, status: int = 200) -> web.Response:
    return web.Response(body=orjson.dumps(obj), status=status, content_type="application/json")


def error_response(err: ApiError) -> web.Response:
    return web.Response(body=err.body(), status=err.status, content_type="application/json")


async def run_to_end(
    driver: EngineDriver, requests: Sequence[EngineRequest]
) -> list[RequestHandle]:
    """Submit all, wait until all are done; abort the unfinished ones if cancelled."""
    handles = [RequestHandle(None) for _ in requests]
    for req, handle in zip(requests, handles, strict=True):
        driver.submit(req, handle)
    try:
        for handle in handles:
            while not handle.done:
                await handle.wait()
    finally:
        for req, handle in zip(requests, handles, strict=True):
            if not handle.done:
                driver.abort(req.request_id)
    return handles


@dataclass(slots=True)
class StreamShape:
    """The bytes of one generation stream around its per-token chunks."""

    render: Callable[[int, str | None], bytes]  # token index, finish reason -> its chunk
    opening: bytes = b""  # sent at once, before the engine produced anything
    first: Callable[[], bytes] = lambda: b""  # sent with the first token, before its chunk
    closing: Callable[[RequestHandle], bytes] = lambda h: b""  # after the last token
    aborted: Callable[[RequestHandle], bytes] = lambda h: b""  # instead, on an engine abort


async def stream_generation(
    request: web.Request, driver: EngineDriver, engine_req: EngineRequest, shape: StreamShape
) -> web.StreamResponse:
    handle = RequestHandle(shape.render)
    response = web.StreamResponse(headers=SSE_HEADERS)
    driver.submit(engine_req, handle)
    completed = False
    try:
        await response.prepare(request)
        if shape.opening:
            await response.write(shape.opening)
        await handle.wait()
        data = handle.take()
        if data:
            data = shape.first() + data
        while True:
            if handle.done:
                if handle.finish_reason == FINISH_ABORT:
                    data += shape.aborted(handle)
                else:
                    data += shape.closing(handle)
                completed = True
                await response.write(data)
                break
            await response.write(data)
            await handle.wait()
            data = handle.take()
    except ConnectionError:
        return response  # the client went away mid-stream; aborted below
    finally:
        if not completed:
            driver.abort(engine_req.request_id)
    return response
