"""The KV a backend's in-flight requests will hold at their joint peak
(core/kv_projection.py), and the dispatcher's KV budget counting that peak rather than
the sum of whole footprints: requests whose ends are staggered free their KV before the
others reach theirs."""

from __future__ import annotations

from sluice.config import Policy
from sluice.core.clock import FakeClock
from sluice.core.controller import Controller
from sluice.core.kv_projection import projected_peak
from sluice.core.types import BackendMetrics, Outcome, RequestInfo


def test_nothing_in_flight_holds_nothing() -> None:
    assert projected_peak([]) == 0.0


def test_requests_that_end_together_peak_at_the_sum_of_their_footprints() -> None:
    # three prompts of 80 with 20 tokens each to go: all end at t = 20, holding 100 each
    assert projected_peak([(80, 20)] * 3) == 300.0


def test_the_peak_is_just_before_an_end() -> None:
    # (held now, tokens to go): at t = 5, before the first ends: 95+5 + 80+5 + 80+5 = 270;
    # at t = 20 only the two long ones: 2 x 100 = 200; now: 255
    assert projected_peak([(95, 5), (80, 20), (80, 20)]) == 270.0
    # a long one dominates: at t = 100 it alone holds 150 > 4 x (10 + 2) + 50 + 2 = 100
    assert projected_peak([(10, 2)] * 4 + [(50, 100)]) == 150.0


def test_finished_requests_count_at_what_they_hold() -> None:
    # nothing left to generate: the peak is now
    assert projected_peak([(120, 0), (30, 0)]) == 150.0


# 100 blocks of 16 = 1,600 tokens; the sluice limiter's budget is 80 % of it = 1,280
KV = {"num_gpu_blocks": 100, "block_size": 16}


def _controller() -> tuple[Controller, FakeClock]:
    policy = Policy.model_validate(
        {
            "limiter": {"algorithm": "sluice", "initialLimit": 20, "maxLimit": 100},
            "dispatcher": {"reserved": {"p0": 0.0}},
        }
    )
    clock = FakeClock()
    c = Controller(policy.core_settings(), clock, ["b0"])
    c.on_metrics("b0", BackendMetrics(at=0.0, **KV))  # type: ignore[arg-type]
    # a first request teaches the backend's TPOT: 20 tokens in 1.9 s after the first,
    # 0.1 s each; its output teaches the tenant's (20): footprints are 80 + 20
    c.arrive(RequestInfo("w", "t", 1, "m", 80, 40))
    assert [a.request_id for a in c.step().assignments] == ["w"]
    c.on_first_token("w")
    clock.set(1.9)
    c.on_finish("w", Outcome.OK, 80, 20)
    return c, clock


def _placed(c: Controller) -> list[str]:
    return sorted(a.request_id for a in c.step().assignments)


def _staggered(progressed: int) -> list[str]:
    """12 requests of footprint 100 sent at t = 2 (1,200 of the 1,280 budget), two more
    queued; `progressed` of them have had their first token at t = 2. At t = 3.5 one of
    the others ends: which of the queued two go."""
    c, clock = _controller()
    clock.set(2.0)
    for i in range(12):
        c.arrive(RequestInfo(f"a{i}", "t", 1, "m", 80, 40))
    assert len(c.step().assignments) == 12
    for i in range(2):
        c.arrive(RequestInfo(f"x{i}", "t", 1, "m", 80, 40))
    assert c.step().assignments == []  # 1,300 > 1,280
    for i in range(progressed):
        c.on_first_token(f"a{i}")
    clock.set(3.5)
    c.on_finish("a11", Outcome.OK, 80, 20)
    return _placed(c)


def test_requests_halfway_through_their_answers_leave_room_for_one_more() -> None:
    # six have generated 15 of their 20 tokens (95 held, 5 to go), five have not started
    # (80 held, 20 to go): the peak is at t = 5, 970 + 11 x 5 = 1,025, not 1,100: both
    # queued requests fit (1,025 + 100 + 100 = 1,225), where the sum of footprints lets
    # one (1,100 + 100 + 100 = 1,300 > 1,280)
    assert _staggered(progressed=6) == ["x0", "x1"]


def test_requests_that_have_not_started_count_whole() -> None:
    # no first token yet: each still has its whole answer ahead, all end together
    assert _staggered(progressed=0) == ["x0"]
