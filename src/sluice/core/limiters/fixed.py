"""`fixed`: a constant concurrency cap per backend (the `static` baseline)."""

from __future__ import annotations

from typing import Any, Self

from sluice.core.limiters.base import LimiterBase, LimiterContext
from sluice.core.settings import LimiterSettings


class FixedLimiter(LimiterBase):
    @classmethod
    def build(
        cls, settings: LimiterSettings, start: int, context: LimiterContext, **kwargs: Any
    ) -> Self:
        return cls(settings.fixed_limit, **kwargs)

    def __init__(self, limit: int) -> None:
        if limit < 1:
            raise ValueError("a fixed limit must be at least 1")
        self._limit = limit

    @property
    def limit(self) -> int:
        return self._limit
