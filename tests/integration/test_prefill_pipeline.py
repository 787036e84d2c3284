"""A pooling engine gets a pipeline of embeddings: two steps' worth in flight, not what its
KV budget holds (core/prefill_pipeline.py).

Real processes: one `sluice sim --profile tiny` (4,096 tokens of KV) at a quarter speed,
so that requests stay in flight, and a gateway told it is alone in front of it; eight P0
embeddings of 1,000 tokens sent at once. Counted at their whole prompt, 3 fit the KV
budget (0.8 of the cache: 3,276.8 tokens), and the engine sat idle between an answer and
the next request reaching it; as a pipeline each counts 500, so 6 go, the engine computes
what its cache holds and queues the rest, and none is preempted."""

from __future__ import annotations

import asyncio
import time

import aiohttp
import pytest
from conftest import SimFactory
from gateway_proc import controller_state, start_gateway

pytestmark = pytest.mark.integration

POLICY = """
tenants:
  - {name: search, apiKeys: [sk-search], priority: 0}
admin: {apiKeys: [sk-demo-admin]}
server: {shutdownGrace: 1s}
fleet: {gateways: 1}
"""
EMBEDDINGS = 8
PROMPT = 1000


async def test_a_pooling_engine_gets_two_steps_of_embeddings_at_once(
    sim_factory: SimFactory,
) -> None:
    sim = sim_factory("--profile", "tiny", "--speed", "0.25")
    gw = await asyncio.to_thread(start_gateway, [sim.url], POLICY)
    body = {"model": "sluice-sim", "input": [list(range(1, PROMPT + 1))]}
    headers = {"Authorization": "Bearer sk-search"}

    async def embed(s: aiohttp.ClientSession) -> int:
        async with s.post(gw.url + "/v1/embeddings", json=body, headers=headers) as r:
            await r.read()
            return r.status

    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as s:
            tasks = [asyncio.ensure_future(embed(s)) for _ in range(EMBEDDINGS)]
            deadline = time.monotonic() + 10
            while True:  # until every request is at the gateway, in flight or queued
                state = await controller_state(s, gw.url)
                backend = state["backends"]["backend-0"]
                queued = state["classes"]["P0"]["queued"]
                if backend["inflight"] + queued == EMBEDDINGS:
                    break
                assert time.monotonic() < deadline, state
                await asyncio.sleep(0.005)
            assert await asyncio.gather(*tasks) == [200] * EMBEDDINGS
    finally:
        await asyncio.to_thread(gw.stop)
    # 6 x 500 of the budget's 3,276.8 tokens; counted whole it would have been 3 x 1,000
    assert (backend["inflight"], queued) == (6, 2), backend
    assert backend["inflight_tokens"] == 6 * PROMPT // 2
    assert sim.metrics()["vllm:num_preemptions_total"] == 0
