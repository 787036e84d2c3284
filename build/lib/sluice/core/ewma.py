"""Small smoothing helpers shared by the core: an EWMA of values and a time-decayed rate."""

from __future__ import annotations

import math


class Ewma:
    """Exponentially weighted moving average; the first value is taken as it is."""

    __slots__ = ("alpha", "value")

    def __init__(self, alpha: float, initial: float | None = None) -> None:
        if not 0.0 < alpha <= 1.0:
            raise ValueError("alpha must be in (0, 1]")
        self.alpha = alpha
        self.value = initial

    def update(self, x: float) -> float:
        v = self.value
        self.value = x if v is None else v + self.alpha * (x - v)
        return self.value

    def get(self, default: float) -> float:
        return default if self.value is None else self.value


class DecayingRate:
    """Events per second, exponentially weighted in time with time constant `tau_s`.

    Each event adds 1/tau to a level that decays as exp(-dt/tau); under a steady rate r the
    level converges to r. O(1) per event and per read, no bins, exact for any event times.
    """

    __slots__ = ("_at", "_level", "tau_s")

    def __init__(self, tau_s: float = 2.0) -> None:
        if tau_s <= 0:
            raise ValueError("tau_s must be positive")
        self.tau_s = tau_s
        self._level = 0.0
        self._at = 0.0

    def record(self, now: float, count: float = 1.0) -> None:
        dt = now - self._at
        if dt > 0:
            self._level *= math.exp(-dt / self.tau_s)
            self._at = now
        self._level += count / self.tau_s

    def rate(self, now: float) -> float:
        dt = now - self._at
        if dt <= 0:
            return self._level
        return self._level * math.exp(-dt / self.tau_s)
