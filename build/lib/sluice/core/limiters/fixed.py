"""`fixed`: a constant concurrency cap per backend (the `static` baseline)."""

from __future__ import annotations

from sluice.core.limiters.base import LimiterBase


class FixedLimiter(LimiterBase):
    def __init__(self, limit: int) -> None:
        if limit < 1:
            raise ValueError("a fixed limit must be at least 1")
        self._limit = limit

    @property
    def limit(self) -> int:
        return self._limit
