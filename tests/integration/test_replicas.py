"""Several gateway replicas in front of the same backends, each with its own adaptive
limiters (as behind a Kubernetes Service): under a burst of 3x what the backends sustain,
three replicas keep the backends free of preemptions, as one replica does.

Real processes: two `sluice sim --profile tiny` backends (4,096 tokens of KV each), one or
three `sluice serve` gateways, and an open-loop client that spreads streaming requests
round-robin over the gateways. A direct burst (no gateway) is the control: the same load
sent straight to the backends does preempt.

What makes three replicas hold (core/kv_budget.py, docs/limiter.md "Shared
backends"): a replica counts the other replicas' requests a scrape shows (waiting ones
too) at its own mean footprint, claims only its share of the room left, and takes the
whole budget only once two scrapes in a row have shown the backend running its requests
and nobody else's; an idle backend gives it the floor share. Before that rule, each fresh
replica counted the whole cache as its own and three of them put ~18 requests on a backend
whose sweet spot is 11: 0-8 preemptions a run. tests/unit/test_bench_replicas.py checks
the same in virtual time, exactly, for 1 to 4 replicas."""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import aiohttp
import pytest
from conftest import SimFactory, SimProcess
from gateway_proc import GatewayProcess, start_gateway

pytestmark = pytest.mark.integration

PREEMPTIONS = "vllm:num_preemptions_total"
PROMPT_TOKENS, OUTPUT_TOKENS = 300, 60
# What one tiny backend sustains at its sweet spot for this mix (sluice.bench.capacity:
# 11 concurrent requests, 10.3 requests/s at speed 1, no preemption).
SWEET_RPS = 10.3
SPEED = 1.0
BACKENDS = 2
OFFERED = 3.0 * SWEET_RPS * SPEED * BACKENDS  # the 3x burst, requests/s
BURST_S = 3.0
DEADLINE_S = 5.0  # each client gives up after this (X-Request-Timeout)

POLICY = """
tenants:
  - {name: agents, apiKeys: [sk-agents], priority: 1}
admin: {apiKeys: [sk-demo-admin]}
server: {shutdownGrace: 2s}
"""


async def _one(
    session: aiohttp.ClientSession, url: str, body: dict[str, object], headers: dict[str, str]
) -> str:
    try:
        async with session.post(url + "/v1/completions", json=body, headers=headers) as r:
            if r.status != 200:
                payload = await r.json(content_type=None)
                return f"{r.status}:{payload['error']['code']}"
            async for line in r.content:
                if line.startswith(b"data: [DONE]"):
                    return "ok"
            return "cut"
    except (TimeoutError, aiohttp.ClientError):
        return "client_timeout"


async def _burst(urls: list[str]) -> Counter[str]:
    """OFFERED requests/s for BURST_S seconds, round-robin over `urls`; waits for all."""
    body = {
        "model": "sluice-sim",
        "prompt": list(range(PROMPT_TOKENS)),
        "max_tokens": OUTPUT_TOKENS,
        "ignore_eos": True,
        "stream": True,
    }
    headers = {"Authorization": "Bearer sk-agents", "X-Request-Timeout": str(DEADLINE_S)}
    n = int(OFFERED * BURST_S)
    timeout = aiohttp.ClientTimeout(total=DEADLINE_S + 2)
    async with aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=0), timeout=timeout
    ) as session:
        start = time.monotonic()
        tasks = []
        for i in range(n):
            await asyncio.sleep(max(0.0, start + i / OFFERED - time.monotonic()))
            tasks.append(asyncio.ensure_future(_one(session, urls[i % len(urls)], body, headers)))
        return Counter(await asyncio.gather(*tasks))


def _preemptions(sims: list[SimProcess]) -> float:
    return sum(s.metrics()[PREEMPTIONS] for s in sims)


def _drained(sims: list[SimProcess], within: float = 15.0) -> None:
    deadline = time.monotonic() + within
    while True:
        m = [s.metrics() for s in sims]
        if all(
            x["vllm:num_requests_running"] == 0 and x["vllm:num_requests_waiting"] == 0 for x in m
        ):
            return
        assert time.monotonic() < deadline, "the backends never drained"
        time.sleep(0.1)


async def _phase(name: str, sims: list[SimProcess], urls: list[str]) -> tuple[float, Counter[str]]:
    before = _preemptions(sims)
    outcomes = await _burst(urls)
    await asyncio.to_thread(_drained, sims)
    preempted = _preemptions(sims) - before
    print(f"{name}: {preempted:g} preemptions; {dict(outcomes)}")
    return preempted, outcomes


def _sims(sim_factory: SimFactory) -> list[SimProcess]:
    return [
        sim_factory("--profile", "tiny", "--speed", str(SPEED), "--seed", str(i))
        for i in range(BACKENDS)
    ]


def _gateways(urls: list[str], n: int) -> list[GatewayProcess]:
    with ThreadPoolExecutor(n) as pool:  # side by side: each takes a second to start
        return list(pool.map(lambda _: start_gateway(urls, POLICY), range(n)))


def _served_enough(outcomes: Counter[str]) -> None:
    """Protected by serving, not by refusing: at least half of what the backends
    sustain at their sweet spot over the burst completed."""
    floor = 0.5 * SWEET_RPS * SPEED * BACKENDS * BURST_S
    assert outcomes["ok"] >= floor, outcomes


async def test_one_replica_keeps_the_backends_free_of_preemptions_under_a_3x_burst(
    sim_factory: SimFactory,
) -> None:
    sims = _sims(sim_factory)
    (gateway,) = _gateways([s.url for s in sims], 1)
    try:
        # the control: the same burst straight to the backends overloads them
        direct, _ = await _phase("direct", sims, [s.url for s in sims])
        one, outcomes = await _phase("1 gateway", sims, [gateway.url])
    finally:
        gateway.stop()
    assert direct > 0, "the burst is not an overload: the test would prove nothing"
    _served_enough(outcomes)
    assert one == 0


async def test_three_replicas_keep_the_backends_free_of_preemptions_as_one_does(
    sim_factory: SimFactory,
) -> None:
    sims = _sims(sim_factory)
    gateways = _gateways([s.url for s in sims], 3)
    try:
        three, outcomes = await _phase("3 gateways", sims, [g.url for g in gateways])
    finally:
        for g in gateways:
            g.stop()
    _served_enough(outcomes)
    assert three == 0


# The bound on a burst into idle backends (docs/limiter.md "Shared backends", docs/bench.md
# "Fleets"): one gateway alone holds a tiny backend at L = floor(0.8 x 4,096 / 360) = 9
# requests of this mix (its KV budget over the requests' footprint, prompt + max_tokens).
# A replica that is not alone claims a part of the budget less the spread of the
# replicas' draws, 0.5 x sqrt(1 / share) requests: at least half a request (share < 1),
# so its claims and the others' add up to at most L' = floor((3,276.8 - 180) / 360) = 8
# requests (shares of the room that add up to at most 1; on an idle backend each claims
# its share, 1/16 for a fresh replica). Past its claim a replica sends one request at
# most (on the scrape's draw; then it is over its claim until one of its own ends): at
# most R more. Bound: L' + R = 8 + 4 = 12 requests running on a backend, given scrapes
# that show what was sent a step before them. (Before, a replica could always send one
# request to a backend with none of its own: L + R = 13, and in virtual time 8 replicas
# past a tiny engine's KV, 1,911 preemptions in `sluice bench fleet`.)
SHARED_LIMIT = 8
REPLICAS = 4
PEAK = "sluice_sim:num_requests_running_max"


async def test_four_fresh_replicas_burst_into_idle_backends_within_the_bound(
    sim_factory: SimFactory,
) -> None:
    sims = _sims(sim_factory)
    gateways = _gateways([s.url for s in sims], REPLICAS)
    try:
        preempted, outcomes = await _phase("4 gateways", sims, [g.url for g in gateways])
    finally:
        for g in gateways:
            g.stop()
    peaks = [s.metrics()[PEAK] for s in sims]
    bound = SHARED_LIMIT + REPLICAS
    print(f"peak running per backend {peaks}; bound {bound}")
    _served_enough(outcomes)
    assert preempted == 0
    assert max(peaks) <= bound, peaks
