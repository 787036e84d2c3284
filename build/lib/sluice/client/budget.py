"""The retry budget: a token bucket that lets retries be at most a fixed share of requests,
so that a client cannot multiply the load of a server that is already refusing work."""

from __future__ import annotations

import threading

# Tokens are counted in millionths so that 0.1-token deposits add up exactly
# (ten deposits of 0.1 make exactly one retry, with no float drift).
_SCALE = 1_000_000


class RetryBudget:
    """Each request deposits `ratio` tokens, each retry spends one token.

    The bucket starts with `initial` tokens and never holds more than `capacity`, so after a
    long calm period a storm of N refused requests gets at most `capacity + ratio * N`
    retries. Thread-safe; share one instance between transports to
    give them a common budget.
    """

    def __init__(self, ratio: float = 0.1, initial: float = 10.0, capacity: float = 10.0):
        if not 0.0 <= ratio <= 1.0:
            raise ValueError(f"ratio must be within [0, 1], got {ratio}")
        if initial < 0 or capacity < 0:
            raise ValueError("initial and capacity must be >= 0")
        if initial > capacity:
            raise ValueError(f"initial ({initial}) must not exceed capacity ({capacity})")
        self.ratio = ratio
        self.capacity = capacity
        self._deposit = round(ratio * _SCALE)
        self._capacity = round(capacity * _SCALE)
        self._tokens = round(initial * _SCALE)
        self._lock = threading.Lock()

    @property
    def tokens(self) -> float:
        return self._tokens / _SCALE

    def deposit(self) -> None:
        """Record one request (its first attempt)."""
        with self._lock:
            self._tokens = min(self._capacity, self._tokens + self._deposit)

    def try_spend(self) -> bool:
        """Take one token for a retry; False (and nothing taken) when the bucket is short."""
        with self._lock:
            if self._tokens < _SCALE:
                return False
            self._tokens -= _SCALE
            return True
