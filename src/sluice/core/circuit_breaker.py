"""Circuit breakers, per backend and per feature (docs/degradation.md).

A breaker is CLOSED while things go well. It OPENS when, over a sliding window, the share
of failed requests (errors, timeouts) reaches `error_rate` with at least `min_requests`
seen, or when requests have been shed for overload without a break for `shed_for` seconds.
While OPEN it refuses (the caller answers with the fallback). After `open_for` it goes
HALF_OPEN and lets `probes` requests through: if they all succeed it CLOSES; one failure
re-opens it, for twice as long each time in a row (capped), so a dead backend is not
hammered. Pure: time comes from the injected clock."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum

from sluice.core.clock import Clock


class BreakerState(StrEnum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


@dataclass(frozen=True, slots=True)
class BreakerSettings:
    window_s: float = 10.0
    error_rate: float = 0.5
    min_requests: int = 10
    shed_for_s: float = 5.0
    open_for_s: float = 5.0
    max_open_for_s: float = 60.0
    probes: int = 3


class CircuitBreaker:
    def __init__(
        self,
        name: str,
        clock: Clock,
        settings: BreakerSettings | None = None,
        on_change: Callable[[str, BreakerState], None] | None = None,
    ) -> None:
        self.name = name
        self._clock = clock
        self.settings = settings or BreakerSettings()
        self.state = BreakerState.CLOSED
        self._outcomes: deque[tuple[float, bool]] = deque()  # (time, failed)
        self._failures = 0
        self._shedding_since: float | None = None
        self._opened_at = 0.0
        self._open_for = self.settings.open_for_s
        self._probes_left = 0
        self._probes_ok = 0
        self._on_change = on_change
        self._held = False

    # --- questions -----------------------------------------------------------------------

    def hold_open(self, hold: bool) -> None:
        """Keep the breaker open whatever the evidence (the cluster has lost capacity);
        released, it probes as after any opening."""
        if hold == self._held:
            return
        self._held = hold
        if hold:
            self._open(self._clock.now())
        else:
            self._opened_at = self._clock.now() - self._open_for  # probe at once

    def allow(self) -> bool:
        """May a request go through now? In HALF_OPEN this takes one probe slot."""
        now = self._clock.now()
        if self._held:
            return False
        if self.state is BreakerState.OPEN:
            if now - self._opened_at < self._open_for:
                return False
            self._set(BreakerState.HALF_OPEN, now)
            self._probes_left = self.settings.probes
            self._probes_ok = 0
        if self.state is BreakerState.HALF_OPEN:
            if self._probes_left <= 0:
                return False
            self._probes_left -= 1
            return True
        return True

    def is_open(self) -> bool:
        """Whether requests are being refused (without taking a probe slot)."""
        if self._held:
            return True
        if self.state is BreakerState.OPEN:
            return self._clock.now() - self._opened_at < self._open_for
        return self.state is BreakerState.HALF_OPEN and self._probes_left <= 0

    # --- evidence ------------------------------------------------------------------------

    def record_success(self) -> None:
        now = self._clock.now()
        self._shedding_since = None
        if self.state is BreakerState.HALF_OPEN:
            self._probes_ok += 1
            if self._probes_ok >= self.settings.probes:
                self._open_for = self.settings.open_for_s
                self._outcomes.clear()
                self._failures = 0
                self._set(BreakerState.CLOSED, now)
            return
        self._add(now, failed=False)

    def record_failure(self) -> None:
        now = self._clock.now()
        if self.state is BreakerState.HALF_OPEN:
            self._open_for = min(self._open_for * 2, self.settings.max_open_for_s)
            self._open(now)
            return
        self._add(now, failed=True)

    def record_shed(self) -> None:
        """A request refused for overload (429 from the gateway, or the backend's 503)."""
        now = self._clock.now()
        if self._shedding_since is None:
            self._shedding_since = now
        elif (
            self.state is BreakerState.CLOSED
            and now - self._shedding_since >= self.settings.shed_for_s
        ):
            self._open(now)

    def reset(self) -> None:
        """Close after outside proof of recovery (a backend passing its health checks)."""
        self._outcomes.clear()
        self._failures = 0
        self._shedding_since = None
        self._open_for = self.settings.open_for_s
        self._set(BreakerState.CLOSED, self._clock.now())

    # --- internals -----------------------------------------------------------------------

    def _add(self, now: float, failed: bool) -> None:
        self._outcomes.append((now, failed))
        self._failures += failed
        horizon = now - self.settings.window_s
        while self._outcomes and self._outcomes[0][0] < horizon:
            _, old_failed = self._outcomes.popleft()
            self._failures -= old_failed
        total = len(self._outcomes)
        if (
            self.state is BreakerState.CLOSED
            and self._failures
            and total >= self.settings.min_requests
            and self._failures >= self.settings.error_rate * total
        ):
            self._open(now)

    def _open(self, now: float) -> None:
        self._opened_at = now
        self._shedding_since = None
        self._set(BreakerState.OPEN, now)

    def _set(self, state: BreakerState, _now: float) -> None:
        if state is not self.state:
            self.state = state
            if self._on_change is not None:
                self._on_change(self.name, state)
