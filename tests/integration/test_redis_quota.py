"""TenantLimits quotas shared through a real redis-server (scripts/ensure_redis.sh installs it;
each test starts its own on a free port in a temporary folder and kills it).

The must-show: two gateway processes in front of the same backend, one Redis: a tenant with
a quota of N tokens per minute, hit through both, is admitted N (within 5 %) in total, not
2N; killing Redis mid-test leaves both gateways serving (fail open to local quotas, each gateway
holding its share of the quota, logged once and exported), and they share the quota again
once Redis is back."""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
from conftest import SimFactory
from gateway_proc import GatewayProcess, start_gateway
from redis.exceptions import TimeoutError as RedisTimeoutError
from redis_proc import REDIS_SERVER, RedisServer

from sluice.config import parse_policy
from sluice.core.clock import MonotonicClock
from sluice.core.controller import Controller
from sluice.core.quota import InProcessQuotas
from sluice.core.settings import TenantLimits
from sluice.core.types import Outcome, RequestInfo
from sluice.gateway.shared_quota import SharedQuotaGate, hand_back_key, tenant_keys

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(
        REDIS_SERVER is None, reason="redis-server is missing: run scripts/ensure_redis.sh"
    ),
]


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path)
    server.start()
    yield server
    server.kill()


# -- the scripts against a real Redis, two "processes" in one ------------------------------


def _gate(url: str, *tenants: TenantLimits, stale_after_s: float = 10.0) -> SharedQuotaGate:
    return SharedQuotaGate(
        url, tenants, MonotonicClock(), stale_after_s=stale_after_s, call_timeout_s=1.0
    )


async def test_request_and_token_buckets_behave_like_the_in_process_ones(
    redis_server: RedisServer,
) -> None:
    rpm = TenantLimits(name="rpm", requests_per_minute=4)
    tpm = TenantLimits(name="tpm", tokens_per_minute=600)
    a, b = _gate(redis_server.url, rpm, tpm), _gate(redis_server.url, rpm, tpm)
    local = InProcessQuotas([rpm, tpm])
    try:
        # 4 requests a minute, two through each process, then both are refused
        for gate in (a, b, a, b):
            assert (await gate.acquire("rpm", 1)).ok
            assert local.acquire("rpm", 1, 0.0).ok
        for gate in (a, b):
            refused = await gate.acquire("rpm", 1)
            expected = local.acquire("rpm", 1, 0.0)
            assert not refused.ok and not expected.ok
            assert refused.retry_after_s == pytest.approx(expected.retry_after_s, abs=0.2)
        assert expected.retry_after_s == 15.0

        # 600 tokens a minute: 500 through one, then 200 through the other waits for 100
        assert (await a.acquire("tpm", 500)).ok and local.acquire("tpm", 500, 0.0).ok
        refused = await b.acquire("tpm", 200)
        expected = local.acquire("tpm", 200, 0.0)
        assert expected.retry_after_s == 10.0
        assert not refused.ok
        assert refused.retry_after_s == pytest.approx(10.0, abs=0.2)
        # a request that never ran gives its tokens back, for everyone
        small = await b.acquire("tpm", 90)
        assert small.ok
        small.close()
        await _drain(b)
        assert (await a.acquire("tpm", 90)).ok
    finally:
        await a.stop()
        await b.stop()


async def _drain(gate: SharedQuotaGate) -> None:
    await gate.flush()


async def test_max_concurrency_holds_across_processes_and_outlives_a_crashed_one(
    redis_server: RedisServer,
) -> None:
    capped = TenantLimits(name="capped", max_concurrency=2)
    a = _gate(redis_server.url, capped, stale_after_s=0.5)
    b = _gate(redis_server.url, capped, stale_after_s=0.5)
    try:
        a1 = await a.acquire("capped", 1)
        b1 = await b.acquire("capped", 1)
        assert a1.ok and b1.ok
        refused = await a.acquire("capped", 1)
        assert not refused.ok and refused.retry_after_s == 1.0
        b1.ran = True
        b1.close()
        await _drain(b)
        a2 = await a.acquire("capped", 1)
        assert a2.ok
        assert not (await b.acquire("capped", 1)).ok
        # process `a` crashes holding both slots: it never releases nor beats again;
        # once it has been silent for stale_after_s its slots no longer count
        crashed_at = time.monotonic()
        while not (await b.acquire("capped", 1)).ok:
            assert time.monotonic() - crashed_at < 3.0, "a crashed process's slots stayed"
            await asyncio.sleep(0.05)
        assert time.monotonic() - crashed_at >= 0.4
    finally:
        await a.stop()
        await b.stop()


async def test_a_debt_is_never_forgiven_and_the_hand_back_has_no_floor(
    redis_server: RedisServer,
) -> None:
    """Before, every script took a level below minus a bucket back up to it: in `sluice
    bench fleet-quotas-hang` Redis forgave 43,623 of the tokens the hand-backs charged
    batch-etl (100,000 a minute)."""
    a = _gate(redis_server.url, TenantLimits(name="tpm", tokens_per_minute=600))
    rate, conc, _, _ = tenant_keys("tpm")
    client = redis.Redis(port=redis_server.port)

    def level() -> float:
        return float(client.hget(rate, "tl"))

    try:
        # a hand-back of 1,500 tokens to a full bucket of 600: -900, not -600
        record = hand_back_key("tpm", a.process, 1)
        await a._resume(keys=(rate, record), args=(0, 600, 0, 1500, -1, -1, 1, 60))
        assert level() == pytest.approx(-900, abs=1)  # (10 tokens a second refill)
        # 10 tokens back: -890, not lifted to -600
        await a._finish(keys=(rate, conc), args=(0, 600, 0, 10, 0, a.process))
        assert level() == pytest.approx(-890, abs=1)
        # a request's usage 100 past its charge: no deeper than it was (a report costs
        # a tenant at most a minute of debt), and not lifted either
        await a._finish(keys=(rate, conc), args=(0, 600, 0, -100, 0, a.process))
        assert level() == pytest.approx(-890, abs=1)
        # the key lives until the bucket would be full again: 1,490 tokens at 10 a second
        assert 148_000 <= client.pttl(rate) <= 150_000
    finally:
        client.close()
        await a.stop()


async def test_parts_of_the_demand_add_up_and_a_restarted_redis_gets_its_levels_back(
    redis_server: RedisServer,
) -> None:
    tpm = TenantLimits(name="tpm", tokens_per_minute=6000)
    a, b = _gate(redis_server.url, tpm), _gate(redis_server.url, tpm)
    try:
        started = time.monotonic()
        for _ in range(3):
            assert (await a.acquire("tpm", 100)).ok
        assert (await b.acquire("tpm", 100)).ok
        await a._refresh_sight("tpm")  # what the heartbeat does for a quiet tenant
        seen_a = a.controller_quotas.sight("tpm")
        seen_b = b.controller_quotas.sight("tpm")
        assert seen_a is not None and seen_b is not None
        # 300 and 100 tokens asked, moments apart: 3/4 and 1/4 (demand decays by 1/30 a s)
        assert seen_a.part == pytest.approx(0.75, abs=0.01)
        assert seen_b.part == pytest.approx(0.25, abs=0.01)
        # 6000 - 400, + what refilled since (100 a second)
        assert 5600 <= seen_a.tokens_level <= 5600 + 100 * (time.monotonic() - started)
        # Redis restarts (empty) while `a` holds its share; once it is back, `a` restores
        # the level it last saw and charges what it admitted meanwhile
        await a.start()
        redis_server.kill()
        ticket = await a.acquire("tpm", 1000)
        assert ticket.ok and not ticket.shared and a.mode == "local"
        assert a.controller_quotas.acquire("tpm", 1000, a._clock.now()).ok
        redis_server.start()
        deadline = time.monotonic() + 5.0
        while a.mode != "redis":
            assert time.monotonic() < deadline, "never went back to Redis"
            await asyncio.sleep(0.05)
        # 5600 as last seen, + 100 a second refilled since, - the 1000 admitted locally
        client = redis.Redis(port=redis_server.port)
        level = float(client.hget(tenant_keys("tpm")[0], "tl"))
        client.close()
        refilled = 100 * (a._clock.now() - seen_a.at)
        assert seen_a.tokens_level - 1000 <= level <= seen_a.tokens_level + refilled - 1000
    finally:
        await a.stop()
        await b.stop()


# -- the hand-back: once, and what ends after it -------------------------------------------

HB_POLICY = """
tenants: [{name: tpm, apiKeys: [sk-tpm], priority: 0, tokensPerMinute: 6000}]
limiter: {algorithm: fixed, fixedLimit: 4}
"""


def _level(server: RedisServer, tenant: str) -> float:
    client = server.client()
    try:
        return float(client.hget(tenant_keys(tenant)[0], "tl") or 6000)
    finally:
        client.close()


def _local_controller(gate: SharedQuotaGate) -> Controller:
    """A Controller whose quotas are the gate's, Redis lost (as a refused call leaves it)."""
    settings = parse_policy(HB_POLICY).core_settings()
    controller = Controller(settings, gate._clock, ["b0"], quotas=gate.controller_quotas)
    gate.controller_quotas.set_processes(1, 0.0)  # alone: the whole quota is its share
    gate.circuit.failure(timeout=False)
    gate._went_local("connection", None)
    assert gate.mode == "local"
    return controller


async def test_a_hand_back_whose_answer_is_lost_is_charged_once(
    redis_server: RedisServer,
) -> None:
    """The hand-back reaches Redis and is applied, but its answer is lost (a timeout
    after the script ran): the next probe sends it again. Before, Redis charged the
    outage twice (6000 - 2 x 300 = 5,400 left, not 5,700)."""
    a = _gate(redis_server.url, TenantLimits(name="tpm", tokens_per_minute=6000))
    c = _local_controller(a)
    resume = a._resume
    lost = [True]

    async def answer_lost(**kw: Any) -> Any:
        answer = await resume(**kw)  # applied in Redis...
        if lost[0]:
            lost[0] = False
            raise RedisTimeoutError("Timeout reading from socket")  # ...answer lost
        return answer

    a._resume = answer_lost
    try:
        assert c.arrive(RequestInfo("r1", "tpm", 0, "m", 200, 200)).admitted
        charged = c._records["r1"].quota_tokens
        await a._probe()
        assert a.mode == "local" and not lost[0]  # the answer was lost: still local
        await a._probe()
        assert a.mode == "redis"
        started = time.monotonic()
        level = _level(redis_server, "tpm")
        assert 6000 - charged - 1 <= level <= 6000 - charged + 100 * (time.monotonic() - started)
    finally:
        await a.stop()


async def test_what_ends_after_the_hand_back_still_reaches_redis_once(
    redis_server: RedisServer,
) -> None:
    """Requests admitted locally while Redis was lost end after the hand-back: one used
    1,400 tokens (its estimate: 300), the backend failed the other (nothing billed: its
    300 back). Before, neither reached Redis: it kept the 600 charged, not the 1,400
    used."""
    a = _gate(redis_server.url, TenantLimits(name="tpm", tokens_per_minute=6000))
    c = _local_controller(a)
    try:
        for rid in ("used", "cancelled"):
            assert c.arrive(RequestInfo(rid, "tpm", 0, "m", 200, 200)).admitted
        charged = c._records["used"].quota_tokens
        c.step()  # both dispatched
        await a._probe()
        assert a.mode == "redis"
        assert _level(redis_server, "tpm") == pytest.approx(6000 - 2 * charged, abs=60)
        await a.start()  # its background loop sends what ends from now on
        c.on_finish("used", Outcome.OK, 200, 1200)
        c.on_finish("cancelled", Outcome.ERROR)  # the backend failed it: nothing billed
        deadline = time.monotonic() + 3.0
        while _level(redis_server, "tpm") > 6000 - 2 * charged - 500:
            assert time.monotonic() < deadline, "the late settle never reached Redis"
            await asyncio.sleep(0.05)
        await a.stop()
        await asyncio.sleep(0.2)
        # 6000 - 1,400 used (+ 100 a second refilled): not charged twice by the exit
        assert _level(redis_server, "tpm") == pytest.approx(4600, abs=400)
    finally:
        await a.stop()


# -- the must-show: two real gateways, one Redis --------------------------------------------

QUOTA_TOKENS = 2000  # ~37 requests of 54 tokens
POLICY = """
tenants:
  - {{name: metered, apiKeys: [sk-metered], priority: 1, tokensPerMinute: {tpm}}}
  - {{name: midway, apiKeys: [sk-midway], priority: 1, tokensPerMinute: {tpm}}}
  - {{name: roomy, apiKeys: [sk-roomy], priority: 1, tokensPerMinute: 100000000}}
admin: {{apiKeys: [sk-demo-admin]}}
redis: {{url: "{url}"}}
"""
# A prompt of token ids: the gateway's estimate is exact, so what is measured is the
# sharing of the quota, not the prompt estimator (a text prompt's estimate is settled
# against the real usage when the request ends).
BODY = {"model": "sluice-sim", "max_tokens": 40, "ignore_eos": True, "prompt": list(range(14))}
COMPLETIONS = "/v1/completions"
# What the gateways hold a tenant to, as a ratio of the token bucket's allowance over the
# time measured (N, plus N/60 a second). With Redis: the 5 %. With the processes
# holding their shares apart (after a loss, and back): each process's share follows the
# traffic it saw before the loss, so a share can be off by what the traffic's split moved
# meanwhile; under by at most what two local buckets can hold back for being less than one
# request (54 tokens each, 5.4 % of N). Measured in 26 runs: 0.977-0.991 with Redis,
# 0.965-0.997 apart in 25, 1.056 once (a CI run): the bound apart is 10 % (2N would be 2.0).
REDIS_BOUND = (0.95, 1.05)
LOCAL_BOUND = (0.93, 1.10)


class Load:
    """Tokens a tenant was admitted through the gateways, and the outcomes."""

    def __init__(self) -> None:
        self.outcomes: Counter[str] = Counter()
        self.used: list[int] = []
        self.refusals: list[httpx.Response] = []

    @property
    def admitted(self) -> int:
        return sum(self.used)


async def _hammer(
    urls: list[str],
    key: str,
    per_gateway: int,
    *,
    refusals_each: int = 0,
    tokens: int = 0,
    within: float = 30.0,
) -> Load:
    """`per_gateway` client loops on each gateway until every gateway has refused
    `refusals_each` requests for the quota (the quota is used up everywhere), or until
    `tokens` were admitted in all."""
    load = Load()
    started = time.monotonic()

    def enough() -> bool:
        if tokens:
            return load.admitted >= tokens
        return all(load.outcomes[f"{u} 429:tenant_quota"] >= refusals_each for u in urls)

    async def loop(client: httpx.AsyncClient, url: str) -> None:
        while not enough():
            assert time.monotonic() - started < within, f"quota never used up: {load.outcomes}"
            r = await client.post(
                url + COMPLETIONS, json=BODY, headers={"Authorization": f"Bearer {key}"}
            )
            if r.status_code == 200:
                usage = r.json()["usage"]
                load.used.append(usage["prompt_tokens"] + usage["completion_tokens"])
                load.outcomes[url + " ok"] += 1
            else:
                load.outcomes[f"{url} {r.status_code}:{r.json()['error']['code']}"] += 1
                load.refusals.append(r)
                await asyncio.sleep(0.02)  # a client that ignores Retry-After, but not a spin

    async with httpx.AsyncClient(timeout=30) as client:
        await asyncio.gather(*(loop(client, u) for u in urls for _ in range(per_gateway)))
    return load


def _ratio(admitted: int, since: float) -> float:
    """Admitted tokens over what a full bucket allows from `since` to now."""
    return admitted / (QUOTA_TOKENS * (1 + (time.monotonic() - since) / 60))


def _mode(gw: GatewayProcess) -> dict[str, float]:
    m = gw.metrics()
    return {
        mode: m.get(f'sluice_quota_backend{{mode="{mode}"}}', -1.0) for mode in ("redis", "local")
    }


async def _roomy_requests(urls: list[str], n: int) -> list[tuple[int, float]]:
    """n requests of the `roomy` tenant (it has a quota, so each is checked) through
    each gateway: (status, seconds) of each."""
    async with httpx.AsyncClient(timeout=10) as client:

        async def one(url: str) -> tuple[int, float]:
            t0 = time.monotonic()
            r = await client.post(
                url + COMPLETIONS, json=BODY, headers={"Authorization": "Bearer sk-roomy"}
            )
            return r.status_code, time.monotonic() - t0

        return list(await asyncio.gather(*(one(u) for u in urls for _ in range(n))))


async def test_two_gateways_share_one_quota_and_survive_losing_redis(
    sim_factory: SimFactory, redis_server: RedisServer
) -> None:
    sim = sim_factory("--profile", "tiny", "--speed", "4")
    policy = POLICY.format(tpm=QUOTA_TOKENS, url=redis_server.url)
    gateways = [start_gateway([sim.url], policy) for _ in range(2)]
    urls = [g.url for g in gateways]
    ratios: dict[str, float] = {}
    try:
        assert all(_mode(g) == {"redis": 1.0, "local": 0.0} for g in gateways)

        # Redis holds the quota: used up through both gateways, N in all (not 2N)
        metered_since = time.monotonic()
        metered = await _hammer(urls, "sk-metered", 4, refusals_each=20)
        ratios["redis"] = _ratio(metered.admitted, metered_since)
        for url in urls:  # both gateways took part, in admissions and in refusals
            assert metered.outcomes[url + " ok"] > 0
            assert metered.outcomes[url + " 429:tenant_quota"] > 0
        for r in metered.refusals:
            assert r.status_code == 429 and r.json()["error"]["code"] == "tenant_quota"
            assert int(r.headers["Retry-After"]) >= 1
            assert 0 < int(r.headers["retry-after-ms"]) <= 60_000
        # a second tenant uses half of its quota before Redis dies
        midway_since = time.monotonic()
        midway = await _hammer(urls, "sk-midway", 4, tokens=QUOTA_TOKENS // 2)

        # Redis dies: both gateways keep serving, without stalls, on local quotas
        before = await _roomy_requests(urls, 5)
        assert [s for s, _ in before] == [200] * 10
        redis_server.kill()
        during = await _roomy_requests(urls, 10)
        print(f"without Redis: slowest answer {max(t for _, t in during):.3f}s")
        assert [s for s, _ in during] == [200] * 20
        assert max(t for _, t in during) < 2.0
        for g in gateways:
            assert _mode(g) == {"redis": 0.0, "local": 1.0}
            assert g.metrics()["sluice_quota_redis_errors_total"] >= 1
            assert g.proc.poll() is None
        # Each gateway now holds its share of what was left of each quota: the half of
        # `midway` still unused (not a whole quota each, nor one more in all) ...
        rest = await _hammer(urls, "sk-midway", 4, refusals_each=10)
        assert all(rest.outcomes[u + " ok"] > 0 for u in urls)  # fail open, not closed
        ratios["midway, Redis lost halfway"] = _ratio(midway.admitted + rest.admitted, midway_since)
        # ... and of `metered`, used up before the loss: only what refilled since
        more = await _hammer(urls, "sk-metered", 4, refusals_each=10)
        local_metered = more.admitted

        # Redis is back (empty: a restart): the gateways find it within a few probes and
        # charge it what they admitted meanwhile, so `metered` is not handed out again
        redis_server.start()
        deadline = time.monotonic() + 5.0
        while not all(_mode(g)["redis"] == 1.0 for g in gateways):
            assert time.monotonic() < deadline, "the gateways never went back to Redis"
            await asyncio.sleep(0.1)
        after = await _roomy_requests(urls, 5)
        assert [s for s, _ in after] == [200] * 10
        back = await _hammer(urls, "sk-metered", 4, refusals_each=10)
        total = metered.admitted + local_metered + back.admitted
        ratios["metered, lost and back"] = _ratio(total, metered_since)
        print(
            f"metered: {metered.admitted} with Redis, {local_metered} without, "
            f"{back.admitted} after; midway: {midway.admitted} with Redis, "
            f"{rest.admitted} without"
        )
        print("ratios to the allowance:", {k: round(v, 3) for k, v in ratios.items()})
        low, high = REDIS_BOUND
        assert low <= ratios["redis"] <= high
        low, high = LOCAL_BOUND
        assert low <= ratios["midway, Redis lost halfway"] <= high
        assert low <= ratios["metered, lost and back"] <= high
    finally:
        for g in gateways:
            g.stop()
    for g in gateways:
        text = "\n".join(g.output)
        # logged on each change, not per request (a loaded machine may add a short flap)
        assert 1 <= text.count("is not answering") <= 3, text[-3000:]
        assert text.count("answers again") >= 1


async def test_a_hanging_redis_costs_a_gateway_a_stall_not_a_timeout_per_request(
    sim_factory: SimFactory, redis_server: RedisServer
) -> None:
    """Redis stopped (SIGSTOP: connections open, nothing answered). Before, each request
    of a tenant with a quota waited the call's timeout (1 s) and went on unchecked until
    three timeouts and a failed probe made the gateway local: five requests one after
    the other took 3 s more than with Redis. Now the first waits for a stall (0.25 s),
    the others not at all; once Redis answers again, quotas are shared again."""
    sim = sim_factory("--profile", "tiny", "--speed", "4")
    gateway = start_gateway([sim.url], POLICY.format(tpm=QUOTA_TOKENS, url=redis_server.url))

    async def one_by_one(client: httpx.AsyncClient, n: int) -> float:
        started = time.monotonic()
        for _ in range(n):
            r = await client.post(
                gateway.url + COMPLETIONS, json=BODY, headers={"Authorization": "Bearer sk-roomy"}
            )
            assert r.status_code == 200, r.text
        return time.monotonic() - started

    try:
        async with httpx.AsyncClient(timeout=10) as client:
            await one_by_one(client, 2)  # warm
            with_redis = await one_by_one(client, 5)
            redis_server.pause()
            paused = time.monotonic()
            hanging = await one_by_one(client, 5)
            print(f"5 requests: {with_redis:.3f}s with Redis, {hanging:.3f}s while it hangs")
            assert hanging - with_redis < 1.0  # before: >= 3 s (three timeouts of 1 s)
            assert _mode(gateway) == {"redis": 0.0, "local": 1.0}
            while time.monotonic() - paused < 1.5:  # hung past the probe's timeout: lost
                await one_by_one(client, 1)
            redis_server.unpause()
            deadline = time.monotonic() + 5.0
            while _mode(gateway)["redis"] != 1.0:
                assert time.monotonic() < deadline, "the gateway never went back to Redis"
                await asyncio.sleep(0.1)
    finally:
        redis_server.unpause()
        gateway.stop()
    text = "\n".join(gateway.output)
    print("\n".join(line for line in gateway.output if "Redis" in line))
    assert "is slow" in text and "is not answering" in text and "answers again" in text
