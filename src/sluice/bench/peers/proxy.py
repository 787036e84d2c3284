"""A peer arm as a real HTTP proxy, for `sluice bench --mode real`: the same decision model
as virtual time (`bench.peers`), driven by wall-clock time, in front of `sluice sim`
processes on 127.0.0.1.

    python -m sluice.bench.peers.proxy --arm litellm --cap 12 --port 0 \\
        --backend http://127.0.0.1:8001 [--backend ...]

It scrapes each backend's /metrics as often as the peer does, answers a refusal the way
the peer does (status, Retry-After, an OpenAI-shaped body whose `code` names the peer's
reason), relays accepted requests' streams byte for byte, and tells the model about first
tokens, ends and client disconnects (the upstream request is closed then). The bench's
client sends the request's class in `X-Bench-Priority` (GIE reads it as the objective's
priority; LiteLLM and Envoy ignore it). `/metrics` exports `sluice_backend_limit`,
`sluice_backend_inflight` and `sluice_queue_depth` under the gateway's names, so the
bench samples a peer as it samples Sluice. A benchmark tool, not a gateway: no auth, no
retries, one route shape."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import sys
from typing import Any

import aiohttp
import orjson
from aiohttp import web
from prometheus_client import CollectorRegistry, Gauge, generate_latest

from sluice.bench.peers import PEER_ARMS, peer_factory
from sluice.bench.peers.base import STATUS, PeerAdmission, PeerCode, PeerGateway
from sluice.core.clock import MonotonicClock
from sluice.core.types import Assignment, Outcome, RequestInfo
from sluice.gateway.engines.vllm import VllmAdapter

_ROUTES = ("/v1/completions", "/v1/chat/completions")


def _refusal(code: PeerCode, retry_after_s: float | None) -> web.Response:
    headers = {}
    if retry_after_s is not None:
        headers["Retry-After"] = f"{retry_after_s:g}"
    body = {"error": {"message": f"refused: {code.value}", "type": "overloaded", "code": code}}
    return web.json_response(body, status=STATUS[code], headers=headers, dumps=_dumps)


def _dumps(obj: Any) -> str:
    return orjson.dumps(obj).decode()


class PeerProxy:
    def __init__(self, gateway: PeerGateway, urls: dict[str, str]) -> None:
        self.gw = gateway
        self.urls = urls
        self.waiting: dict[str, asyncio.Future[Assignment | PeerCode]] = {}
        self._ids = itertools.count()
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at: float | None = None
        self.registry = CollectorRegistry()
        self.g_limit = Gauge("sluice_backend_limit", "", ["backend"], registry=self.registry)
        self.g_inflight = Gauge("sluice_backend_inflight", "", ["backend"], registry=self.registry)
        self.g_depth = Gauge("sluice_queue_depth", "", ["priority"], registry=self.registry)
        self.g_pressure = Gauge("sluice_pressure", "", registry=self.registry)

    # -- driving the model -----------------------------------------------------------------

    def pump(self) -> None:
        gw = self.gw
        assignments, rejections, wake_at = gw.step()
        for rej in rejections:
            fut = self.waiting.pop(rej.request_id, None)
            if fut is not None and not fut.done():
                fut.set_result(rej.code)
        for a in assignments:
            fut = self.waiting.pop(a.request_id, None)
            if fut is None or fut.done():
                gw.cancel(a.request_id)
                continue
            fut.set_result(a)
        self._arm(wake_at)

    def _arm(self, at: float | None) -> None:
        if at is None or (self._timer_at is not None and self._timer_at <= at):
            return
        if self._timer is not None:
            self._timer.cancel()
        loop = asyncio.get_running_loop()
        self._timer_at = at
        self._timer = loop.call_at(max(at, loop.time()), self._wake)

    def _wake(self) -> None:
        self._timer = self._timer_at = None
        self.pump()

    async def scrape(self, session: aiohttp.ClientSession) -> None:
        parsers = {name: VllmAdapter() for name in self.urls}  # the simulators are vLLM
        interval = self.gw.scrape_interval_s
        clock = MonotonicClock()
        while True:
            started = clock.now()
            for name, url in self.urls.items():
                try:
                    timeout = aiohttp.ClientTimeout(total=max(0.5, 4 * interval))
                    async with session.get(f"{url}/metrics", timeout=timeout) as r:
                        text = await r.text()
                    self.gw.on_metrics(name, parsers[name].read({"/metrics": text}, clock.now()))
                except (aiohttp.ClientError, TimeoutError, ValueError):
                    self.gw.metrics_stale(name)
            self.pump()
            await asyncio.sleep(max(0.0, started + interval - clock.now()))

    # -- HTTP --------------------------------------------------------------------------------

    async def metrics(self, request: web.Request) -> web.Response:
        snap = self.gw.snapshot()
        for name, b in snap.backends.items():
            self.g_limit.labels(name).set(b.limit)
            self.g_inflight.labels(name).set(b.inflight)
        for p, n in enumerate(snap.queued):
            self.g_depth.labels(str(p)).set(n)
        self.g_pressure.set(snap.pressure)
        return web.Response(body=generate_latest(self.registry), content_type="text/plain")

    async def ready(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = await request.read()
        try:
            priority = min(2, max(0, int(request.headers.get("X-Bench-Priority", "1"))))
        except ValueError:
            priority = 1
        rid = f"p{next(self._ids)}"
        info = RequestInfo(rid, "bench", priority, "sim", prompt_tokens=0, max_tokens=1)
        adm: PeerAdmission = self.gw.arrive(info)
        if not adm.admitted:
            assert adm.code is not None
            self.pump()
            return _refusal(adm.code, adm.retry_after_s)
        fut: asyncio.Future[Assignment | PeerCode] = asyncio.get_running_loop().create_future()
        self.waiting[rid] = fut
        self.pump()
        try:
            got = await fut
        except asyncio.CancelledError:
            self.waiting.pop(rid, None)
            self.gw.cancel(rid)
            self.pump()
            raise
        if isinstance(got, PeerCode):
            return _refusal(got, None)
        return await self._relay(request, rid, got.backend, body)

    async def _relay(
        self, request: web.Request, rid: str, backend: str, body: bytes
    ) -> web.StreamResponse:
        session: aiohttp.ClientSession = request.app["session"]
        outcome = Outcome.ERROR
        first = True
        resp: web.StreamResponse | None = None
        try:
            async with session.post(
                f"{self.urls[backend]}{request.path}",
                data=body,
                headers={"Content-Type": "application/json"},
            ) as up:
                resp = web.StreamResponse(
                    status=up.status,
                    headers={"Content-Type": up.headers.get("Content-Type", "application/json")},
                )
                await resp.prepare(request)
                async for chunk in up.content.iter_any():
                    if first and up.status == 200:
                        first = False
                        self.gw.on_first_token(rid)
                    await resp.write(chunk)
                await resp.write_eof()
                outcome = Outcome.OK if up.status == 200 else Outcome.ERROR
            return resp
        except (ConnectionResetError, asyncio.CancelledError):
            outcome = Outcome.CANCELLED  # the client went away: the upstream is closed
            raise
        except aiohttp.ClientError:
            if resp is None:
                return web.json_response(
                    {"error": {"message": "backend unreachable", "code": "upstream"}}, status=502
                )
            return resp
        finally:
            self.gw.on_finish(rid, outcome)
            self.pump()


async def _serve(args: argparse.Namespace) -> None:
    names = [f"b{i}" for i in range(len(args.backend))]
    urls = dict(zip(names, args.backend, strict=True))
    gateway = peer_factory(args.arm, cap=args.cap, seed=args.seed)(MonotonicClock(), names)
    proxy = PeerProxy(gateway, urls)
    app = web.Application()
    for route in _ROUTES:
        app.router.add_post(route, proxy.completions)
    app.router.add_get("/metrics", proxy.metrics)
    app.router.add_get("/readyz", proxy.ready)
    app.router.add_get("/healthz", proxy.ready)
    session = aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=0), timeout=aiohttp.ClientTimeout(total=None)
    )
    app["session"] = session
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", args.port)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    print(f"{args.arm} peer proxy on http://127.0.0.1:{port}", flush=True)
    scraper = asyncio.create_task(proxy.scrape(session))
    try:
        await asyncio.Event().wait()
    finally:
        scraper.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await scraper
        await session.close()
        await runner.cleanup()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m sluice.bench.peers.proxy")
    parser.add_argument("--arm", required=True, choices=PEER_ARMS)
    parser.add_argument("--cap", type=int, default=1, help="LiteLLM's max_parallel_requests")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--backend", action="append", required=True, metavar="URL")
    args = parser.parse_args(argv)
    import signal

    import uvloop

    async def run() -> None:
        loop = asyncio.get_running_loop()
        task = asyncio.current_task()
        assert task is not None
        loop.add_signal_handler(signal.SIGTERM, task.cancel)
        with contextlib.suppress(asyncio.CancelledError):
            await _serve(args)

    uvloop.run(run())
    return 0


if __name__ == "__main__":
    sys.exit(main())
