"""`vegas-seed`: the seed document's AdaptiveLimiter, rule for rule (docs/limiter.md).

The Go original keeps time.Duration values (int64 nanoseconds) and converts the EWMA back
to a Duration, which truncates toward zero; this port does the same in integer
nanoseconds so that every intermediate value matches the Go code exactly:

    baseRTT starts at 1 hour, sampleRTT at 0, the limit at minLimit
    OnRequestDone(rtt):
        if rtt < baseRTT: baseRTT = rtt
        sampleRTT = rtt if sampleRTT == 0 else Duration(0.8*sampleRTT + 0.2*rtt)
        queueDelay = sampleRTT - baseRTT;  threshold = baseRTT * alpha   (alpha 0.1)
        if queueDelay < threshold:               limit = min(max, limit + 1)
        elif queueDelay > threshold*(1 + beta):  limit = max(min, limit * 0.8)   (beta 0.2)
    GetLimit() = floor(limit)

The RTT is the whole-request time (`request_rtt`). The seed has no notion of a drop, so
dropped samples (errors, timeouts) are ignored rather than fed in as fast completions.
`initialLimit` from the policy is not used: the seed starts at the minimum.
"""

from __future__ import annotations

import math
from typing import Any, Self

from sluice.core.limiters.base import LimiterBase, LimiterContext, request_rtt
from sluice.core.settings import LimiterSettings
from sluice.core.types import Sample

HOUR_NS = 3_600_000_000_000


class VegasSeedLimiter(LimiterBase):
    @classmethod
    def build(
        cls, settings: LimiterSettings, start: int, context: LimiterContext, **kwargs: Any
    ) -> Self:
        return cls(settings.min_limit, settings.max_limit, **kwargs)  # starts at the minimum

    def __init__(
        self, min_limit: int, max_limit: int, *, alpha: float = 0.1, beta: float = 0.2
    ) -> None:
        if not 1 <= min_limit <= max_limit:
            raise ValueError("need 1 <= min_limit <= max_limit")
        self.min_limit = min_limit
        self.max_limit = max_limit
        self.current_limit = float(min_limit)
        self.base_rtt_ns = HOUR_NS
        self.sample_rtt_ns = 0
        self.alpha = alpha
        self.beta = beta

    @property
    def limit(self) -> int:
        return math.floor(self.current_limit)

    def on_sample(self, sample: Sample, now: float) -> None:
        if sample.dropped:
            return
        rtt = request_rtt(sample)
        if rtt is None:
            return
        self.on_request_done(round(rtt * 1e9))

    def on_request_done(self, rtt_ns: int) -> None:
        """The seed's OnRequestDone, with the RTT in nanoseconds."""
        if rtt_ns < self.base_rtt_ns:
            self.base_rtt_ns = rtt_ns
        if self.sample_rtt_ns == 0:
            self.sample_rtt_ns = rtt_ns
        else:
            # Go: time.Duration(float) truncates toward zero, as int() does.
            self.sample_rtt_ns = int(0.8 * float(self.sample_rtt_ns) + 0.2 * float(rtt_ns))
        queue_delay = float(self.sample_rtt_ns - self.base_rtt_ns)
        threshold = float(self.base_rtt_ns) * self.alpha
        if queue_delay < threshold:
            self.current_limit = min(float(self.max_limit), self.current_limit + 1.0)
        elif queue_delay > threshold * (1.0 + self.beta):
            self.current_limit = max(float(self.min_limit), self.current_limit * 0.8)
