"""A base-latency estimate that is re-measured instead of kept forever.

The value is the minimum over the current window and the one before it. Each window lasts
`interval_s` times a random factor in [1 - jitter, 1] (so backends do not re-measure in
lockstep, as Netflix's Vegas probe jitters its period). When a window ends, the one before
it is forgotten: a lucky sample or an old workload pins the base for two windows at most.
"""

from __future__ import annotations

import math
import random


class WindowedMin:
    __slots__ = ("_cur", "_prev", "_rng", "_window_end", "interval_s", "jitter")

    def __init__(self, interval_s: float, jitter: float, rng: random.Random) -> None:
        if interval_s <= 0 or not 0 <= jitter < 1:
            raise ValueError("need interval_s > 0 and 0 <= jitter < 1")
        self.interval_s = interval_s
        self.jitter = jitter
        self._rng = rng
        self._cur = math.inf
        self._prev = math.inf
        self._window_end: float | None = None

    def _length(self) -> float:
        return self.interval_s * (1.0 - self.jitter * self._rng.random())

    def _roll(self, now: float) -> None:
        end = self._window_end
        if end is None:
            self._window_end = now + self._length()
            return
        if now < end:
            return
        # A window with no sample at all leaves nothing to remember.
        self._prev = self._cur if now < end + self.interval_s else math.inf
        self._cur = math.inf
        self._window_end = now + self._length()

    def update(self, x: float, now: float) -> None:
        self._roll(now)
        if x < self._cur:
            self._cur = x

    def value(self, now: float) -> float | None:
        self._roll(now)
        return self.peek()

    def peek(self) -> float | None:
        """The current estimate without moving the window."""
        m = min(self._cur, self._prev)
        return None if m == math.inf else m
