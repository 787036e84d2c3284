"""A backend that refuses requests because it is full is overloaded, not dead.

A fake vLLM on 127.0.0.1 (aiohttp, on the test's loop) refuses the way vLLM's admission
control (`--max-num-queued-reqs`) does, in both forms: HTTP 503 with a JSON error, and
HTTP 200 with an SSE `data: {"error": ...}` event. Meanwhile it answers /health and /metrics
later than the gateway waits for them, as a busy vLLM API server does. A real `sluice
serve` in front of it must keep the backend in service (never `503 no_backend`), feed the
refusals to the limiter as drops, relay every refusal as `503 backend_overloaded` with
Retry-After, and never let the retry of a refused request outwait its client."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import orjson
import pytest
from aiohttp import web
from gateway_proc import GatewayProcess, start_gateway

from sluice.gateway.backend_pool import HEALTH_INTERVAL_S, HEALTH_TIMEOUT_S, UNHEALTHY_AFTER

pytestmark = pytest.mark.integration

MODEL = "fake-vllm"
# vLLM 0.32's answers when running + waiting requests would exceed its cap (docs/vllm.md).
BUSY = {
    "message": "The engine is currently busy and cannot accept new requests. Please try "
    "again later or on a different instance.",
    "type": "Service Unavailable",
    "param": None,
    "code": 503,
}
REFUSED_503 = orjson.dumps({"error": BUSY})
REFUSED_SSE = b"data: " + orjson.dumps({"error": BUSY}) + b"\n\ndata: [DONE]\n\n"
METRICS = (
    "# TYPE vllm:num_requests_running gauge\n"
    'vllm:num_requests_running{engine="0",model_name="fake-vllm"} 0.0\n'
    "# TYPE vllm:num_requests_waiting gauge\n"
    'vllm:num_requests_waiting{engine="0",model_name="fake-vllm"} 0.0\n'
    "# TYPE vllm:kv_cache_usage_perc gauge\n"
    'vllm:kv_cache_usage_perc{engine="0",model_name="fake-vllm"} 0.5\n'
)
# Longer than the gateway's health-check timeout: every probe times out.
SLOW_S = HEALTH_TIMEOUT_S + 1.5
ADMIN = {"Authorization": "Bearer sk-test-admin"}
P0 = {"Authorization": "Bearer sk-test-p0"}


@dataclass
class FakeVllm:
    """Serves, or refuses everything as a full vLLM does; /health and /metrics can be slow."""

    full: bool = False
    slow: bool = False
    refuse_after_s: float = 0.0  # how long a refusal takes
    sse_only: bool = False  # refuse every stream after its 200 (never the early 503)
    # set: a streamed answer's first event waits for it (the head goes at once)
    first_event: asyncio.Event | None = None
    refusals: Counter[str] = field(default_factory=Counter)
    health_checks: Counter[str] = field(default_factory=Counter)
    url: str = ""
    _forms: itertools.cycle[str] = field(default_factory=lambda: itertools.cycle(["503", "sse"]))
    _stopping: asyncio.Event = field(default_factory=asyncio.Event)

    async def start(self) -> web.AppRunner:
        app = web.Application()
        app.router.add_get("/health", self._health)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/v1/models", self._models)
        app.router.add_post("/v1/completions", self._generate)
        app.router.add_post("/v1/chat/completions", self._generate)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{runner.addresses[0][1]}"
        return runner

    async def stop(self, runner: web.AppRunner) -> None:
        self._stopping.set()  # slow answers still pending end now
        await runner.cleanup()

    async def _late(self) -> None:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._stopping.wait(), SLOW_S)

    async def _health(self, _request: web.Request) -> web.Response:
        if self.slow:
            self.health_checks["slow"] += 1
            await self._late()
        return web.Response()

    async def _metrics(self, _request: web.Request) -> web.Response:
        if self.slow:
            await self._late()
        return web.Response(text=METRICS, content_type="text/plain")

    async def _models(self, _request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": MODEL, "object": "model"}]})

    async def _generate(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        stream = bool(body.get("stream"))
        hold = "hold" in orjson.dumps(body).decode()
        if self.full and not hold:
            await asyncio.sleep(self.refuse_after_s)
            # vLLM's early check answers 503; requests that passed it together are refused
            # after the 200 and the SSE headers went out
            form = ("sse" if self.sse_only else next(self._forms)) if stream else "503"
            self.refusals[form] += 1
            if form == "503":
                return web.Response(status=503, body=REFUSED_503, content_type="application/json")
            response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await response.prepare(request)
            await response.write(REFUSED_SSE)
            await response.write_eof()
            return response
        return await _answer(
            request, body, stream, seconds=6.0 if hold else 0.0, first_event=self.first_event
        )


async def _answer(
    request: web.Request,
    body: dict[str, Any],
    stream: bool,
    seconds: float,
    first_event: asyncio.Event | None = None,
) -> web.StreamResponse:
    """Four tokens spread over `seconds`."""
    chat = "messages" in body
    usage = {"prompt_tokens": 5, "completion_tokens": 4, "total_tokens": 9}
    if not stream:
        await asyncio.sleep(seconds)
        choice = {"index": 0, "finish_reason": "length"}
        choice |= (
            {"message": {"role": "assistant", "content": "a b c d"}}
            if chat
            else {"text": "a b c d"}
        )
        return web.json_response({"id": "x", "model": MODEL, "choices": [choice], "usage": usage})
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await response.prepare(request)
    if first_event is not None:
        await first_event.wait()
    with contextlib.suppress(ConnectionResetError):  # the gateway's client hung up
        for _ in range(4):
            await asyncio.sleep(seconds / 4)
            choice = (
                {"index": 0, "delta": {"content": "a "}} if chat else {"index": 0, "text": "a "}
            )
            event = orjson.dumps({"id": "x", "choices": [choice]})
            await response.write(b"data: " + event + b"\n\n")
        await response.write(b"data: " + orjson.dumps({"choices": [], "usage": usage}) + b"\n\n")
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
    return response


def _policy(limiter: str) -> str:
    return f"""
tenants:
  - {{name: chat-app, apiKeys: [sk-test-p0], priority: 0}}
admin:
  apiKeys: [sk-test-admin]
limiter: {limiter}
"""


def _body(i: int, stream: bool) -> tuple[str, dict[str, Any]]:
    if i % 2:
        return "/v1/completions", {
            "model": MODEL,
            "prompt": "hi",
            "max_tokens": 4,
            "stream": stream,
        }
    return "/v1/chat/completions", {
        "model": MODEL,
        "max_tokens": 4,
        "stream": stream,
        "messages": [{"role": "user", "content": "hi"}],
    }


@dataclass
class Answer:
    status: int
    code: str | None
    retry_after: str | None
    took_s: float
    body: bytes


async def _send(
    s: aiohttp.ClientSession,
    gw: GatewayProcess,
    path: str,
    body: dict[str, Any],
    headers: dict[str, str] = P0,
) -> Answer:
    started = time.monotonic()
    async with s.post(gw.url + path, json=body, headers=headers) as r:
        data = await r.read()
    code = None
    if data[:1] == b"{" and r.status != 200:
        code = orjson.loads(data)["error"]["code"]
    return Answer(r.status, code, r.headers.get("Retry-After"), time.monotonic() - started, data)


async def _until_idle(s: aiohttp.ClientSession, gw: GatewayProcess) -> None:
    """Until the gateway has nothing in flight (a cancelled client's slot is back)."""
    deadline = time.monotonic() + 5
    while True:
        async with s.get(gw.url + "/admin/state", headers=ADMIN) as r:
            state = orjson.loads(await r.read())
        if state["controller"]["backends"]["backend-0"]["inflight"] == 0:
            return
        assert time.monotonic() < deadline, state["controller"]["backends"]
        await asyncio.sleep(0.02)


async def test_refusals_and_slow_health_checks_keep_the_backend_in_service() -> None:
    fake = FakeVllm()
    runner = await fake.start()
    gw = await asyncio.to_thread(start_gateway, [fake.url], _policy("{algorithm: sluice}"))
    answers: list[Answer] = []
    states: list[dict[str, Any]] = []
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as s:
            assert (await _send(s, gw, *_body(0, stream=False))).status == 200

            # Full and slow: long enough for the health checks to time out more than
            # UNHEALTHY_AFTER times in a row (which used to take the backend out).
            fake.full = fake.slow = True
            busy_for = (UNHEALTHY_AFTER + 0.5) * (HEALTH_INTERVAL_S + HEALTH_TIMEOUT_S)
            stop_at = time.monotonic() + busy_for
            i = 0
            while time.monotonic() < stop_at:
                i += 1
                answers.append(await _send(s, gw, *_body(i, stream=i % 3 != 0)))
                async with s.get(gw.url + "/admin/state", headers=ADMIN) as r:
                    states.append(orjson.loads(await r.read()))
                await asyncio.sleep(0.05)

            # Still in service: the first request after the overload is served at once.
            fake.full = fake.slow = False
            after = await _send(s, gw, *_body(1, stream=True))
    finally:
        await asyncio.to_thread(gw.stop)
        await fake.stop(runner)

    log = "\n".join(gw.output)
    kinds = Counter((a.status, a.code) for a in answers)
    print(
        f"\n{len(answers)} requests while full: {dict(kinds)}; the fake refused "
        f"{dict(fake.refusals)}; {fake.health_checks['slow']} slow health checks"
    )
    # Both refusal forms reached the gateway, and the health checks did time out.
    assert fake.refusals["503"] > 0 and fake.refusals["sse"] > 0
    assert fake.health_checks["slow"] > UNHEALTHY_AFTER
    assert "kept in service" in log and "metrics of backend backend-0 unavailable" in log
    # Every refusal became an overload answer with Retry-After, none a success or no_backend.
    assert set(kinds) == {(503, "backend_overloaded")}, kinds
    assert all(a.retry_after is not None and int(a.retry_after) >= 1 for a in answers)
    # The backend never left service...
    assert "out of service" not in log
    assert all(st["backends"]["backend-0"]["healthy"] for st in states)
    assert after.status == 200 and after.body.endswith(b"data: [DONE]\n\n"), after
    # ...and the refusals reached its limiter as drops: it cut the limit.
    limiter = states[-1]["controller"]["backends"]["backend-0"]
    assert limiter["limiter"]["cut_reasons"].get("drop", 0) >= 1, limiter
    assert limiter["limit"] < 8, limiter


async def test_the_retry_of_a_refused_request_does_not_outwait_its_client() -> None:
    """One slot (a fixed limit of 1). A request is refused after 0.3 s while another
    queues behind it; the refused one's retry then finds the slot taken for 6 s. The
    client must get the refusal within the retry's short wait (or its own deadline), not
    after the queue's timeout (8 s for P0) or the other request's 6 s."""
    fake = FakeVllm(full=True, refuse_after_s=0.3)
    runner = await fake.start()
    gw = await asyncio.to_thread(
        start_gateway, [fake.url], _policy("{algorithm: fixed, fixedLimit: 1}")
    )
    hold = {"model": MODEL, "prompt": "hold", "max_tokens": 4, "stream": True}
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=15)) as s:
            results = {}
            for deadline in (None, 0.8):
                await _until_idle(s, gw)
                headers = dict(P0)
                if deadline is not None:
                    headers["X-Request-Timeout"] = str(deadline)
                refused = asyncio.create_task(_send(s, gw, *_body(1, False), headers=headers))
                await asyncio.sleep(0.1)  # the refused request holds the slot...
                holder = asyncio.create_task(_send(s, gw, "/v1/completions", hold))
                results[deadline] = await refused  # ...then the holder takes it for 6 s
                holder.cancel()
                await asyncio.gather(holder, return_exceptions=True)
    finally:
        await asyncio.to_thread(gw.stop)
        await fake.stop(runner)

    print(f"\nanswers: { {d: (a.status, a.code, round(a.took_s, 2)) for d, a in results.items()} }")
    for answer in results.values():
        # The backend's refusal, not a queue timeout of the gateway's own making.
        assert (answer.status, answer.code) == (503, "backend_overloaded"), answer
        assert answer.retry_after is not None and int(answer.retry_after) >= 1
    # The retry waited no more than its Retry-After (1 s) after the refusal at 0.3 s...
    assert results[None].took_s < 0.3 + 1.0 + 0.7
    # ...and no more than the client's own deadline.
    assert results[0.8].took_s < 0.8 + 0.3


async def _metrics_fresh(s: aiohttp.ClientSession, gw: GatewayProcess) -> None:
    """Until a scrape of the backend has answered (bounded)."""
    deadline = time.monotonic() + 10
    while True:
        async with s.get(gw.url + "/admin/state", headers=ADMIN) as r:
            state = orjson.loads(await r.read())
        if state["controller"]["backends"]["backend-0"]["metrics_fresh"]:
            return
        assert time.monotonic() < deadline, state["controller"]["backends"]
        await asyncio.sleep(0.05)


async def test_a_stream_head_goes_early_unless_the_backend_may_refuse_after_it() -> None:
    """Nothing waiting in the engine and no refusal seen: the client has the stream's head
    while the engine is still on its prefill (core/early_head.py). A refusal after the
    head then ends the stream with the route's error event (as vLLM's own stream would);
    from then on the heads wait for the first event again, and a refusal in it is the
    gateway's 503 with Retry-After."""
    fake = FakeVllm(sse_only=True, first_event=asyncio.Event())
    runner = await fake.start()
    gw = await asyncio.to_thread(
        start_gateway, [fake.url], _policy("{algorithm: fixed, fixedLimit: 8}")
    )
    path, body = _body(0, stream=True)
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as s:
            await _metrics_fresh(s, gw)
            # 1. The head arrives although the backend has not sent its first event yet.
            async with s.post(gw.url + path, json=body, headers=P0) as r:
                early = (r.status, r.headers["Content-Type"])
                fake.first_event.set()
                whole = await r.read()
            # 2. Refused after the head: the error event, in the route's shape.
            fake.full = True
            async with s.post(gw.url + path, json=body, headers=P0) as r:
                late = (r.status, await r.read())
            # 3. The backend may be full now: the head waits, the refusal is a 503.
            refused = await _send(s, gw, path, body)
        counted = gw.metrics()[
            'sluice_upstream_errors_total{backend="backend-0",kind="overloaded"}'
        ]
    finally:
        await asyncio.to_thread(gw.stop)
        await fake.stop(runner)

    print(f"\nearly head: {early}; refused after it: {late}; then: {refused.status}")
    assert early == (200, "text/event-stream")
    assert whole.endswith(b"data: [DONE]\n\n") and b'"content":"a "' in whole
    status, events = late
    assert status == 200 and events.startswith(b"data: {") and events.endswith(b"[DONE]\n\n")
    error = orjson.loads(events.split(b"\n\n")[0].removeprefix(b"data: "))["error"]
    assert error["code"] == "backend_overloaded" and "overloaded" in error["message"]
    assert (refused.status, refused.code) == (503, "backend_overloaded"), refused
    assert refused.retry_after is not None and int(refused.retry_after) >= 1
    # every refusal in a stream's first event counted, as a 503's is: the one after the
    # head, then the held one and its one more try
    assert counted == 3
