"""When to retry and how long to wait: pure decisions, no I/O and no sleeping. Randomness
comes from an injected random.Random, so tests get exact values."""

from __future__ import annotations

import random
from collections.abc import Mapping
from dataclasses import dataclass

import httpx

from sluice.client.retry_after import parse_retry_after, parse_window

# Statuses where the server told us nothing was processed and when to come back.
RETRY_AFTER_STATUSES = frozenset({429, 503})
DEFAULT_RETRY_STATUSES = frozenset({429, 502, 503, 504})

# Errors raised before the request reached the server: nothing was processed, so even a
# non-idempotent POST is safe to send again. Read/write errors and read timeouts are not
# here: the server may have started the (costly) generation.
RETRYABLE_ERRORS: tuple[type[Exception], ...] = (httpx.ConnectError, httpx.ConnectTimeout)


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    """What is retried and how long each wait is.

    max_attempts: attempts in all, the first included (4 = up to 3 retries).
    backoff_base, backoff_cap: full-jitter back-off for answers without advice; retry n
        (0-based) sleeps uniform(0, min(cap, base * 2**n)).
    retry_after_spread: a server delay `ra` becomes uniform(ra, ra * (1 + spread)), so that
        clients told the same value do not come back in the same instant. A server that
        gives each refusal its own return slot and says over what window to spread the
        return (Sluice's `X-Sluice-Retry-Window-Ms`) gets uniform(ra, ra + window) instead:
        it has spread its clients already, and a longer wait would miss the slot.
    max_retry_after: a server asking for a longer wait than this gets its answer passed to
        the caller instead of a silent long sleep.
    retry_statuses: statuses retried at all; 429 and 503 honour Retry-After.
    """

    max_attempts: int = 4
    backoff_base: float = 0.5
    backoff_cap: float = 8.0
    retry_after_spread: float = 0.5
    max_retry_after: float = 60.0
    retry_statuses: frozenset[int] = DEFAULT_RETRY_STATUSES

    def __post_init__(self) -> None:
        if self.max_attempts < 1:
            raise ValueError(f"max_attempts must be >= 1, got {self.max_attempts}")
        if self.backoff_base < 0 or self.backoff_cap < 0:
            raise ValueError("backoff_base and backoff_cap must be >= 0")
        if self.retry_after_spread < 0:
            raise ValueError(f"retry_after_spread must be >= 0, got {self.retry_after_spread}")
        if self.max_retry_after < 0:
            raise ValueError(f"max_retry_after must be >= 0, got {self.max_retry_after}")

    def backoff_delay(self, retry_index: int, rng: random.Random) -> float:
        """Full jitter for retry number `retry_index` (0 = first retry)."""
        ceiling = min(self.backoff_cap, self.backoff_base * 2.0 ** min(retry_index, 64))
        return rng.random() * ceiling

    def retry_after_delay(
        self, retry_after: float, rng: random.Random, window: float | None = None
    ) -> float:
        """The server's delay, stretched by a random share of `retry_after_spread`, or
        by a random share of the server's own return window when it gave one."""
        if window is not None:
            return retry_after + window * rng.random()
        return retry_after * (1.0 + self.retry_after_spread * rng.random())

    def delay_for_status(
        self,
        status: int,
        headers: Mapping[str, str],
        retry_index: int,
        rng: random.Random,
        *,
        wall_now: float,
    ) -> float | None:
        """Seconds to wait before retrying an answer with `status`, or None: do not retry
        (also when the server says so: `x-should-retry: false`, as Sluice does when no
        retry could be served before the request's deadline)."""
        if status not in self.retry_statuses:
            return None
        if headers.get("x-should-retry", "").strip().lower() == "false":
            return None
        if status in RETRY_AFTER_STATUSES:
            advised = parse_retry_after(headers, wall_now=wall_now)
            # 0 ("come back now") carries no timing, so it gets the ordinary back-off.
            if advised is not None and advised > 0:
                if advised > self.max_retry_after:
                    return None
                return self.retry_after_delay(advised, rng, parse_window(headers))
        return self.backoff_delay(retry_index, rng)

    def delay_for_error(
        self, error: BaseException, retry_index: int, rng: random.Random
    ) -> float | None:
        """Seconds to wait before retrying after a transport error, or None: re-raise it."""
        if isinstance(error, RETRYABLE_ERRORS):
            return self.backoff_delay(retry_index, rng)
        return None
