"""A host that stops running the gateway (a paused VM; here SIGSTOP, then SIGCONT) is not
the engine queueing: the first tokens that came meanwhile are seen late by the time the
host stopped, and the limiter must not cut for it (core/stall_log.py). Before the stall
watch, each such stop of the `make test-vllm` VM (0.5-10 s, several a minute) cost a
`ttft` or `ttft-pending` cut, and P0 waited in the queue behind the lowered limit.

Real processes: one `sluice sim --profile tiny`, one `sluice serve` with the default
limiter; streams whose first tokens the simulator sends while the gateway is stopped."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from typing import Any

import aiohttp
import orjson
import pytest
from conftest import SimFactory
from gateway_proc import GatewayProcess, start_gateway

pytestmark = pytest.mark.integration

POLICY = """
tenants:
  - {name: agents, apiKeys: [sk-agents], priority: 0}
admin: {apiKeys: [sk-demo-admin]}
fleet: {gateways: 1}
server: {shutdownGrace: 1s}
"""
ADMIN = {"Authorization": "Bearer sk-demo-admin"}
BODY = {"model": "sluice-sim", "prompt": list(range(100)), "stream": True}
STOPPED_S = 1.5


async def _limiter(s: aiohttp.ClientSession, gw: GatewayProcess) -> dict[str, Any]:
    async with s.get(gw.url + "/admin/state", headers=ADMIN) as r:
        state = orjson.loads(await r.read())
    return state["controller"]["backends"]["backend-0"]["limiter"]  # type: ignore[no-any-return]


async def _inflight(s: aiohttp.ClientSession, gw: GatewayProcess) -> int:
    async with s.get(gw.url + "/admin/state", headers=ADMIN) as r:
        state = orjson.loads(await r.read())
    return state["controller"]["backends"]["backend-0"]["inflight"]  # type: ignore[no-any-return]


async def _streams(
    s: aiohttp.ClientSession, gw: GatewayProcess, n: int, max_tokens: int
) -> list[tuple[int, str]]:
    """(status, the gateway's request id) of `n` streams sent at once."""

    async def one() -> tuple[int, str]:
        headers = {"Authorization": "Bearer sk-agents"}
        body = BODY | {"max_tokens": max_tokens}
        async with s.post(gw.url + "/v1/completions", json=body, headers=headers) as r:
            await r.read()
            return r.status, r.headers["X-Request-Id"]

    return await asyncio.gather(*(one() for _ in range(n)))


async def test_a_stopped_gateway_does_not_read_the_stop_as_the_engines_queueing(
    sim_factory: SimFactory,
) -> None:
    # slow enough that the first tokens come while the gateway is stopped, not before
    sim = sim_factory("--profile", "tiny", "--speed", "0.05")
    gw = await asyncio.to_thread(start_gateway, [sim.url], POLICY)
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as s:
            # the limiter learns what a first token takes here (its base), one at a time
            alone: list[str] = []
            for _ in range(5):
                [(status, rid)] = await _streams(s, gw, 1, 2)
                assert status == 200
                alone.append(rid)
            before = await _limiter(s, gw)
            assert before["ttft_base_s_per_token"] is not None
            # four streams go out, and the host stops the gateway before their first tokens
            # (the simulator answers them meanwhile: they wait in the gateway's sockets)
            sent = asyncio.ensure_future(_streams(s, gw, 4, 40))
            deadline = time.monotonic() + 5
            while (await _inflight(s, gw)) < 4:  # all four sent to the simulator
                assert time.monotonic() < deadline
            os.kill(gw.proc.pid, signal.SIGSTOP)
            stopped_at = time.monotonic()
            try:
                await asyncio.sleep(STOPPED_S)
            finally:
                os.kill(gw.proc.pid, signal.SIGCONT)
            assert time.monotonic() - stopped_at >= STOPPED_S
            answers = await sent
            assert [status for status, _ in answers] == [200] * 4
            after = await _limiter(s, gw)
            stalled = gw.metrics().get("sluice_host_stall_seconds_total", 0.0)
    finally:
        await asyncio.to_thread(gw.stop)
    assert stalled >= STOPPED_S * 0.9, stalled  # the watch saw the stop
    # each of the four streams' access records says how long of it the host stopped the
    # gateway (flushed at the stop: every record is written by then)
    records = gw.access_records()
    for _, rid in answers:
        assert STOPPED_S * 0.9 <= records[rid]["host_stall_ms"] / 1000 <= STOPPED_S + 1, records[
            rid
        ]
    # the ones before it ran unstopped (a busy machine may still stall them a little)
    assert all(records[rid].get("host_stall_ms", 0) < 500 for rid in alone), [
        records[rid] for rid in alone
    ]
    # no cut for it: neither on the late first tokens nor on their overdue alarms (four
    # streams at this speed may pass P0's TPOT objective: a `tpot` cut is the engine's)
    first_token = {"ttft", "ttft-pending", "ttft-objective"}
    cuts = {k: v for k, v in after["cut_reasons"].items() if k in first_token}
    assert cuts == {k: v for k, v in before["cut_reasons"].items() if k in first_token}, cuts
