"""Circuit breaker: opens on error rate and on sustained shedding, probes, closes."""

from __future__ import annotations

from sluice.core.circuit_breaker import BreakerSettings, BreakerState, CircuitBreaker
from sluice.core.clock import FakeClock


def _breaker(**kw: float) -> tuple[CircuitBreaker, FakeClock, list[BreakerState]]:
    clock = FakeClock()
    changes: list[BreakerState] = []
    b = CircuitBreaker(
        "b",
        clock,
        BreakerSettings(**kw),  # type: ignore[arg-type]
        on_change=lambda _n, s: changes.append(s),
    )
    return b, clock, changes


def test_opens_at_error_rate_only_with_enough_requests() -> None:
    b, _clock, changes = _breaker(min_requests=4, error_rate=0.5)
    b.record_failure()
    b.record_failure()
    b.record_failure()
    assert b.state is BreakerState.CLOSED  # 3 < min_requests
    b.record_success()
    assert b.state is BreakerState.OPEN  # 3 of 4 failed
    assert not b.allow() and b.is_open()
    assert changes == [BreakerState.OPEN]


def test_old_outcomes_leave_the_window() -> None:
    b, clock, _ = _breaker(min_requests=4, error_rate=0.5, window_s=10)
    for _ in range(3):
        b.record_failure()
    clock.advance(11)
    for _ in range(3):
        b.record_success()
    b.record_failure()  # 1 of 4 in the window
    assert b.state is BreakerState.CLOSED


def test_half_open_probes_then_close() -> None:
    b, clock, changes = _breaker(min_requests=1, open_for_s=5, probes=2)
    b.record_failure()
    clock.advance(4.9)
    assert not b.allow()
    clock.advance(0.1)
    assert b.allow() and b.allow()  # two probes
    assert not b.allow()  # no third until they report
    b.record_success()
    b.record_success()
    assert b.state is BreakerState.CLOSED and b.allow()
    assert changes == [BreakerState.OPEN, BreakerState.HALF_OPEN, BreakerState.CLOSED]


def test_failed_probe_reopens_for_twice_as_long() -> None:
    b, clock, _ = _breaker(min_requests=1, open_for_s=5, max_open_for_s=8, probes=1)
    b.record_failure()
    clock.advance(5)
    assert b.allow()
    b.record_failure()
    assert b.state is BreakerState.OPEN
    clock.advance(7.9)
    assert not b.allow()  # open for min(10, 8) = 8 s now
    clock.advance(0.1)
    assert b.allow()


def test_sustained_shedding_opens() -> None:
    b, clock, _ = _breaker(shed_for_s=5)
    b.record_shed()
    clock.advance(4)
    b.record_shed()
    assert b.state is BreakerState.CLOSED
    clock.advance(1)
    b.record_shed()
    assert b.state is BreakerState.OPEN


def test_a_success_interrupts_shedding() -> None:
    b, clock, _ = _breaker(shed_for_s=5)
    b.record_shed()
    clock.advance(4)
    b.record_success()
    clock.advance(1)
    b.record_shed()
    clock.advance(4)
    b.record_shed()
    assert b.state is BreakerState.CLOSED


def test_held_open_refuses_then_probes_when_released() -> None:
    b, clock, changes = _breaker(probes=1, open_for_s=5)
    b.hold_open(True)
    assert b.is_open() and not b.allow()
    clock.advance(60)  # no probing while held, however long
    assert not b.allow()
    b.hold_open(False)
    assert b.allow()  # a probe at once
    b.record_success()
    assert b.state is BreakerState.CLOSED
    assert changes == [BreakerState.OPEN, BreakerState.HALF_OPEN, BreakerState.CLOSED]
