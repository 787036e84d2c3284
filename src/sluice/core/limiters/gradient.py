"""`gradient`: Netflix concurrency-limits' Gradient2Limit, ported.

Per sample (no timer):

    short = the last RTT                       (Netflix: SingleMeasurement)
    long  = EWMA of RTTs, window 600, first 10 samples a plain mean
    if long / short > 2: long *= 0.9           (recover fast after a long overload)
    if inflight < limit / 2: keep the limit    (app-limited: do not grow on no evidence)
    gradient  = clamp(long / short, 0.5, 1.0)
    new       = limit * gradient + queue_size  (queue_size 4: room to probe upward)
    new       = limit * (1 - smoothing) + new * smoothing      (smoothing 0.2)
    limit     = clamp(new, min, max);  the integer limit is floor(limit)

`inflight` is the backend's in-flight count when the request was sent (`Sample.inflight`),
as Netflix passes it. Like Gradient2, drops do not change the limit. The RTT is the
whole-request time by default (`rtt="request"`) or the time to first token (`rtt="ttft"`).
Envoy's adaptive-concurrency filter is the same idea with a timer: every 100 ms,
gradient = clamp((minRTT * 1.25) / sampleRTT(p50), 0.5, 2), limit = limit * gradient +
sqrt(limit), and minRTT re-measured every 60 s (with jitter) while the limit is pinned low;
docs/limiter.md compares them.
"""

from __future__ import annotations

import math
from typing import Any, Literal, Self

from sluice.core.limiters.base import LimiterBase, LimiterContext, request_rtt
from sluice.core.settings import LimiterSettings
from sluice.core.types import Sample


class ExpAvg:
    """Netflix's ExpAvgMeasurement: plain mean over a warm-up, then EWMA 2/(window+1)."""

    __slots__ = ("count", "factor", "sum", "value", "warmup")

    def __init__(self, window: int, warmup: int) -> None:
        self.factor = 2.0 / (window + 1)
        self.warmup = warmup
        self.count = 0
        self.sum = 0.0
        self.value = 0.0

    def add(self, x: float) -> float:
        if self.count < self.warmup:
            self.count += 1
            self.sum += x
            self.value = self.sum / self.count
        else:
            self.value = self.value * (1 - self.factor) + x * self.factor
        return self.value


class GradientLimiter(LimiterBase):
    @classmethod
    def build(
        cls, settings: LimiterSettings, start: int, context: LimiterContext, **kwargs: Any
    ) -> Self:
        return cls(settings.min_limit, settings.max_limit, start, **kwargs)

    def __init__(
        self,
        min_limit: int,
        max_limit: int,
        initial_limit: int,
        *,
        smoothing: float = 0.2,
        queue_size: int = 4,
        long_window: int = 600,
        warmup: int = 10,
        rtt: Literal["request", "ttft"] = "request",
    ) -> None:
        if not 1 <= min_limit <= initial_limit <= max_limit:
            raise ValueError("need 1 <= min_limit <= initial_limit <= max_limit")
        self.min_limit = min_limit
        self.max_limit = max_limit
        self.estimated_limit = float(initial_limit)
        self.smoothing = smoothing
        self.queue_size = queue_size
        self.long_rtt = ExpAvg(long_window, warmup)
        self.short_rtt = 0.0
        self.rtt_kind = rtt

    @property
    def limit(self) -> int:
        return math.floor(self.estimated_limit)

    def on_sample(self, sample: Sample, now: float) -> None:
        rtt: float | None
        if self.rtt_kind == "ttft":
            if sample.e2e_s is not None or sample.ttft_s is None or sample.pending:
                return
            rtt = sample.ttft_s
        else:
            rtt = request_rtt(sample)
        if rtt is None or rtt <= 0:
            return
        self.update(rtt, sample.inflight)

    def update(self, rtt: float, inflight: int) -> None:
        """Gradient2Limit._update with the RTT in seconds (ratios only, so units cancel)."""
        queue_size = float(self.queue_size)
        short = rtt
        self.short_rtt = short
        long = self.long_rtt.add(rtt)
        if long / short > 2:
            # As in Netflix, the gradient below still uses the value before this decay
            # (it is clamped to 1.0 in that case anyway).
            self.long_rtt.value *= 0.9
        if inflight < self.estimated_limit / 2:
            return
        gradient = max(0.5, min(1.0, long / short))
        new = self.estimated_limit * gradient + queue_size
        new = self.estimated_limit * (1 - self.smoothing) + new * self.smoothing
        self.estimated_limit = max(float(self.min_limit), min(float(self.max_limit), new))
