"""Time for the core: decisions read time only through a Clock, so tests and the
discrete-event simulation can drive them with virtual time and never sleep."""

from __future__ import annotations

import time
from typing import Protocol


class Clock(Protocol):
    def now(self) -> float:
        """Seconds on a monotonic scale; only differences are meaningful."""
        ...


class MonotonicClock:
    """Real time, for the gateway shell."""

    # the C function itself: read several times per request, a Python frame here would
    # cost more than the reading
    now = staticmethod(time.monotonic)


class FakeClock:
    """Virtual time, advanced explicitly by tests and simulations."""

    def __init__(self, start: float = 0.0) -> None:
        self._now = start

    def now(self) -> float:
        return self._now

    def advance(self, seconds: float) -> None:
        if seconds < 0:
            raise ValueError("time cannot go backwards")
        self._now += seconds

    def set(self, t: float) -> None:
        if t < self._now:
            raise ValueError("time cannot go backwards")
        self._now = t
