"""The bench's model of Redis for shared tenant quotas (bench/quota_store.py): each method
as its Lua script (src/sluice/gateway/lua/) answers, with exact values at given times;
outages, a restart that loses the data, round trips."""

from __future__ import annotations

import math
import random

import pytest

from sluice.bench.noise import Jitter
from sluice.bench.quota_store import Outage, QuotaStore, Sight, StoreSpec

TAU = 30.0


def _acquire(store: QuotaStore, now: float, tokens: int, process: str = "a", **over: int):  # type: ignore[no-untyped-def]
    limits = {"rpm": 60, "tpm": 600, "max_concurrency": 0, **over}
    return store.acquire(
        now,
        "t",
        tokens=tokens,
        process=process,
        stale_s=10.0,
        concurrency_retry_s=1.0,
        tau_s=TAU,
        **limits,
    )


def test_acquire_charges_both_buckets_and_refuses_with_the_refill_time() -> None:
    store = QuotaStore()
    a = _acquire(store, 0.0, 500)
    assert a.ok and a.retry_after_s == 0.0
    assert a.sight == Sight(59.0, 100.0, 1.0)  # a request and 500 tokens gone; all demand a's
    b = _acquire(store, 0.0, 200)
    assert not b.ok and b.retry_after_s == 10.0  # 100 tokens missing at 10 per second
    assert b.sight.tokens_level == 100.0  # nothing charged
    c = _acquire(store, 10.0, 200)  # refilled to 200 tokens by then, and to 60 requests
    assert c.ok and c.sight == Sight(59.0, 0.0, 1.0)


def test_a_charge_is_at_most_a_full_bucket_and_the_retry_is_formatted_as_the_script() -> None:
    store = QuotaStore()
    assert _acquire(store, 0.0, 10**9).sight.tokens_level == 0.0  # charged 600, not 1e9
    d = _acquire(store, 0.0, 7)
    assert not d.ok and d.retry_after_s == 0.7
    d = _acquire(store, 1 / 3, 7)  # 3.333... tokens refilled: 0.3666... s, as '%.6f'
    assert d.retry_after_s == 0.366667


def test_requests_per_minute_alone() -> None:
    store = QuotaStore()
    assert _acquire(store, 0.0, 10, rpm=2, tpm=0).sight == Sight(1.0, None, 1.0)
    assert _acquire(store, 0.0, 10, rpm=2, tpm=0).ok
    d = _acquire(store, 0.0, 10, rpm=2, tpm=0)
    assert not d.ok and d.retry_after_s == 30.0


def test_finish_gives_back_settles_and_never_lets_a_level_below_minus_a_bucket() -> None:
    store = QuotaStore()
    _acquire(store, 0.0, 500)
    # never ran: the request and its tokens back
    assert store.finish(
        0.0, "t", rpm=60, tpm=600, requests_back=1, tokens_back=500, releases=1, process="a"
    ) == (60.0, 600.0)
    _acquire(store, 0.0, 500)
    # it used 2,000 tokens: 1,500 more; the bucket stops at -600, 800 forgiven
    assert store.finish(
        0.0, "t", rpm=60, tpm=600, requests_back=0, tokens_back=-1500, releases=1, process="a"
    ) == (59.0, -600.0)
    assert store.forgiven == {("t", "tokens"): 800.0}
    assert store.levels(60.0, "t", 60, 600) == (60.0, 0.0)  # a minute refills one bucket


def test_the_hand_back_has_no_floor_and_no_call_forgives_a_debt() -> None:
    store = QuotaStore()
    store.resume(0.0, "t", rpm=60, tpm=600, requests_used=0, tokens_used=1500,
                 requests_level=-1, tokens_level=-1)  # fmt: skip
    assert store.levels(0.0, "t", 60, 600) == (60.0, -900.0)  # before: -600, 300 forgiven
    # 10 tokens back: -890, not lifted to the floor; a usage 100 past its charge stops at
    # the level it found (a report costs at most a minute of debt), deeper ones too
    assert store.finish(
        0.0, "t", rpm=60, tpm=600, requests_back=0, tokens_back=10, releases=0, process="a"
    ) == (60.0, -890.0)
    assert store.finish(
        0.0, "t", rpm=60, tpm=600, requests_back=0, tokens_back=-100, releases=0, process="a"
    ) == (60.0, -890.0)
    assert store.forgiven == {("t", "tokens"): 100.0}
    assert store.levels(89.0, "t", 60, 600) == (60.0, 0.0)  # 890 refilled at 10 a second


def test_a_full_bucket_is_no_key_and_a_key_expires_a_second_after_it_would_be_full() -> None:
    store = QuotaStore()
    _acquire(store, 0.0, 60)  # 60 tokens: full again after 6 s, the key gone after 7 s
    store.resume(6.5, "t", rpm=60, tpm=600, requests_used=0, tokens_used=0,
                 requests_level=5, tokens_level=5)  # fmt: skip
    assert store.levels(6.5, "t", 60, 600) == (60.0, 600.0)  # the key was there: no restore
    _acquire(store, 10.0, 60)
    store.resume(18.0, "t", rpm=60, tpm=600, requests_used=0, tokens_used=0,
                 requests_level=5, tokens_level=5)  # fmt: skip
    assert store.levels(18.0, "t", 60, 600) == (5.0, 5.0)  # expired at 17 s: restored


def test_resume_charges_what_was_used_and_restores_lost_levels_first() -> None:
    store = QuotaStore(outages=[Outage(10.0, 20.0, wiped=True)])
    _acquire(store, 0.0, 300)
    with pytest.raises(RuntimeError, match="does not answer"):
        _acquire(store, 15.0, 1)
    assert store.failure(15.0) == "refused" and store.failure(20.0) is None
    assert store.levels(20.0, "t", 60, 600) == (60.0, 600.0)  # back empty
    store.resume(20.0, "t", rpm=60, tpm=600, requests_used=3, tokens_used=250,
                 requests_level=40.5, tokens_level=450.0)  # fmt: skip
    assert store.levels(20.0, "t", 60, 600) == (37.5, 200.0)
    # a second process's hand-back finds the key: its estimate is not applied
    store.resume(20.0, "t", rpm=60, tpm=600, requests_used=1, tokens_used=100,
                 requests_level=60.0, tokens_level=600.0)  # fmt: skip
    assert store.levels(20.0, "t", 60, 600) == (36.5, 100.0)


def test_an_outage_without_a_wipe_keeps_the_data() -> None:
    store = QuotaStore(outages=[Outage(10.0, 20.0, failure="timeout")])
    _acquire(store, 0.0, 300)
    assert store.failure(10.0) == "timeout"
    assert store.levels(20.0, "t", 60, 600) == (60.0, 500.0)  # refilled meanwhile
    assert store.levels(30.0, "t", 60, 600) == (60.0, 600.0)
    _acquire(store, 30.0, 600)
    assert store.levels(30.0, "t", 60, 600) == (59.0, 0.0)


def test_each_process_part_of_the_demand_decays_and_the_parts_add_up_to_one() -> None:
    store = QuotaStore()
    assert _acquire(store, 0.0, 100, "a", tpm=10**6).sight.part == 1.0
    b = _acquire(store, TAU, 100, "b", tpm=10**6)
    a_part = 100 / math.e  # a's 100 decayed over one tau
    assert b.sight.part == pytest.approx(100 / (a_part + 100))
    a = store.sight(TAU, "t", rpm=60, tpm=10**6, process="a", tau_s=TAU)
    assert a.part is not None and b.sight.part is not None
    assert a.part + b.sight.part == pytest.approx(1.0)
    # a process that asked for nothing has no part; a refused request is demand too
    assert store.sight(TAU, "t", rpm=60, tpm=10**6, process="c", tau_s=TAU).part == 0.0
    assert _acquire(store, TAU, 600, "c", rpm=60, tpm=600).ok
    assert not _acquire(store, TAU, 600, "c", rpm=60, tpm=600).ok
    assert store.sight(TAU, "t", rpm=60, tpm=600, process="c", tau_s=TAU).part == pytest.approx(
        1200 / (a_part + 100 + 1200)
    )


def test_max_concurrency_counts_every_process_and_forgets_a_silent_one() -> None:
    store = QuotaStore()
    assert _acquire(store, 0.0, 1, "a", max_concurrency=2).ok
    assert _acquire(store, 0.0, 1, "b", max_concurrency=2).ok
    d = _acquire(store, 1.0, 1, "a", max_concurrency=2)
    assert not d.ok and d.retry_after_s == 1.0
    store.finish(1.0, "t", rpm=60, tpm=600, requests_back=0, tokens_back=0, releases=1,
                 process="b")  # fmt: skip
    assert store.open_requests("t") == 1
    assert _acquire(store, 1.0, 1, "a", max_concurrency=2).ok
    store.heartbeat(2.0, "t", process="b", open_requests=1)
    assert store.open_requests("t") == 3
    assert not _acquire(store, 12.0, 1, "a", max_concurrency=3).ok  # b beat 10 s ago
    assert _acquire(store, 12.5, 1, "a", max_concurrency=3).ok  # b silent > 10 s: gone
    assert store.open_requests("t") == 3  # a's three


def test_the_live_processes_are_those_seen_within_the_stale_time() -> None:
    store = QuotaStore()
    assert store.processes(0.0, process="a", stale_s=10.0) == 1
    assert store.processes(5.0, process="b", stale_s=10.0) == 2
    assert store.processes(10.0, process="b", stale_s=10.0) == 1  # a at 0: stale at 10
    store.leave(11.0, "b")
    assert store.processes(12.0, process="c", stale_s=10.0) == 1


def test_round_trips_fixed_or_drawn_and_outages_checked() -> None:
    rng = random.Random(1)
    assert QuotaStore(round_trip_s=0.002).round_trip(rng) == 0.002
    drawn = StoreSpec(round_trip=Jitter(0.0005, 0.002)).build()
    draws = [drawn.round_trip(rng) for _ in range(1000)]
    assert 0.0004 < sorted(draws)[500] < 0.0006 and max(draws) < 0.01
    with pytest.raises(ValueError, match="overlap"):
        QuotaStore(outages=[Outage(1.0, 5.0), Outage(4.0, 6.0)])
    with pytest.raises(ValueError, match="at < back"):
        Outage(5.0, 5.0)


SCENARIO = """
name: quotas-small
backends: {count: 2, profile: tiny}
tenants:
  - {name: a, priority: 1, tokensPerMinute: 1000, requestsPerMinute: 10, maxConcurrency: 2}
  - {name: b, priority: 1}
phases:
  - {name: p, duration: 2s, rate: 0.5, mix: {P1: 1}, prompt: 10, output: 5, maxTokens: 5}
fleet:
  replicas: 2
  quotaStore:
    roundTrip: {p50: 1ms, p99: 4ms}
    outages: [{at: 1s, back: 1500ms, wiped: true}, {at: 2s, back: 3s, failure: timeout}]
"""


def test_a_scenario_gives_the_fleet_its_store_and_the_policies_their_quotas() -> None:
    from sluice.bench.arms import arm_spec
    from sluice.bench.fleet import fleet_arm
    from sluice.bench.scenario import parse_scenario

    scenario = parse_scenario(SCENARIO)
    fleet = scenario.spec.fleet
    sluice = fleet_arm(arm_spec("sluice", scenario, max_limit=8, static_cap=0), fleet)
    assert sluice.fleet is not None and sluice.fleet.quota_store == StoreSpec(
        round_trip_s=0.001,
        round_trip=Jitter(0.001, 0.004),
        outages=(Outage(1.0, 1.5, wiped=True), Outage(2.0, 3.0, failure="timeout")),
    )
    one = fleet_arm(arm_spec("one-gateway", scenario, max_limit=8, static_cap=0), fleet)
    assert one.fleet is not None and one.fleet.quota_store is None  # in process: exact
    assert sluice.policy is not None
    tenants = sluice.policy.core_settings().tenants
    assert [(t.name, t.tokens_per_minute, t.requests_per_minute, t.max_concurrency)
            for t in tenants] == [("a", 1000, 10, 2), ("b", 0, 0, 0)]  # fmt: skip


def test_overlapping_outages_are_refused_with_their_field() -> None:
    from sluice.bench.scenario import ScenarioError, parse_scenario

    with pytest.raises(ScenarioError) as err:
        parse_scenario(SCENARIO.replace("at: 2s", "at: 1200ms"))
    assert err.value.errors == ["fleet.quotaStore: outages must not overlap"]
