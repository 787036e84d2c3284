"""The `slo` limiter: the p95 of the per-request TPOT kept under the tightest objective of
the classes a backend serves, less the tail margin; exact values on a fake clock."""

from __future__ import annotations

import pytest

from sluice import config
from sluice.config import Policy
from sluice.core.clock import FakeClock
from sluice.core.controller import Controller
from sluice.core.limiters import SloLimiter
from sluice.core.settings import Objective
from sluice.core.types import RequestInfo, Sample

OBJECTIVES = {
    0: Objective(ttft=1.0, tpot=0.1),
    1: Objective(ttft=15.0),
    2: Objective(done_within=60.0),
}
PROMPT = 436  # + the fixed 64 = 500 tokens of prefill work


class InFlight:
    """What the controller hands the limiter: requests in flight by priority."""

    def __init__(self, p0: int = 0, p1: int = 0, p2: int = 0) -> None:
        self.counts = [p0, p1, p2]

    def __call__(self) -> list[int]:
        return self.counts


def limiter(flight: InFlight, initial: int = 20, **kw: object) -> SloLimiter:
    args: dict[str, object] = {"probe_jitter": 0.0, "probe_interval_s": 10.0}
    args.update(kw)
    return SloLimiter(1, 200, initial, objectives=OBJECTIVES, classes_in_flight=flight, **args)  # type: ignore[arg-type]


def end(lim: SloLimiter, tpot: float, now: float, sent_at: float = 0.0) -> None:
    lim.on_sample(
        Sample(
            ttft_s=0.1,
            tpot_s=tpot,
            prompt_tokens=PROMPT,
            completion_tokens=100,
            sent_at=sent_at,
            e2e_s=0.1 + 99 * tpot,
        ),
        now,
    )


def ttft(lim: SloLimiter, seconds: float, now: float) -> None:
    lim.on_sample(Sample(ttft_s=seconds, prompt_tokens=PROMPT, sent_at=now - seconds), now)


def test_the_target_is_the_tightest_objective_being_served_less_the_margin() -> None:
    flight = InFlight(p0=1, p2=5)
    lim = limiter(flight)
    lim.on_dispatch(6, 100, 0.0)  # the events record what is in flight
    assert lim.tpot_objective(0.0) == 0.1
    assert lim.tpot_target(0.0) == pytest.approx(0.09)  # (1 - 0.1) x 100 ms
    # P0 leaves: still served for the hold (10 s), then only lenient classes remain:
    # 2 x the policy's tightest TPOT objective
    flight.counts = [0, 0, 5]
    assert lim.tpot_target(9.9) == pytest.approx(0.09)
    assert lim.tpot_objective(10.1) == pytest.approx(0.2)
    assert lim.tpot_target(10.1) == pytest.approx(0.18)
    assert lim.serving(10.1) == [2]
    flight.counts = [1, 0, 5]  # P0 is back
    assert lim.tpot_target(10.2) == pytest.approx(0.09)


def test_a_p95_over_the_target_cuts_once_there_are_enough_samples() -> None:
    lim = limiter(InFlight(p0=2, p1=10))
    lim.on_dispatch(20, 100, 0.0)
    # seven samples: below min_samples (8), no judgement yet, whatever they say
    for i in range(7):
        end(lim, 0.095, 1.0 + i * 0.01)
    assert lim.limit == 20 and lim.cuts == 0
    # the eighth: p95 of eight = the 8th smallest = 95 ms > 90 ms
    end(lim, 0.05, 1.1)
    assert lim.tpot_p95() == 0.095
    assert lim.limit == 16 and lim.last_cut_reason == "tpot"


def test_a_p95_under_the_target_does_not_cut_although_the_mean_is_far_above_30ms() -> None:
    lim = limiter(InFlight(p0=2))
    lim.on_dispatch(20, 100, 0.0)
    for i in range(40):
        end(lim, 0.06 if i % 10 else 0.089, 1.0 + i * 0.01)
    assert lim.tpot_p95() == 0.089
    assert lim.cuts == 0 and lim.limit == 20  # `sluice` would have cut at a 30 ms mean


def test_after_a_cut_only_requests_sent_under_the_new_limit_are_judged() -> None:
    lim = limiter(InFlight(p0=2))
    lim.on_dispatch(20, 100, 0.0)
    for i in range(8):
        end(lim, 0.12, 1.0 + i * 0.01)
    assert lim.limit == 16
    cut_at = 1.07
    # requests sent before the cut end slow: they describe the old batch, no second cut
    for i in range(20):
        end(lim, 0.12, 2.0 + i * 0.01, sent_at=0.5)
    assert lim.limit == 16 and lim.cuts == 1
    # eight sent after it, all fast: the p95 is theirs (70 ms), and growth is allowed
    for i in range(8):
        end(lim, 0.07, 3.0 + i * 0.01, sent_at=cut_at + 0.1)
    assert lim.tpot_p95() == 0.07 and lim.cuts == 1


def test_growth_waits_for_a_p95_inside_the_band_under_the_target() -> None:
    lim = limiter(InFlight(p0=2), initial=20)
    lim.on_dispatch(20, 100, 0.0)
    ttft(lim, 0.05, 0.05)  # sets the TTFT base
    for i in range(8):
        end(lim, 0.085, 0.1 + i * 0.01)  # p95 85 ms: under 90, above 0.9 x 90 = 81
    ttft(lim, 0.05, 0.3)
    assert lim.latency_limit == 20.0
    for i in range(40):
        end(lim, 0.08, 0.4 + i * 0.001)  # the window now holds 80 ms only
    ttft(lim, 0.05, 0.5)
    assert lim.latency_limit == 21.0  # slow start: +1


def test_with_only_lenient_classes_the_batch_may_run_slower() -> None:
    flight = InFlight(p1=10, p2=10)
    lim = limiter(flight)
    lim.on_dispatch(20, 100, 0.0)
    for i in range(8):
        end(lim, 0.15, 1.0 + i * 0.01)  # 150 ms: under 2 x 100 ms less the margin (180)
    assert lim.cuts == 0
    flight.counts = [1, 10, 10]  # a P0 request arrives
    lim.on_dispatch(21, 100, 1.2)
    end(lim, 0.15, 1.3)
    assert lim.limit == 16 and lim.last_cut_reason == "tpot"


def test_a_policy_without_tpot_objectives_falls_back_to_sluice_target() -> None:
    lim = SloLimiter(1, 200, 20, objectives={0: Objective(ttft=1.0)}, probe_jitter=0.0)
    assert lim.tpot_objective(0.0) is None
    assert lim.tpot_target(0.0) == 0.03


def test_the_controller_tells_the_limiter_which_classes_it_serves() -> None:
    clock = FakeClock()
    policy = Policy.model_validate(
        {
            "tenants": [
                {"name": "p0", "apiKeys": ["k0"], "priority": 0},
                {"name": "p2", "apiKeys": ["k2"], "priority": 2},
            ],
            "limiter": {"algorithm": "slo"},
        }
    )
    ctrl = Controller(policy.core_settings(), clock, ["b0"])
    lim = ctrl._dispatcher.backends["b0"].limiter
    assert isinstance(lim, SloLimiter)
    ctrl.arrive(RequestInfo("r2", "p2", 2, "m", 100, 50))
    ctrl.step()
    assert lim.serving(clock.now()) == [2]
    assert lim.tpot_target(clock.now()) == pytest.approx(0.18)
    ctrl.arrive(RequestInfo("r0", "p0", 0, "m", 100, 50))
    ctrl.step()
    assert lim.serving(clock.now()) == [0, 2]
    assert lim.tpot_target(clock.now()) == pytest.approx(0.09)
    # a reload with a tighter P0 objective reaches the limiter in place
    tighter = policy.model_copy(
        update={
            "queues": tuple(
                q.model_copy(update={"slo": config.Objective(ttft=1.0, tpot=0.05)})
                if q.priority == 0
                else q
                for q in policy.queues
            )
        }
    )
    ctrl.apply_policy(tighter.core_settings())
    assert ctrl._dispatcher.backends["b0"].limiter is lim
    assert lim.tpot_target(clock.now()) == pytest.approx(0.045)


def test_a_time_budget_bounds_the_mean_tpot_of_the_long_answers() -> None:
    # P0's clients wait 30 s; its answers run up to 1,001 tokens: (30 - 1 s for the first
    # token) / 1,000 = 29 ms per token on average, whatever its 100 ms TPOT objective says
    lim = limiter(InFlight(p0=1))
    lim.on_dispatch(1, 100, 0.0)  # far below the limit: no growth to blur the cut

    def ends(n: int, tokens: int, tpot: float, prio: int, budget: float | None) -> None:
        for _ in range(n):
            lim.on_sample(  # the first token: the class and its client's budget
                Sample(ttft_s=0.1, sent_at=0.0, priority=prio, client_budget_s=budget), 1.0
            )
            lim.on_sample(
                Sample(
                    ttft_s=0.1,
                    tpot_s=tpot,
                    completion_tokens=tokens,
                    e2e_s=0.1 + (tokens - 1) * tpot,
                    sent_at=0.0,
                    priority=prio,
                    client_budget_s=budget,
                ),
                1.0,
            )

    ends(1, 1001, 0.02, 0, 30.0)
    ends(18, 100, 0.02, 0, 30.0)
    assert lim.budget_bound(0) is None  # 19 lengths: fewer than min_lengths (20)
    assert lim.mean_target(1.0) is None
    ends(1, 100, 0.02, 0, 30.0)
    # 20 lengths: the longest is 1,001
    assert lim.budget_bound(0) == pytest.approx(0.029)
    assert lim.mean_target(1.0) == pytest.approx(0.95 * 0.029)
    assert lim.tpot_target(1.0) == pytest.approx(0.09)  # the p95's target is unchanged
    assert lim.cuts == 0
    # a mean above 27.55 ms cuts, although the p95 is far under 90 ms
    ends(1, 100, 0.05, 0, 30.0)  # EWMA 0.3 x 50 + 0.7 x 20 = 29 ms
    assert lim.limit == 16 and lim.last_cut_reason == "tpot"
    # P2: done within 60 s and no client deadline; P1: no budget at all
    ends(20, 601, 0.02, 2, None)
    assert lim.budget_bound(2) == pytest.approx(0.1)  # 60 s / 600
    assert lim.budget_bound(1) is None
    # P1 states only a first token within 15 s: clients that wait 20 s for 1,001-token
    # answers (5 ms per token, below what the engine does alone) do not bound the batch
    ends(20, 1001, 0.02, 1, 20.0)
    assert lim.budget_bound(1) is None


def test_before_answers_end_the_budget_bound_uses_what_requests_may_ask_for() -> None:
    # the first answers to end are the short ones: until 20 have, the bound assumes the
    # longest a request asked for (max_tokens), learnt at the first token
    lim = limiter(InFlight(p0=1))
    assert lim.budget_bound(0) is None
    lim.on_sample(
        Sample(
            ttft_s=0.1,
            prompt_tokens=PROMPT,
            sent_at=0.0,
            priority=0,
            client_budget_s=30.0,
            max_tokens=1025,
        ),
        0.1,
    )
    assert lim.budget_bound(0) == pytest.approx(29.0 / 1024)
    assert lim.mean_target(0.1) == pytest.approx(0.95 * 29.0 / 1024)


def test_p0_first_tokens_slower_than_half_its_ttft_objective_cut() -> None:
    # the backend gets half of P0's 1 s (the rest is the gateway queue's), less the
    # margin: 450 ms for the p95 of P0's last first tokens here
    flight = InFlight(p0=3, p2=10)
    lim = limiter(flight)
    lim.on_dispatch(20, 100, 0.0)
    assert lim.ttft_target(0.0) == (pytest.approx(0.45), 0)

    def first(seconds: float, prio: int, now: float) -> None:
        lim.on_sample(
            Sample(ttft_s=seconds, prompt_tokens=PROMPT, sent_at=now - seconds, priority=prio),
            now,
        )

    for i in range(20):  # P2's slow first tokens are not P0's objective
        first(2.0, 2, 3.0 + i * 0.01)
    assert lim.last_cut_reason != "ttft-objective"
    cuts = lim.cuts
    for i in range(7):
        first(0.5, 0, 4.0 + i * 0.01)
    assert lim.cuts == cuts  # seven: fewer than min_samples
    before = lim.limit
    first(0.3, 0, 4.1)  # eight: the p95 is 500 ms > 450 ms
    assert lim.last_cut_reason == "ttft-objective" and lim.cuts == cuts + 1
    # slow start took it from 20 to 26 on the good first tokens; one cut: 26 x 0.8
    assert (cuts, before, lim.latency_limit) == (0, 26, pytest.approx(20.8))


def test_a_first_token_far_inside_the_objective_is_no_queueing_signal() -> None:
    """The ratio rules (`ttft`: the ratio's EWMA over 3; `ttft-pending`: no first token
    after 4 x expected) count only once a first token takes half the backend's TTFT
    target (0.225 s for P0's 0.45 s): a CPU engine's batch of 6 has first tokens 3-5x a
    lone one's and still 0.1-0.3 s; `sluice`, without objectives, cuts on the ratio."""
    flight = InFlight(p0=3)
    lim = limiter(flight)
    lim.on_dispatch(6, 100, 0.0)
    assert lim.calm_ttft_s(0.0) == pytest.approx(0.225)
    ttft(lim, 0.02, 1.0)  # the base: 40 us per token of 500
    limit = lim.limit
    for i in range(6):  # 5x expected, 100 ms each: the EWMA goes far over 3
        ttft(lim, 0.1, 2.0 + i * 0.01)
    assert (lim.cuts, lim.limit) == (0, limit)
    # the pending alarm: 4 x 20 ms expected, but not before 0.225 s
    assert lim.ttft_alarm_after(PROMPT) == pytest.approx(0.225)
    ttft(lim, 0.25, 3.0)  # past half the target: now the ratio counts
    assert (lim.cuts, lim.last_cut_reason) == (1, "ttft")
    # P0 gone (past the 10 s hold), P1 alone: its own objective (15 s) sets the floor
    flight.counts = [0, 5, 0]
    lim.on_dispatch(5, 100, 20.0)
    assert lim.calm_ttft_s(20.0) == pytest.approx(0.5 * 0.9 * 0.5 * 15.0)


def test_the_prefill_bound_aims_at_the_policys_tightest_ttft_whoever_is_served() -> None:
    # only P2 in flight: a P0 request may still come, and it waits behind the prefill
    # queued before it
    lim = limiter(InFlight(p2=5))
    lim.on_sample(Sample(ttft_s=0.02, prompt_tokens=PROMPT, sent_at=0.0), 0.0)  # 40 us/token
    assert lim.prefill_target_s() == pytest.approx(0.9 * 0.5 * 1.0)
    assert lim.prefill_budget_tokens == pytest.approx(0.45 / 4e-5 - 64)
    assert limiter(InFlight(), prefill_share=None).prefill_budget_tokens is None


def test_reading_the_snapshot_changes_nothing_the_next_decision_sees() -> None:
    """describe() (the /admin/state snapshot) reads the classes being served; it must not
    record them, or an operator polling the state would keep a class 'served' longer."""
    flight = InFlight(p0=1)
    lim = limiter(flight)
    lim.on_dispatch(1, 100, 0.0)
    flight.counts = [0, 0, 0]
    lim.on_release(0, 1.0)  # P0 left at 1.0: its last record is 0.0
    flight.counts = [1, 0, 0]  # another P0 in flight, not yet seen by an event
    lim.describe()
    flight.counts = [0, 0, 0]
    assert lim.serving(10.5) == []  # 10 s after 0.0, not after the describe
    assert lim.tpot_objective(10.5) == pytest.approx(0.2)
