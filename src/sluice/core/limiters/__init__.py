"""Adaptive concurrency per backend: one small interface, four algorithms, one factory."""

from __future__ import annotations

from typing import Any

from sluice.core.limiters.base import Limiter, LimiterBase, request_rtt
from sluice.core.limiters.fixed import FixedLimiter
from sluice.core.limiters.gradient import GradientLimiter
from sluice.core.limiters.slo import SloLimiter
from sluice.core.limiters.sluice import SluiceLimiter
from sluice.core.limiters.vegas_seed import VegasSeedLimiter
from sluice.core.settings import LimiterSettings

__all__ = [
    "FixedLimiter",
    "GradientLimiter",
    "Limiter",
    "LimiterBase",
    "SloLimiter",
    "SluiceLimiter",
    "VegasSeedLimiter",
    "make_limiter",
    "request_rtt",
]


def make_limiter(
    policy: LimiterSettings, *, initial_limit: int | None = None, **kwargs: Any
) -> Limiter:
    """A fresh limiter for one backend. `initial_limit` overrides the policy's (a hot
    reload keeps the current limit); extra keyword arguments go to the algorithm."""
    algo = policy.algorithm
    start = policy.initial_limit if initial_limit is None else initial_limit
    start = max(policy.min_limit, min(policy.max_limit, start))
    if algo == "fixed":
        return FixedLimiter(policy.fixed_limit)
    if algo == "vegas-seed":
        return VegasSeedLimiter(policy.min_limit, policy.max_limit, **kwargs)
    if algo == "gradient":
        return GradientLimiter(policy.min_limit, policy.max_limit, start, **kwargs)
    if algo == "sluice":
        return SluiceLimiter(policy.min_limit, policy.max_limit, start, **kwargs)
    if algo == "slo":
        return SloLimiter(policy.min_limit, policy.max_limit, start, **kwargs)
    raise ValueError(f"unknown limiter algorithm {algo!r}")
