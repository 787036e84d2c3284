"""The discrete-event harness on tiny cases with exact expectations: it must report what
the engine and the controller really did, or every benchmark built on it lies."""

from __future__ import annotations

import math

import pytest

from sluice.bench.arms import arm_spec, fifo_policy, fixed, sluice_policy
from sluice.bench.harness import (
    CANCELLED,
    FAILED,
    OK,
    REJECTED,
    SCRAPE_INTERVAL_S,
    TIMEOUT,
    ArmSpec,
    run_arm,
)
from sluice.bench.metrics import arm_results, backend_running
from sluice.bench.scenario import Retry, Scenario, parse_scenario
from sluice.bench.workload import ClientRequest
from sluice.core.limiters import LimiterBase
from sluice.core.types import BackendMetrics
from sluice.sim.engine import Engine, EngineRequest
from sluice.sim.profiles import TINY


def scenario(backends: int = 1, extra: str = "") -> Scenario:
    return parse_scenario(
        f"""
name: t
backends: {{count: {backends}, profile: tiny}}
phases:
  - name: a
    duration: 1s
    rateRps: 1
    mix: {{P0: 1}}
    prompt: 100
    output: 10
    maxTokens: 512
drain: 30s
{extra}
"""
    )


def req(
    i: int,
    at: float,
    *,
    prompt: int = 100,
    out: int = 10,
    priority: int = 0,
    deadline: float | None = None,
    cancel_after: int | None = None,
    retry: Retry | None = None,
) -> ClientRequest:
    return ClientRequest(
        index=i,
        request_id=f"r{i}",
        arrival=at,
        phase=0,
        priority=priority,
        tenant=("chat-app", "agents", "batch-etl")[priority],
        weight=1.0,
        prompt_tokens=prompt,
        max_tokens=512,
        output_tokens=out,
        cancel_after=cancel_after,
        deadline=deadline,
        retry=retry or Retry(),
    )


def engine_alone(prompt: int, out: int, at: float) -> tuple[float, float]:
    """(TTFT, finish time) of one request on an engine driven by hand."""
    e = Engine(TINY)
    e.submit(EngineRequest("x", prompt, 512, out), at)
    t = at
    stats = []
    while e.has_work():
        r = e.step(t)
        t = r.end
        stats += r.finished
    return stats[0].ttft, stats[0].finished  # type: ignore[return-value]


def test_one_request_direct_gets_the_engines_own_ttft() -> None:
    s = scenario()
    run = run_arm(s, [req(0, 0.3)], ArmSpec("direct"), TINY)
    r = run.requests[0]
    ttft, finished = engine_alone(100, 10, 0.3)
    assert r.outcome == OK and r.tokens == 10
    assert r.first_token_at is not None and r.end_at is not None
    assert math.isclose(r.first_token_at - 0.3, ttft, abs_tol=1e-12)
    assert math.isclose(r.end_at, finished, abs_tol=1e-12)
    res = arm_results(run, s)
    assert res["classes"]["P0"]["completed"] == 1
    assert math.isclose(res["classes"]["P0"]["ttft_p50_s"], round(ttft, 4))
    assert res["classes"]["P0"]["slo_attainment"] == 1.0
    assert res["wasted_tokens"] == 0 and res["backend_preemptions"] == 0


def test_tokens_delivered_count_only_what_ended_within_the_window() -> None:
    """Real mode runs a gateway arm past the drain (until its last Retry-After has come
    back) and every arm until its requests settle; what ends after the window (arrivals
    plus drain, 31 s here) is counted apart, so arms and modes compare the same time."""
    s = scenario()
    run = run_arm(s, [req(0, 0.3), req(1, 0.6)], ArmSpec("direct"), TINY)
    assert [r.tokens for r in run.requests] == [10, 10]
    assert run.requests[0].end_at is not None and run.requests[0].end_at < 31.0
    run.requests[1].end_at = 31.5  # as a real run that went on after the drain
    res = arm_results(run, s)
    assert res["tokens_delivered"] == 10
    assert res["tokens_delivered_after_window"] == 10
    assert res["classes"]["P0"]["completed"] == 2
    run.requests[1].end_at = 31.0  # at the window's end: within it
    assert arm_results(run, s)["tokens_delivered"] == 20


def test_one_request_through_the_gateway_adds_no_time() -> None:
    s = scenario()
    arm = arm_spec("sluice", s, max_limit=TINY.max_num_seqs, static_cap=8)
    run = run_arm(s, [req(0, 0.3)], arm, TINY)
    ttft, finished = engine_alone(100, 10, 0.3)
    r = run.requests[0]
    assert r.outcome == OK
    assert math.isclose(r.first_token_at - 0.3, ttft, abs_tol=1e-12)  # type: ignore[operator]
    assert math.isclose(r.end_at, finished, abs_tol=1e-12)  # type: ignore[arg-type]
    assert run.controller_snapshot is not None
    assert run.controller_snapshot.classes["P0"].finished == {"ok": 1}


def test_cancel_after_n_tokens_stops_the_engine_at_once() -> None:
    s = scenario()
    run = run_arm(s, [req(0, 0.0, out=50, cancel_after=5)], ArmSpec("direct"), TINY)
    r = run.requests[0]
    assert r.outcome == CANCELLED and r.tokens == 5
    assert run.wasted_after_gone == 0  # the abort lands before the next step
    res = arm_results(run, s)
    assert res["classes"]["P0"]["completed"] == 1
    assert res["classes"]["P0"]["cancelled_by_client"] == 1
    assert res["goodput_tokens_per_s"] == 5.0  # 5 tokens over the 1 s of arrivals


def test_deadline_abandons_the_answer_and_counts_it_as_waste() -> None:
    s = scenario()
    run = run_arm(s, [req(0, 0.0, out=400, deadline=0.5)], ArmSpec("direct"), TINY)
    r = run.requests[0]
    assert r.outcome == TIMEOUT and r.end_at == 0.5
    assert 0 < r.wasted < 400
    # at most the step that was running when the client left produces one more token
    assert run.wasted_after_gone <= 1
    res = arm_results(run, s)
    assert res["wasted_tokens"] == r.wasted + run.wasted_after_gone
    assert res["classes"]["P0"]["timed_out"] == 1
    assert res["classes"]["P0"]["slo_attainment"] == 0.0


def _one_slot_no_queue(s: Scenario) -> ArmSpec:
    policy = fifo_policy(s, 64, **fixed(1, 64))
    queues = list(policy.queues)
    queues[0] = queues[0].model_copy(update={"max_queue_size": 0})
    return ArmSpec("one-slot", policy.model_copy(update={"queues": tuple(queues)}), True)


def test_refused_client_comes_back_exactly_at_retry_after_without_jitter() -> None:
    s = scenario()
    retry = Retry(max_attempts=2, spread=0.0)
    workload = [req(0, 0.0, out=200), req(1, 0.001, retry=retry)]
    run = run_arm(s, workload, _one_slot_no_queue(s), TINY)
    first, second = run.requests
    assert first.outcome == OK
    assert second.retried_at is not None and len(second.retried_at) == 1
    back_at, why, advised = second.retried_at[0]
    assert why == REJECTED and advised is not None and advised > 0
    assert back_at == 0.001 + advised  # exactly: no jitter
    assert run.rejections["P0"] == {"queue_full": 1} or second.outcome == REJECTED
    assert run.retry_after_retries == 1
    assert run.retry_after_admitted == (1 if second.outcome == OK else 0)


def test_refused_client_with_sdk_jitter_comes_back_later_but_within_the_spread() -> None:
    s = scenario()
    retry = Retry(max_attempts=2, spread=0.5)
    run = run_arm(
        s, [req(0, 0.0, out=200), req(1, 0.001, retry=retry)], _one_slot_no_queue(s), TINY
    )
    back_at, _, advised = run.requests[1].retried_at[0]  # type: ignore[index]
    assert advised is not None
    assert 0.001 + advised <= back_at <= 0.001 + 1.5 * advised


def test_client_without_retries_is_rejected_for_good() -> None:
    s = scenario()
    run = run_arm(s, [req(0, 0.0, out=200), req(1, 0.001)], _one_slot_no_queue(s), TINY)
    assert run.requests[1].outcome == REJECTED
    res = arm_results(run, s)
    assert res["classes"]["P0"]["rejected"] == 1
    assert res["classes"]["P0"]["slo_attainment"] == 0.5  # of the OFFERED requests
    assert res["rejections_by_cause"] == {"queue_full": 1}
    assert res["refusal_order"] == "P0<[P2]<[P1]"


def test_backend_failure_cuts_its_requests_and_the_client_retries_elsewhere() -> None:
    s = scenario(2, "events:\n  - {at: 0.1s, action: fail, backend: 1}\n")
    retry = Retry(max_attempts=2, spread=0.0, backoff=0.2)
    workload = [req(0, 0.0, out=300), req(1, 0.0, out=300, retry=retry), req(2, 0.01, out=300)]
    run = run_arm(s, workload, ArmSpec("direct"), TINY)
    a, b, c = run.requests
    assert a.outcome == OK and a.backend == 0
    # b was on backend 1 when it died; its retry goes round robin to backend 1 again
    # (dead: connection refused) and, with no attempt left, fails
    assert b.retried_at is not None and b.retried_at[0][1] == FAILED
    assert b.outcome == FAILED and b.wasted > 0
    assert c.outcome == OK and c.backend == 0


def test_gateway_takes_a_dead_backend_out_and_serves_from_the_other() -> None:
    s = scenario(2, "events:\n  - {at: 0.1s, action: fail, backend: 1}\n")
    arm = arm_spec("sluice", s, max_limit=64, static_cap=8)
    retry = Retry(max_attempts=3, spread=0.0, backoff=0.2)
    workload = [req(i, 0.0 + 0.3 * i, out=100, retry=retry) for i in range(8)]
    run = run_arm(s, workload, arm, TINY)
    assert all(r.outcome == OK for r in run.requests)
    assert all(r.backend == 0 for r in run.requests if r.spec.arrival > 2.5)
    assert run.controller_snapshot is not None
    assert run.controller_snapshot.backends["b1"].healthy is False


def test_overload_direct_preempts_and_a_small_fixed_cap_does_not() -> None:
    s = scenario()
    workload = [req(i, 0.001 * i, prompt=200, out=200) for i in range(40)]
    direct = arm_results(run_arm(s, workload, ArmSpec("direct"), TINY), s)
    assert direct["backend_preemptions"] > 0
    assert direct["wasted_breakdown"]["recomputed_after_preemption"] > 0
    capped = arm_spec("static", s, max_limit=64, static_cap=4)
    static = arm_results(run_arm(s, workload, capped, TINY), s)
    assert static["backend_preemptions"] == 0
    assert static["classes"]["P0"]["completed"] == 40


def test_runs_are_deterministic() -> None:
    s = scenario()
    workload = [req(i, 0.01 * i, prompt=150, out=40 + i) for i in range(30)]
    arm = arm_spec("sluice", s, max_limit=64, static_cap=8)
    a = arm_results(run_arm(s, workload, arm, TINY), s)
    b = arm_results(run_arm(s, workload, arm, TINY), s)
    for res in (a, b):
        res.pop("wall_s")
    assert a == b


class _CutOnWaiting(LimiterBase):
    """Halves its limit on the first scrape that shows the engine queueing."""

    def __init__(self) -> None:
        self._limit = 64

    @property
    def limit(self) -> int:
        return self._limit

    def on_metrics(self, m: BackendMetrics, now: float) -> None:
        if m.waiting:
            self._limit = max(1, self._limit // 2)


def test_reaction_is_measured_from_the_queueing_step_to_the_cut() -> None:
    s = scenario()
    policy = sluice_policy(s, 64)
    arm = ArmSpec(
        "cut-on-waiting",
        policy,
        controller_kwargs={"limiter_factory": lambda context, lp, initial: _CutOnWaiting()},
    )
    # 30 requests of 300 tokens at once: the 4,096-token KV cache holds about 12
    workload = [req(i, 0.01, prompt=300, out=100) for i in range(30)]
    run = run_arm(s, workload, arm, TINY)
    assert run.episodes, "the engine should have queued"
    ep = run.episodes[0]
    assert ep.cut_at is not None
    # the cut comes with the first scrape after the step that left requests waiting
    next_scrape = math.floor(ep.start / SCRAPE_INTERVAL_S + 1) * SCRAPE_INTERVAL_S
    assert math.isclose(ep.cut_at, next_scrape, abs_tol=1e-9)
    res = arm_results(run, s)
    assert res["limit_reaction"]["cut"] >= 1
    assert math.isclose(res["limit_reaction"]["max_s"], round(next_scrape - ep.start, 4))


def test_series_have_one_point_per_scrape() -> None:
    s = scenario()
    arm = arm_spec("sluice", s, max_limit=64, static_cap=8)
    run = run_arm(s, [req(i, 0.1 * i, out=50) for i in range(10)], arm, TINY)
    t = run.series["t"]
    assert t[:3] == [0.0, 0.25, 0.5]  # a gateway scrapes as it starts, then every 0.25 s
    assert len(run.series["limit"][0]) == len(t) == len(run.series["kv_usage"][0])
    assert max(run.series["kv_usage"][0]) > 0
    assert set(run.series["queued"]) == {"P0", "P1", "P2"}


def test_latency_noise_delays_what_the_gateway_and_client_see_not_the_engine() -> None:
    from sluice.bench.noise import Jitter, parse_jitter

    s = scenario()
    arm = arm_spec("sluice", s, max_limit=TINY.max_num_seqs, static_cap=8)
    ttft, finished = engine_alone(100, 10, 0.3)
    # p50 = p99: every step's tokens arrive exactly 10 ms after the step ends
    run = run_arm(s, [req(0, 0.3)], arm, TINY, jitter=Jitter(0.01, 0.01))
    r = run.requests[0]
    assert r.outcome == OK and r.tokens == 10
    assert math.isclose(r.first_token_at - 0.3, ttft + 0.01, abs_tol=1e-12)  # type: ignore[operator]
    assert math.isclose(r.end_at, finished + 0.01, abs_tol=1e-12)  # type: ignore[arg-type]
    # a heavy tail: the deliveries of one backend still arrive in order
    noisy = run_arm(
        s, [req(i, 0.1 * i, out=30) for i in range(6)], arm, TINY, jitter=Jitter(0.002, 0.2)
    )
    assert all(q.outcome == OK and q.tokens == 30 for q in noisy.requests)
    assert parse_jitter("5,120") == Jitter(0.005, 0.12)
    with pytest.raises(ValueError, match="P50_MS,P99_MS"):
        parse_jitter("fast")


def test_a_pooling_request_finishes_when_its_prompt_is_computed() -> None:
    """An embedding through the gateway: no token, its whole time is its TTFT, and the
    core costs it by its prompt alone."""
    s = scenario()
    embedding = req(0, 0.3, prompt=300, out=1)
    embedding.max_tokens = 1
    embedding.pooling = True
    embedding.route = "embeddings"
    arm = arm_spec("sluice", s, max_limit=TINY.max_num_seqs, static_cap=8)
    run = run_arm(s, [embedding], arm, TINY)
    r = run.requests[0]
    e = Engine(TINY)
    e.submit(EngineRequest("x", 300, 1, 1, pooling=True), 0.3)
    done = e.step(0.3).finished[0]
    assert r.outcome == OK and r.tokens == 0
    assert r.first_token_at == r.end_at == done.finished
    assert run.controller_snapshot is not None
    assert run.controller_snapshot.classes["P0"].finished == {"ok": 1}
    res = arm_results(run, s)
    assert res["classes"]["P0"]["completed"] == 1 and res["classes"]["P0"]["slo_attainment"] == 1


def test_a_fleet_scenario_scales_the_gateway_arms_queues() -> None:
    # the default 200 / 500 / 1,000 hold seconds of two backends' capacity
    assert [q.max_queue_size for q in sluice_policy(scenario(), 64).queues] == [200, 500, 1000]
    fleet = scenario(backends=32, extra="queueScale: 16")
    assert [q.max_queue_size for q in sluice_policy(fleet, 64).queues] == [3200, 8000, 16000]
    assert fifo_policy(fleet, 64).queues[0].max_queue_size == 16 * 1700


def test_backend_running_is_the_mean_over_a_window_of_the_samples() -> None:
    # two engines sampled at 0, 1, 2, 3 s
    series = {"t": [0.0, 1.0, 2.0, 3.0], "running": [[1, 2, 3, 4], [5, 6, 7, 8]]}
    assert backend_running(series, 4.0) == {"mean": 4.5, "max": 8}
    # a phase from 1 s to before 3 s: the samples at 1 and 2 s of both
    assert backend_running(series, 3.0, 1.0) == {"mean": 4.5, "max": 7}
    assert backend_running(series, 2.0, 1.0) == {"mean": 4.0, "max": 6}
    assert backend_running(series, 9.0, 5.0) == {"mean": None, "max": None}
