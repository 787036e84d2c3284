"""Adaptive concurrency per backend: one small interface, five algorithms, one factory."""

from __future__ import annotations

from typing import Any

from sluice.core.limiters.base import Limiter, LimiterBase, LimiterContext, request_rtt
from sluice.core.limiters.fixed import FixedLimiter
from sluice.core.limiters.gradient import GradientLimiter
from sluice.core.limiters.latency_feedback import SluiceLimiter
from sluice.core.limiters.objective_steered import SloLimiter
from sluice.core.limiters.vegas_seed import VegasSeedLimiter
from sluice.core.settings import LimiterSettings

__all__ = [
    "ALGORITHMS",
    "FixedLimiter",
    "GradientLimiter",
    "Limiter",
    "LimiterBase",
    "LimiterContext",
    "SloLimiter",
    "SluiceLimiter",
    "VegasSeedLimiter",
    "make_limiter",
    "request_rtt",
]

# The policy's `limiter.algorithm` names -> their classes; each file is named for what its
# algorithm does (`sluice`: latency_feedback.py, `slo`: objective_steered.py).
ALGORITHMS: dict[str, type[LimiterBase]] = {
    "fixed": FixedLimiter,
    "vegas-seed": VegasSeedLimiter,
    "gradient": GradientLimiter,
    "sluice": SluiceLimiter,
    "slo": SloLimiter,
}


def make_limiter(
    settings: LimiterSettings,
    context: LimiterContext | None = None,
    *,
    initial_limit: int | None = None,
    **kwargs: Any,
) -> Limiter:
    """A fresh limiter for one backend. `context`: what it may ask of the controller (None:
    a lone backend); `initial_limit` overrides the policy's (a hot reload keeps the current
    limit); extra keyword arguments (tuning) go to the algorithm."""
    algorithm = ALGORITHMS.get(settings.algorithm)
    if algorithm is None:
        raise ValueError(f"unknown limiter algorithm {settings.algorithm!r}")
    start = settings.initial_limit if initial_limit is None else initial_limit
    start = max(settings.min_limit, min(settings.max_limit, start))
    return algorithm.build(settings, start, context or LimiterContext(), **kwargs)
