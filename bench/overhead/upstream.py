"""A cheap fake OpenAI-compatible upstream for the overhead benchmark.

It answers as fast as it can so that the proxies, not the model, dominate what we
measure. POST /v1/chat/completions and /v1/completions return a fixed completion, or,
with "stream": true, an SSE stream of `max_tokens` chunks then `data: [DONE]`. The
benchmark-only body field `bench_interval_ms` paces the stream (one chunk per interval,
like one token per read). GET /v1/models, /health and /metrics look like vLLM's so that
the real gateway can discover and health-check it.

Run: python bench/overhead/upstream.py --port 8001
"""

from __future__ import annotations

import argparse
import asyncio
import time

import orjson
import uvloop
from aiohttp import web

MODEL = "bench-model"
DEFAULT_CHUNKS = 64


def _completion(model: str, chat: bool, n_tokens: int) -> bytes:
    text = "tok " * n_tokens
    if chat:
        choice = {"index": 0, "message": {"role": "assistant", "content": text}}
        obj = "chat.completion"
    else:
        choice = {"index": 0, "text": text}
        obj = "text_completion"
    choice["finish_reason"] = "length"
    body = {
        "id": "cmpl-bench",
        "object": obj,
        "created": int(time.time()),
        "model": model,
        "choices": [choice],
        "usage": {"prompt_tokens": 8, "completion_tokens": n_tokens, "total_tokens": 8 + n_tokens},
    }
    return orjson.dumps(body)


def _chunk(model: str, chat: bool, i: int) -> bytes:
    if chat:
        choice = {"index": 0, "delta": {"content": f"t{i} "}, "finish_reason": None}
        obj = "chat.completion.chunk"
    else:
        choice = {"index": 0, "text": f"t{i} ", "finish_reason": None}
        obj = "text_completion"
    body = {"id": "cmpl-bench", "object": obj, "created": 0, "model": model, "choices": [choice]}
    return b"data: " + orjson.dumps(body) + b"\n\n"


async def complete(request: web.Request) -> web.StreamResponse:
    try:
        body = orjson.loads(await request.read())
    except orjson.JSONDecodeError:
        return web.json_response({"error": {"message": "bad json", "type": "x", "code": None}}, 400)
    chat = request.path.endswith("/chat/completions")
    model = str(body.get("model", MODEL))
    n = int(body.get("max_tokens") or DEFAULT_CHUNKS)
    if not body.get("stream"):
        return web.Response(body=_completion(model, chat, n), content_type="application/json")
    interval = float(body.get("bench_interval_ms") or 0) / 1000.0
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    for i in range(n):
        if interval:
            await asyncio.sleep(interval)
        await resp.write(_chunk(model, chat, i))
    await resp.write(b"data: [DONE]\n\n")
    await resp.write_eof()
    return resp


async def models(_: web.Request) -> web.Response:
    data = [{"id": MODEL, "object": "model", "created": 0, "owned_by": "bench"}]
    return web.json_response({"object": "list", "data": data})


async def health(_: web.Request) -> web.Response:
    return web.Response(text="")


async def metrics(_: web.Request) -> web.Response:
    # vLLM serves Prometheus text here; an empty exposition is valid.
    return web.Response(text="", content_type="text/plain")


def make_app() -> web.Application:
    app = web.Application(client_max_size=16 * 1024 * 1024)
    app.router.add_post("/v1/chat/completions", complete)
    app.router.add_post("/v1/completions", complete)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    return app


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args()
    web.run_app(
        make_app(),
        host=args.host,
        port=args.port,
        print=None,
        access_log=None,
        loop=uvloop.new_event_loop(),
    )


if __name__ == "__main__":
    main()
