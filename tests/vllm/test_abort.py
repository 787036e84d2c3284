"""A client that hangs up on the gateway makes the real vLLM abort its request at once,
freeing its KV blocks (DESIGN S9)."""

from __future__ import annotations

import asyncio
import contextlib
import random
import re
import time

import aiohttp
import orjson
import pytest
from conftest import wait_idle
from gateway_proc import start_gateway
from loadgen import completion_body, token_prompt
from vllm_server import VllmServer

pytestmark = pytest.mark.integration

STREAMS = 20
# A fixed cap above STREAMS, so that all 20 run at once on vLLM (the adaptive limiter would
# rightly hold some back); this test is about the relay, not the limiter.
POLICY = """
tenants:
  - {name: chat-app, apiKeys: [sk-demo-p0], priority: 0}
limiter: {algorithm: fixed, fixedLimit: 32}
"""
_RUNNING = re.compile(rb"^vllm:num_requests_running\{[^}]*\} (\S+)$", re.M)


async def test_twenty_client_closes_free_vllm_within_100ms(vllm: VllmServer) -> None:
    wait_idle(vllm)
    gw = start_gateway([vllm.url], POLICY)
    rng = random.Random(20)
    try:
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:

            async def running() -> tuple[float, float, float]:
                """(poll start, poll end, running); a poll costs a few ms: no full parse."""
                t = time.monotonic()
                async with s.get(vllm.url + "/metrics") as r:
                    body = await r.read()
                return t, time.monotonic(), sum(float(x) for x in _RUNNING.findall(body))

            async def open_stream() -> aiohttp.ClientResponse:
                # 16 + up to 200 tokens: one 128-token KV block each for the first ~110
                # tokens (20 of vLLM's 31 usable blocks), seconds of work in all
                body = completion_body(vllm.model, token_prompt(rng, 16), 200)
                r = await s.post(
                    gw.url + "/v1/completions",
                    data=orjson.dumps(body),
                    headers={
                        "Authorization": "Bearer sk-demo-p0",
                        "Content-Type": "application/json",
                    },
                )
                assert r.status == 200
                await r.content.readline()  # streaming: the request is running on vLLM
                return r

            streams = await asyncio.gather(*(open_stream() for _ in range(STREAMS)))
            deadline = time.monotonic() + 10
            while (await running())[2] != STREAMS:
                assert time.monotonic() < deadline, "the 20 streams never ran together"

            # One poller already running when the streams close (more would load vLLM's API
            # server and slow the very aborts measured): the first poll that reads 0 bounds
            # the moment vLLM's count dropped.
            polls: list[tuple[float, float, float]] = []
            zero = asyncio.Event()

            async def poller() -> None:
                while not zero.is_set():
                    p = await running()
                    polls.append(p)
                    if p[2] == 0:
                        zero.set()

            task = asyncio.create_task(poller())
            await asyncio.sleep(0.02)
            for r in streams:
                r.close()
            closed = time.monotonic()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(zero.wait(), 5)
            task.cancel()
            zeros = [end for _, end, n in polls if n == 0]
            assert zeros, f"vLLM still ran requests 5 s after the closes: {polls[-3:]}"
            dropped_by = min(zeros) - closed
            trace = [
                (round((a - closed) * 1000), round((b - closed) * 1000), int(n))
                for a, b, n in polls
                if b > closed
            ]
            print(f"\nvLLM running 20 -> 0 within {dropped_by * 1000:.0f} ms of the closes")
            assert dropped_by <= 0.100, (
                f"running dropped to 0 only {dropped_by * 1000:.0f} ms after the closes; "
                f"polls (start ms, end ms, running): {trace}"
            )

        # vLLM does not count aborts in vllm:request_success_total; the gateway counts its own.
        deadline = time.monotonic() + 5
        while True:
            m = gw.metrics()
            aborts = m.get('sluice_upstream_aborts_total{backend="backend-0"}', 0)
            cancelled = m.get('sluice_requests_total{outcome="cancelled",priority="0"}', 0)
            if aborts == STREAMS and cancelled == STREAMS:
                break
            assert time.monotonic() < deadline, (aborts, cancelled)
            await asyncio.sleep(0.05)
        engine = vllm.metrics()
        assert engine['vllm:request_success_total{finished_reason="abort"}'] == 0
    finally:
        gw.stop()
