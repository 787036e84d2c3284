"""`fleet: {gateways: 1}`: an operator who runs one gateway says so, and the fresh gateway
claims the backend's whole KV room from its first request. Without the count it must
assume replicas it cannot see (core/fleet_share.py: 1/16 until its scrapes have shown 4
of its requests and nobody else's), so a burst into a fresh gateway waits in its queue.

Real processes: one `sluice sim --profile tiny` (4,096 tokens of KV) at a quarter speed,
so that requests stay in flight, and a fresh `sluice serve` in front of it; six P1
streams sent at once (the initial limit 8 leaves P1 six slots; 6 x ~400 tokens fit P1's
share of the KV budget)."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import aiohttp
import pytest
from conftest import SimFactory
from gateway_proc import controller_state, start_gateway

pytestmark = pytest.mark.integration

POLICY = """
tenants:
  - {name: agents, apiKeys: [sk-agents], priority: 1}
admin: {apiKeys: [sk-demo-admin]}
server: {shutdownGrace: 1s}
"""
STREAMS = 6


async def _burst_into_a_fresh_gateway(url: str) -> tuple[dict[str, Any], int, int]:
    """The controller's state, and how many of the streams were in flight and queued,
    once all of them have reached the gateway."""
    body = {
        "model": "sluice-sim",
        "prompt": list(range(300)),
        "max_tokens": 100,
        "ignore_eos": True,
        "stream": True,
    }
    headers = {"Authorization": "Bearer sk-agents"}

    async def stream(s: aiohttp.ClientSession) -> int:
        async with s.post(url + "/v1/completions", json=body, headers=headers) as r:
            await r.read()
            return r.status

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as s:
        before = await controller_state(s, url)
        tasks = [asyncio.ensure_future(stream(s)) for _ in range(STREAMS)]
        deadline = time.monotonic() + 10
        while True:  # until every stream is at the gateway, in flight or queued
            state = await controller_state(s, url)
            inflight = state["backends"]["backend-0"]["inflight"]
            queued = state["classes"]["P1"]["queued"]
            if inflight + queued == STREAMS:
                break
            assert time.monotonic() < deadline, state
            await asyncio.sleep(0.005)
        assert await asyncio.gather(*tasks) == [200] * STREAMS
    return before, inflight, queued


@pytest.mark.parametrize("count", [True, False], ids=["gateways-1", "no-count"])
async def test_a_gateway_told_it_is_alone_sends_a_burst_at_once(
    sim_factory: SimFactory, count: bool
) -> None:
    sim = sim_factory("--profile", "tiny", "--speed", "0.25")
    policy = POLICY + ("fleet: {gateways: 1}\n" if count else "")
    gw = await asyncio.to_thread(start_gateway, [sim.url], policy)
    try:
        before, inflight, queued = await _burst_into_a_fresh_gateway(gw.url)
    finally:
        await asyncio.to_thread(gw.stop)
    fleet = before["fleet"]
    if count:
        assert (fleet["share"], fleet["processes"]) == (1.0, 1)
        assert (inflight, queued) == (STREAMS, 0)  # the whole room, from the first request
    else:
        assert fleet["share"] == pytest.approx(1 / 16) and fleet["processes"] is None
        assert queued > 0  # the cautious start: it cannot tell that it is alone
