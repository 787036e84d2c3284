"""The three drop policies, through the Controller, with a fake clock. The Retry-After
figures here are the `drain` rule's (retry_after.py); the return slots of the default
`booking` rule are tested in test_core_return_slots.py."""

from __future__ import annotations

import math
from typing import Any

import pytest

from sluice.config import Policy
from sluice.core.clock import FakeClock
from sluice.core.controller import Controller
from sluice.core.request_record import RequestState
from sluice.core.types import Outcome, RejectCode, RequestInfo


def policy(limit: int = 1, reserved: float = 0.0, **queue_overrides: dict[str, Any]) -> Policy:
    queues = {
        0: {"maxQueueSize": 2, "timeout": "8s", "dropPolicy": "tail"},
        1: {"maxQueueSize": 50, "timeout": "15s", "dropPolicy": "early-drop-on-pressure"},
        2: {"maxQueueSize": 50, "timeout": "60s", "dropPolicy": "fast-reject"},
    }
    for key, over in queue_overrides.items():
        queues[int(key[1])].update(over)
    return Policy.model_validate(
        {
            "queues": [{"priority": p, "name": f"q{p}", **q} for p, q in queues.items()],
            "limiter": {"algorithm": "fixed", "fixedLimit": limit},
            "dispatcher": {"reserved": {"p0": reserved}},
            "retryAfter": {"rule": "drain"},
        }
    )


def req(rid: str, prio: int = 0, deadline: float | None = None) -> RequestInfo:
    return RequestInfo(rid, "t", prio, "m", 100, 100, client_deadline=deadline)


def setup(pol: Policy, **kw: Any) -> tuple[Controller, FakeClock]:
    clock = FakeClock()
    return Controller(
        pol.core_settings(), clock, ["b0"], rate_tau_s=1.0, ttft_alpha=1.0, **kw
    ), clock


# -- tail ------------------------------------------------------------------------------


def test_tail_full_queue_rejects_the_newcomer() -> None:
    c, _clock = setup(policy(limit=1))
    assert c.arrive(req("r0")).admitted
    assert [a.request_id for a in c.step().assignments] == ["r0"]  # in flight
    assert c.arrive(req("r1")).admitted
    assert c.arrive(req("r2")).admitted
    adm = c.arrive(req("r3"))  # maxQueueSize 2
    assert not adm.admitted and adm.code is RejectCode.QUEUE_FULL
    # four arrived for one served: demand above service, come back much later
    assert adm.retry_after_s == 60.0
    assert c.state_of("r3") is RequestState.GONE


def test_tail_drops_from_the_head_after_the_timeout() -> None:
    c, clock = setup(policy(limit=1))
    c.arrive(req("r0"))
    c.step()
    clock.set(1.0)
    c.arrive(req("r1"))
    clock.set(2.0)
    c.arrive(req("r2"))
    assert c.step().wake_at == 9.0  # r1 queued at 1 s, timeout 8 s
    clock.set(8.99)
    assert c.step().rejections == []
    clock.set(9.0)
    [rej] = c.step().rejections
    assert rej.request_id == "r1" and rej.code is RejectCode.QUEUE_TIMEOUT
    assert rej.queued_s == pytest.approx(8.0)
    assert c.step().wake_at == 10.0
    assert c.state_of("r1") is RequestState.GONE
    assert c.state_of("r2") is RequestState.QUEUED


def test_tail_client_deadline_caps_the_wait() -> None:
    c, clock = setup(policy(limit=1))
    c.arrive(req("r0"))
    c.step()
    c.arrive(req("r1", deadline=3.0))
    assert c.step().wake_at == 3.0
    clock.set(3.0)
    # dispatch does not serve it even though a slot frees at that instant
    c.on_finish("r0", Outcome.OK, 100, 10)
    s = c.step()
    assert s.assignments == []
    [rej] = s.rejections
    assert rej.request_id == "r1" and rej.code is RejectCode.QUEUE_TIMEOUT
    adm = c.arrive(req("r2", deadline=2.0))  # already past its deadline
    assert adm.code is RejectCode.QUEUE_TIMEOUT


# -- early-drop-on-pressure ------------------------------------------------------------


def test_early_drop_refuses_a_newcomer_whose_predicted_wait_exceeds_its_patience() -> None:
    c, clock = setup(policy(limit=1))
    c.arrive(req("p0", prio=1))
    assert len(c.step().assignments) == 1
    for i in range(3):
        assert c.arrive(req(f"q{i}", prio=1)).admitted
    # pressure = 0.5 * 1 (limit used) + 0.5 * min(1, 3 queued / limit 1) = 1.0
    assert c.pressure() == 1.0
    # cold: one dispatch seen, less than tau (1 s) ago: no prediction, no shedding
    assert c.arrive(req("cold", prio=1, deadline=0.5)).admitted
    clock.set(1.0)
    # P1 rate: one dispatch 1 s ago with tau 1 s = 1/e per s; 4 ahead: 4e = 10.9 s,
    # within the 15 s timeout...
    assert c.arrive(req("fits", prio=1)).admitted
    # ...but not within a client deadline 10 s away
    adm = c.arrive(req("late", prio=1, deadline=11.0))
    assert adm.code is RejectCode.SHED_ON_PRESSURE
    assert adm.retry_after_s == 60.0  # 7 arrived for 1 served


def test_early_drop_does_not_shed_below_the_pressure_threshold() -> None:
    c, _clock = setup(policy(limit=4))
    c.arrive(req("a", prio=1))
    c.step()
    # pressure 0.5 * 1/4 = 0.125 < shedAbove 0.5: queued even with a short deadline
    assert c.pressure() == 0.125
    assert c.arrive(req("late", prio=1, deadline=0.5)).admitted


def test_early_drop_drops_at_the_head_when_the_client_will_not_wait() -> None:
    c, clock = setup(policy(limit=1))
    c.arrive(req("r0", prio=1))
    c.step()
    clock.set(0.5)
    c.on_first_token("r0")  # expected TTFT is now 0.5 s (alpha 1)
    c.arrive(req("r1", prio=1, deadline=3.0))
    c.arrive(req("r2", prio=0, deadline=3.0))  # tail: no slack
    # r1 could not get its first token before 3.0 once now + 0.5 >= 3.0
    assert c.step().wake_at == 2.5
    clock.set(2.49)
    assert c.step().rejections == []
    clock.set(2.5)
    [rej] = c.step().rejections
    assert rej.request_id == "r1" and rej.code is RejectCode.QUEUE_TIMEOUT
    assert c.step().wake_at == 3.0  # r2 (tail) waits until its deadline itself


def test_early_drop_class_timeout_moves_earlier_by_the_expected_ttft() -> None:
    c, clock = setup(policy(limit=1, q1={"timeout": "4s"}))
    c.arrive(req("r0", prio=1))
    c.step()
    clock.set(1.0)
    c.on_first_token("r0")  # expected TTFT 1 s
    c.arrive(req("r1", prio=1))
    assert c.step().wake_at == 4.0  # 1 + 4 - 1
    clock.set(4.0)
    c.on_finish("r0", Outcome.OK, 100, 5)
    s = c.step()
    assert s.assignments == []  # its client would not get a token in time: not served
    [rej] = s.rejections
    assert rej.request_id == "r1"


def test_retry_after_is_the_drain_time_net_of_arrivals() -> None:
    c, clock = setup(policy(limit=1))
    for i in range(11):
        c.arrive(req(f"r{i}", prio=1))  # eleven at t=0; r0 goes on arrival
    assert [a.request_id for a in c.step().assignments] == ["r0"]
    dispatch_times = [5.0, 5.25, 5.5, 5.75, 6.0]  # warm: dispatching for tau = 1 s
    for i, t in enumerate(dispatch_times, start=1):
        clock.set(t)
        c.on_finish(f"r{i - 1}", Outcome.OK, 100, 10)
        assert [a.request_id for a in c.step().assignments] == [f"r{i}"]
    # 5 queued, 1 in flight of limit 1: pressure 1.0; the newcomer's client gives up in 0.5 s
    now = 6.0
    adm = c.arrive(req("late", prio=1, deadline=now + 0.5))
    assert adm.code is RejectCode.SHED_ON_PRESSURE
    mu = sum(math.exp(-(now - t)) for t in [0.0, *dispatch_times])  # tau 1 s
    lam = 11 * math.exp(-now) + 1  # the eleven, and the newcomer itself
    excess = 5 - 0.5 * mu  # what cannot be served within its 0.5 s
    assert adm.retry_after_s == pytest.approx(excess / (mu - lam))


# -- fast-reject -----------------------------------------------------------------------


def test_fast_reject_refuses_above_the_threshold_and_queues_below() -> None:
    c, _clock = setup(policy(limit=2))
    c.arrive(req("a", prio=0))
    c.arrive(req("b", prio=0))
    assert len(c.step().assignments) == 2
    c.arrive(req("c", prio=0))
    # 0.5 * 1 + 0.5 * (1 queued / limit 2) = 0.75 < 0.8: P2 queues
    assert c.pressure() == 0.75
    assert c.arrive(req("batch1", prio=2)).admitted
    assert c.pressure() == 1.0  # 2 queued / 2
    adm = c.arrive(req("batch2", prio=2))
    assert adm.code is RejectCode.FAST_REJECT
    assert adm.retry_after_s == 60.0  # 5 arrived for 2 served
    # P0 (tail) still queues at the same pressure
    assert c.arrive(req("d", prio=0)).admitted


def test_max_queue_size_zero_admits_only_what_can_go_at_once() -> None:
    c, _clock = setup(policy(limit=1, q0={"maxQueueSize": 0}))
    assert c.arrive(req("a")).admitted  # a free slot: admitted and dispatched
    assert [x.request_id for x in c.step().assignments] == ["a"]
    assert c.arrive(req("b")).code is RejectCode.QUEUE_FULL


def test_a_class_never_sheds_below_the_pressure_that_fast_rejects_a_lower_class() -> None:
    from sluice.config import parse_policy
    from sluice.core.controller import class_thresholds

    seed = parse_policy("pressure: {fastRejectAbove: 0.8, shedAbove: 0.5}")
    # P2 is fast-reject in the default queues: P1 (early-drop) sheds only from 0.8 on.
    assert [t.shed_above for t in class_thresholds(seed.core_settings())] == [0.8, 0.8, 0.5]
    assert [t.fast_reject_above for t in class_thresholds(seed.core_settings())] == [0.8, 0.8, 0.8]
    no_fast = parse_policy("""
queues:
  - {priority: 0, name: a, maxQueueSize: 1, timeout: 1s, dropPolicy: tail}
  - {priority: 1, name: b, maxQueueSize: 1, timeout: 1s, dropPolicy: early-drop-on-pressure}
  - {priority: 2, name: c, maxQueueSize: 1, timeout: 1s, dropPolicy: tail}
pressure: {fastRejectAbove: 0.8, shedAbove: 0.5}
""")
    assert [t.shed_above for t in class_thresholds(no_fast.core_settings())] == [0.5, 0.5, 0.5]
