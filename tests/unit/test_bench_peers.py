"""The peer arms decide as the peers' own code does (issue 16): exact values on a fake
clock, one behaviour per test, each from the source file its module cites."""

from __future__ import annotations

import math

import pytest

from sluice.bench.harness import ArmSpec, run_arm
from sluice.bench.peers import OPENAI_SDK_RETRY, peer_arm
from sluice.bench.peers.base import PeerBackend, PeerCode
from sluice.bench.peers.envoy import EnvoyGateway
from sluice.bench.peers.gie import GieGateway
from sluice.bench.peers.litellm import LiteLLMGateway
from sluice.bench.scenario import Retry, parse_scenario
from sluice.bench.workload import ClientRequest, retry_delay, unit_hash
from sluice.core.clock import FakeClock
from sluice.core.types import BackendMetrics, Outcome, RequestInfo
from sluice.sim.profiles import TINY


def info(rid: str, priority: int = 0) -> RequestInfo:
    return RequestInfo(rid, "t", priority, "sim", prompt_tokens=100, max_tokens=50)


def metrics(at: float, waiting: float = 0.0, kv: float = 0.0) -> BackendMetrics:
    return BackendMetrics(at=at, running=1.0, waiting=waiting, kv_usage=kv)


# -- LiteLLM -----------------------------------------------------------------------------


def test_litellm_refuses_over_the_cap_at_once_with_retry_after_60() -> None:
    gw = LiteLLMGateway(FakeClock(), ["b0"], cap=2)
    assert gw.arrive(info("a")).admitted and gw.arrive(info("b")).admitted
    assert [a.backend for a in gw.step().assignments] == ["b0", "b0"]
    refused = gw.arrive(info("c", priority=0))  # P0 or not: the priority is ignored
    assert (refused.admitted, refused.code, refused.retry_after_s) == (
        False,
        PeerCode.LITELLM_PARALLEL,
        60.0,
    )
    gw.on_finish("a", Outcome.OK)
    assert gw.arrive(info("c")).admitted
    assert gw.snapshot().backends["b0"] == PeerBackend(limit=2.0, inflight=2)


def test_litellm_spreads_over_deployments_with_a_free_slot() -> None:
    gw = LiteLLMGateway(FakeClock(), ["b0", "b1"], cap=1)
    gw.set_backend_health("b1", False)
    assert gw.arrive(info("a")).admitted
    assert not gw.arrive(info("b")).admitted  # b1 is down, b0 full
    gw.set_backend_health("b1", True)
    assert gw.arrive(info("b")).admitted
    assert sorted(a.backend for a in gw.step().assignments) == ["b0", "b1"]


# -- GIE / llm-d endpoint picker --------------------------------------------------------------


def test_gie_saturation_is_the_mean_roofline_score_and_stale_counts_as_full() -> None:
    clock = FakeClock()
    gw = GieGateway(clock, ["b0", "b1"])
    assert gw.saturation() == 1.0  # no metrics yet: both endpoints score 1
    gw.on_metrics("b0", metrics(0.0, waiting=2, kv=0.4))  # max(2/5, 0.4/0.8) = 0.5
    gw.on_metrics("b1", metrics(0.0, waiting=5, kv=0.1))  # max(5/5, 0.125) = 1.0
    assert gw.saturation() == pytest.approx(0.75)
    clock.set(0.2)
    assert gw.saturation() == pytest.approx(0.75)  # 200 ms old: still fresh
    clock.set(0.2001)
    assert gw.saturation() == 1.0  # older than 200 ms: saturated


def test_gie_sheds_only_sheddable_requests_while_saturated() -> None:
    gw = GieGateway(FakeClock(), ["b0"])
    gw.on_metrics("b0", metrics(0.0, kv=0.8))  # kv / 0.8 = 1.0: saturated
    shed = gw.arrive(info("p2", priority=2))
    assert (shed.admitted, shed.code, shed.retry_after_s) == (False, PeerCode.GIE_SHED, None)
    assert gw.arrive(info("p0", priority=0)).admitted  # no limit of its own
    assert gw.arrive(info("p1", priority=1)).admitted
    gw.on_metrics("b0", metrics(0.0, kv=0.79))
    assert gw.arrive(info("p2b", priority=2)).admitted
    assert [a.request_id for a in gw.step().assignments] == ["p0", "p1", "p2b"]


def test_gie_picks_the_endpoint_with_the_best_queue_and_kv_scores() -> None:
    gw = GieGateway(FakeClock(), ["b0", "b1"])
    gw.on_metrics("b0", metrics(0.0, waiting=0, kv=0.7))  # 2*1 + 2*0.3 = 2.6
    gw.on_metrics("b1", metrics(0.0, waiting=1, kv=0.1))  # 2*0 + 2*0.9 = 1.8
    gw.arrive(info("a"))
    gw.on_metrics("b0", metrics(0.0, waiting=3, kv=0.5))  # 0 + 1.0
    gw.on_metrics("b1", metrics(0.0, waiting=1, kv=0.6))  # 2 + 0.8
    gw.arrive(info("b"))
    assert [a.backend for a in gw.step().assignments] == ["b0", "b1"]


def test_gie_flow_control_dispatches_by_band_and_stops_while_saturated() -> None:
    clock = FakeClock()
    gw = GieGateway(clock, ["b0"], flow_control=True)
    gw.on_metrics("b0", metrics(0.0, waiting=5))  # saturated
    for rid, prio in (("p2", 2), ("p1", 1), ("p0", 0)):
        assert gw.arrive(info(rid, prio)).admitted  # flow control sheds nobody on arrival
    assert gw.step().assignments == [] and gw.queued() == [1, 1, 1]
    assert gw.step().wake_at is None  # nothing to do until the metrics change
    gw.on_metrics("b0", metrics(0.0, waiting=0))
    # the arrivals' cycles were spent while saturated: now the 1 ms ticker sends one
    # request per tick, the highest band first
    sent = []
    for tick in (0.001, 0.002, 0.003):
        assert gw.step().wake_at == pytest.approx(tick)
        clock.set(tick)
        sent += [a.request_id for a in gw.step().assignments]
    assert sent == ["p0", "p1", "p2"] and gw.step().wake_at is None
    gw.arrive(info("late", 2))  # an arrival runs a cycle at once
    assert [a.request_id for a in gw.step().assignments] == ["late"]


def test_gie_flow_control_sends_one_request_per_tick_and_honours_a_ttl() -> None:
    clock = FakeClock()
    gw = GieGateway(clock, ["b0"], flow_control=True, ttl_s=2.0)
    gw.on_metrics("b0", metrics(0.0, waiting=9))
    for i in range(3):
        gw.arrive(info(f"r{i}", 1))
    assert gw.step().assignments == []
    gw.on_metrics("b0", metrics(0.0, waiting=0))
    clock.set(0.0101)  # arrivals' cycles were spent while saturated: the ticker remains
    assert [a.request_id for a in gw.step().assignments] == ["r0"]
    assert gw.step().wake_at == pytest.approx(0.0111)
    clock.set(0.0111)
    assert [a.request_id for a in gw.step().assignments] == ["r1"]
    gw.on_metrics("b0", metrics(0.0111, waiting=7))
    clock.set(2.0)
    expired = gw.step().rejections
    assert [(e.request_id, e.code, e.retry_after_s) for e in expired] == [
        ("r2", PeerCode.GIE_TTL, None)
    ]


# -- Envoy adaptive concurrency ----------------------------------------------------------------


def test_envoy_starts_pinned_at_3_and_refuses_beyond_with_503() -> None:
    gw = EnvoyGateway(FakeClock(), ["b0"])
    for i in range(3):
        assert gw.arrive(info(f"r{i}")).admitted
    refused = gw.arrive(info("r3"))
    assert (refused.admitted, refused.code, refused.retry_after_s) == (
        False,
        PeerCode.ENVOY_LIMIT,
        None,
    )


def _complete(gw: EnvoyGateway, clock: FakeClock, n: int, latency: float, tag: str) -> None:
    for i in range(n):
        rid = f"{tag}{i}"
        assert gw.arrive(info(rid)).admitted, (rid, gw.concurrency_limit, gw.outstanding)
        clock.advance(latency)
        gw.on_finish(rid, Outcome.OK)


def test_envoy_measures_min_rtt_then_follows_the_gradient() -> None:
    clock = FakeClock()
    gw = EnvoyGateway(clock, ["b0"], seed=1)
    _complete(gw, clock, 49, 0.002, "m")
    assert gw.min_rtt is None
    _complete(gw, clock, 1, 0.004, "n")
    # p50 of 49 x 2 ms and one 4 ms sample; the limit goes back to what it was (3)
    assert gw.min_rtt == pytest.approx(0.002)
    assert gw.concurrency_limit == 3
    # a window whose p50 is the min RTT: gradient = 1.25 / 1 clamped to [0.5, 2];
    # limit = int(3 * 1.25 + sqrt(3 * 1.25)) = int(3.75 + 1.936) = 5
    t0 = clock.now()
    _complete(gw, clock, 3, 0.002, "w")
    clock.set(t0 + 0.1)
    gw.step()  # the sample-window timer runs
    assert gw.concurrency_limit == 5
    # latencies 5 x the min RTT: gradient 0.25 -> 0.5; int(2.5 + sqrt(2.5)) = 4
    _complete(gw, clock, 2, 0.01, "s")
    clock.set(t0 + 0.2)
    gw.step()
    assert gw.concurrency_limit == 4
    # a window without a sample leaves the limit alone
    clock.set(t0 + 0.3)
    gw.step()
    assert gw.concurrency_limit == 4
    assert gw.step().wake_at == pytest.approx(t0 + 0.4)


def test_envoy_drops_samples_of_requests_that_did_not_complete_or_predate_the_window() -> None:
    clock = FakeClock()
    gw = EnvoyGateway(clock, ["b0"])
    gw.arrive(info("old"))
    clock.advance(1.0)
    gw.arrive(info("gone"))
    gw.cancel("gone")  # client left: no sample
    gw.arrive(info("err"))
    gw.on_finish("err", Outcome.ERROR)  # upstream reset: no sample
    gw.on_finish("old", Outcome.OK)
    assert gw.outstanding == 0 and gw._samples == [1.0]
    gw2 = EnvoyGateway(clock, ["b0"], min_rtt_interval_s=5.0, jitter=0.0)
    _complete(gw2, clock, 50, 0.01, "m")
    start = clock.now()
    assert gw2.step().wake_at == pytest.approx(start + 0.1)
    clock.set(start + 5.0)
    gw2.step()  # the next minRTT measurement: pinned to 3 again
    assert gw2.concurrency_limit == 3 and gw2._in_min_rtt


# -- the peers' clients ----------------------------------------------------------------------


def _client(index: int = 4) -> ClientRequest:
    return ClientRequest(index, f"r{index}", 0.0, 0, 1, "t", 1.0, 10, 10, 10, None, None, Retry())


def test_peer_clients_retry_as_the_openai_sdk() -> None:
    c = _client()
    assert retry_delay(c, 0, 60.0, seed=3, retry=OPENAI_SDK_RETRY) == 60.0  # exact, no jitter
    assert retry_delay(c, 0, 120.0, seed=3, retry=OPENAI_SDK_RETRY) == 120.0
    assert retry_delay(c, 0, 121.0, seed=3, retry=OPENAI_SDK_RETRY) is None  # not retried
    u = unit_hash(3, 4, 1)
    assert retry_delay(c, 0, None, seed=3, retry=OPENAI_SDK_RETRY) == pytest.approx(
        0.5 * (1 - 0.25 * u)
    )
    u = unit_hash(3, 4, 6)
    assert retry_delay(c, 5, None, seed=3, retry=OPENAI_SDK_RETRY) == pytest.approx(
        8.0 * (1 - 0.25 * u)
    )
    assert OPENAI_SDK_RETRY.max_attempts == 3 and OPENAI_SDK_RETRY.on_timeout


# -- in the harness ----------------------------------------------------------------------------

FLOOD = """
name: peers
backends: {count: 1, profile: tiny}
clients:
  P0: {deadline: 30s, retry: {maxAttempts: 5}}
phases:
  - name: a
    duration: 4s
    rateRps: 30
    process: uniform
    mix: {P0: 0.2, P1: 0.4, P2: 0.4}
    prompt: 150
    output: 60
    maxTokens: 60
drain: 200s
"""


def test_a_litellm_arm_never_runs_more_than_its_cap_and_its_clients_come_back_in_60_s() -> None:
    from sluice.bench.runner import make_plan

    plan = make_plan(parse_scenario(FLOOD))
    run = run_arm(plan.scenario, plan.workload, peer_arm("litellm", cap=5), TINY, seed=1)
    assert max(max(col) for col in run.series["inflight"]) <= 5
    assert max(max(col) for col in run.series["running"]) <= 5
    assert not run.preemption_times
    comebacks = [
        (back - r.spec.arrival, why, ra)
        for r in run.requests
        for back, why, ra in (r.retried_at or ())
    ]
    assert comebacks and all(ra == 60.0 for _, _, ra in comebacks)
    # 3 attempts at most, whatever the scenario's clients say (maxAttempts 5 for P0)
    assert max(r.attempt for r in run.requests) == 2


def test_a_peer_arm_has_no_sluice_policy() -> None:
    with pytest.raises(ValueError, match="no Sluice policy"):
        ArmSpec("x", policy=object(), gateway=lambda c, b: None)  # type: ignore[arg-type]
    assert not peer_arm("envoy", cap=1).is_direct
    assert math.isclose(peer_arm("gie", cap=1).scrape_interval_s or 0, 0.05)


def test_the_real_mode_proxy_answers_refusals_as_the_peer_does() -> None:
    from sluice.bench.peers.proxy import _refusal

    litellm = _refusal(PeerCode.LITELLM_PARALLEL, 60.0)
    assert (litellm.status, litellm.headers["Retry-After"]) == (429, "60")
    envoy = _refusal(PeerCode.ENVOY_LIMIT, None)
    assert envoy.status == 503 and "Retry-After" not in envoy.headers
    assert b'"code":"concurrency_limit"' in envoy.body  # type: ignore[operator]
