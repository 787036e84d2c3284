"""Retry-After: how far the class queue must drain, over its net drain rate."""

from __future__ import annotations

import math

import pytest

from sluice.core.ewma import DecayingRate
from sluice.core.retry_after import (
    DrainEstimator,
    deadline_code,
    refusal_excess,
)
from sluice.core.types import RejectCode


def test_decaying_rate_values() -> None:
    r = DecayingRate(tau_s=2.0)
    assert r.rate(0.0) == 0.0
    r.record(0.0)
    assert r.rate(0.0) == 0.5  # 1 / tau
    assert r.rate(2.0) == pytest.approx(0.5 * math.exp(-1))
    r.record(2.0)
    assert r.rate(2.0) == pytest.approx(0.5 * math.exp(-1) + 0.5)


def test_decaying_rate_converges_to_a_steady_rate() -> None:
    r = DecayingRate(tau_s=1.0)
    for i in range(2000):
        r.record(i * 0.01)  # 100 per second
    assert r.rate(20.0) == pytest.approx(100.0, rel=0.01)


def test_a_refusal_whose_retry_after_does_not_fit_the_deadline_cannot_be_served_in_time() -> None:
    quota, late = RejectCode.TENANT_QUOTA, RejectCode.CANNOT_SERVE_IN_TIME
    assert deadline_code(quota, 8.0, 100.0, None) is quota  # no deadline sent
    assert deadline_code(quota, 8.0, 100.0, 108.0) is quota  # back just in time
    assert deadline_code(quota, 8.0, 100.0, 107.9) is late  # past it
    assert deadline_code(quota, 0.2, 100.0, 101.0) is quota  # "Retry-After: 1" fits
    # 0.2 s would fit, but the header says at least 1 s: not within 0.9 s
    assert deadline_code(quota, 0.2, 100.0, 100.9) is late


def excess(code: RejectCode, **kw: float) -> float:
    args = {
        "queued": 10,
        "max_queue_size": 10,
        "patience_s": 15.0,
        "class_rate": 0.0,
        "queued_total": 10,
        "limit_total": 20,
        "fast_reject_above": 0.8,
    }
    args.update(kw)
    return refusal_excess(code, **args)  # type: ignore[arg-type]


def test_how_far_the_queue_must_drain_per_cause() -> None:
    assert excess(RejectCode.QUEUE_FULL) == 1.0  # 10 queued of 10: one must leave
    assert excess(RejectCode.QUEUE_FULL, queued=14) == 5.0  # after a hot reload shrank it
    # shed: 100 queued at 4/s, patience 15 s: 60 can be served in time, 40 too many
    assert excess(RejectCode.SHED_ON_PRESSURE, queued=100, class_rate=4.0) == 40.0
    assert excess(RejectCode.QUEUE_TIMEOUT, queued=100, class_rate=4.0, patience_s=5.0) == 80.0
    # fast reject at 0.8: the backlog must fall under 0.6 x the limits (12 of 20)
    assert excess(RejectCode.FAST_REJECT, queued_total=30) == 18.0
    assert excess(RejectCode.FAST_REJECT, queued_total=3) == 1.0  # at least one


def test_position_over_the_net_drain_rate() -> None:
    d = DrainEstimator(tau_s=1.0)
    for _ in range(4):
        d.record_dispatch(1, 0.0)  # P1: 4 per second
    d.record_arrival(1, 0.0)  # 1 per second still arriving
    assert d.retry_after(1, 0.0, excess=9, timeout_s=15.0) == 3.0  # 9 / (4 - 1)
    assert d.retry_after(1, 0.0, excess=0.1, timeout_s=15.0) == 0.1  # at least min_s
    assert d.retry_after(1, 0.0, excess=1000, timeout_s=15.0) == 60.0


def test_demand_above_service_sends_clients_away_for_long() -> None:
    d = DrainEstimator(tau_s=1.0)
    d.record_dispatch(1, 0.0)
    for _ in range(3):
        d.record_arrival(1, 0.0)  # three arrive for each one served
    assert d.retry_after(1, 0.0, excess=1, timeout_s=15.0) == 60.0


def test_a_class_not_served_drains_with_the_classes_above() -> None:
    d = DrainEstimator(tau_s=1.0)
    for _ in range(10):
        d.record_dispatch(0, 0.0)  # only P0 moves: 10 per second
    for _ in range(5):
        d.record_arrival(0, 0.0)  # 5 P0 per second still coming
    for _ in range(2):
        d.record_arrival(2, 0.0)  # and 2 P2 (refused)
    # P2: net drain of P0..P2 = 10 - 7 = 3 per second; 12 too many -> 4 s
    assert d.retry_after(2, 0.0, excess=12, timeout_s=60.0) == 4.0
    # later, with the same history decayed by e^-1, the ratio holds
    assert d.retry_after(2, 1.0, excess=12, timeout_s=60.0) == pytest.approx(4.0 * math.e)


def test_nothing_moving_at_all_gives_the_class_timeout() -> None:
    d = DrainEstimator()
    d.record_arrival(1, 0.0)
    assert d.retry_after(1, 0.0, excess=5, timeout_s=15.0) == 15.0


def test_predicted_wait_of_an_admitted_newcomer() -> None:
    d = DrainEstimator(tau_s=1.0)
    assert d.wait_estimate(1, 0.0, ahead=5, queued_above=0) == math.inf
    assert not d.warm(0.0)
    for _ in range(4):
        d.record_dispatch(1, 0.0)
    assert d.wait_estimate(1, 0.0, ahead=10, queued_above=99) == 2.5  # 10 / 4 per s
    # a class not served waits for what is queued above it too
    assert d.wait_estimate(2, 0.0, ahead=10, queued_above=30) == 10.0  # 40 / 4 per s
    assert not d.warm(0.5)
    assert d.warm(1.0)
