"""P0 through a fall of the limit (core/p0_refill.py): where the limit falls below the
count in flight for the KV cache's sake, P0 refills what ends, one for one, up to the
count the fall found; P1/P2 wait for the new limit; a cut for latency ends it."""

from __future__ import annotations

import math

import pytest
from tests.unit.test_core_dispatcher import policy  # fixed limiter, tail drop

from sluice.core.clock import FakeClock
from sluice.core.controller import Controller
from sluice.core.kv_budget import SharedRoom
from sluice.core.limiters import LimiterBase, LimiterContext
from sluice.core.limiters.base import KV_CUT
from sluice.core.p0_refill import refill_to
from sluice.core.settings import LimiterSettings
from sluice.core.types import BackendMetrics, Outcome, RequestInfo


class FallingLimiter(LimiterBase):
    """A limit the test moves, with or without a cut (and its reason)."""

    def __init__(self) -> None:
        self.value = 10
        self.cut_at = -math.inf
        self.reason = ""
        self.shared: SharedRoom | None = None

    @property
    def limit(self) -> int:
        return self.value

    @property
    def kv_shared(self) -> SharedRoom | None:
        return self.shared

    @property
    def last_cut_at(self) -> float:
        return self.cut_at

    @property
    def last_cut_reason(self) -> str:
        return self.reason


def gateway() -> tuple[Controller, FallingLimiter, FakeClock]:
    """One backend at a limit of 10 (P1/P2: cap_low 8) running 10 P0 requests."""
    clock = FakeClock()
    limiter = FallingLimiter()

    def factory(context: LimiterContext, lp: LimiterSettings, initial: int | None) -> LimiterBase:
        return limiter

    c = Controller(policy(10).core_settings(), clock, ["b0"], limiter_factory=factory)
    for i in range(10):
        c.arrive(RequestInfo(f"run{i}", "t", 0, "m", 100, 100))
    assert len(c.step().assignments) == 10
    return c, limiter, clock


def fall(c: Controller, limiter: FallingLimiter, clock: FakeClock, to: int, cut: str = "") -> None:
    """The limit falls to `to` (a cut for `cut`, or none: the KV cap), seen at a scrape."""
    limiter.value = to
    if cut:
        limiter.cut_at, limiter.reason = clock.now(), cut
    c.on_metrics("b0", BackendMetrics(at=clock.now()))


def queued(c: Controller, *ids: str) -> list[str]:
    """Requests arrive (P0 unless named p1-...), then what goes."""
    for rid in ids:
        c.arrive(RequestInfo(rid, "t", 1 if rid.startswith("p1") else 0, "m", 100, 100))
    return [a.request_id for a in c.step().assignments]


@pytest.mark.parametrize("cut", ["", KV_CUT])
def test_p0_refills_what_ends_after_a_fall_for_the_cache(cut: str) -> None:
    # The KV cap (no cut) or a `kv` cut takes the limit from 10 to 7 with 10 in flight.
    c, limiter, clock = gateway()
    fall(c, limiter, clock, 7, cut)
    assert queued(c, "p0-a", "p1-a") == []  # 10 in flight: nothing ends, nothing goes
    c.on_finish("run0", Outcome.OK, 100, 100)
    # one ended: P0 takes its place (9 < 10); P1 waits for cap_low (7 -> 5)
    assert [a.request_id for a in c.step().assignments] == ["p0-a"]
    c.on_finish("run1", Outcome.OK, 100, 100)
    assert queued(c) == []  # the P1 request still waits: 9 in flight
    assert queued(c, "p0-b") == ["p0-b"]  # and P0 still refills: never past 10


@pytest.mark.parametrize("cut", ["ttft", "tpot", "waiting", "preemption"])
def test_a_cut_for_latency_or_congestion_makes_p0_wait_for_the_new_limit(cut: str) -> None:
    c, limiter, clock = gateway()
    fall(c, limiter, clock, 7, cut)
    c.on_finish("run0", Outcome.OK, 100, 100)
    assert queued(c, "p0-a") == []  # 9 in flight against the limit of 7


def test_a_cut_for_latency_ends_a_refill() -> None:
    c, limiter, clock = gateway()
    fall(c, limiter, clock, 7)  # the KV cap: P0 may refill to 10
    clock.advance(1.0)
    fall(c, limiter, clock, 7, "ttft")  # then first tokens slow down
    c.on_finish("run0", Outcome.OK, 100, 100)
    assert queued(c, "p0-a") == []


def test_the_refill_ends_once_the_count_is_within_the_limit() -> None:
    c, limiter, clock = gateway()
    fall(c, limiter, clock, 7)
    for i in range(3):  # 10 -> 7 in flight, nobody queued to refill
        c.on_finish(f"run{i}", Outcome.OK, 100, 100)
    c.on_finish("run3", Outcome.OK, 100, 100)
    # 6 in flight: P0 goes to the limit (7) and no further, the refill (10) is over
    assert queued(c, "p0-a", "p0-b") == ["p0-a"]


def test_a_shared_backend_is_left_to_its_claims() -> None:
    c, limiter, clock = gateway()
    limiter.shared = SharedRoom(draw=0.0, room_tokens=math.inf, full_tokens=math.inf)
    fall(c, limiter, clock, 7)
    c.on_finish("run0", Outcome.OK, 100, 100)
    assert queued(c, "p0-a") == []


def test_refill_to() -> None:
    # a fall below the count: refill to the count; within it, or a rise: no change
    assert refill_to(0, 10, 12, 7, None) == 10
    assert refill_to(0, 6, 12, 7, None) == 0
    assert refill_to(10, 9, 7, 8, None) == 10
    # a second fall keeps the higher count; a kv cut is a fall like the others
    assert refill_to(10, 9, 8, 6, None) == 10
    assert refill_to(0, 10, 12, 7, KV_CUT) == 10
    # any other cut ends it
    assert refill_to(10, 9, 7, 7, "ttft-objective") == 0
