"""The P0 reserve sized to P0's own demand (issue 15, the real-vLLM mixed flood).

The policy's `dispatcher.reserved.p0` (0.2) keeps a fixed part of each backend's limit and
KV budget for P0. When P0's own demand is larger (on a small engine whose KV cache holds 7
requests, P0's clients alone keep 4 or 5 in flight), P1 and P2 fill the rest and each P0
arrival waits for one of their slots to free: P0 missed its TTFT in the mixed flood while
P1 held most of the engine. So the reserve is the larger of the policy's and P0's demand
(P0 requests in flight plus P0 requests queued, plus one for the next arrival) over the
limits in force, the demand's peak held for `hold_s` so that a P0 lull between two
requests of a closed-loop client does not hand its slot to P1; at most `most` of the
limit, so that lower classes keep a part (and at least one slot per backend: low_cap).
Pure: the caller passes the time."""

from __future__ import annotations

import math


class P0Reserve:
    def __init__(self, floor: float, *, hold_s: float = 10.0, most: float = 0.75) -> None:
        self.floor = floor
        self.hold_s = hold_s
        self.most = most
        self._peak = 0.0
        self._peak_at = -math.inf

    def update(self, p0_demand: float, limit_total: int, now: float) -> float:
        """The reserved share of the limit for P0, given P0's requests in flight and
        queued now and the sum of the backends' limits."""
        if p0_demand >= self._peak or now - self._peak_at > self.hold_s:
            self._peak, self._peak_at = p0_demand, now
        if limit_total <= 0 or self._peak <= 0:
            return self.floor
        wanted = (self._peak + 1.0) / limit_total
        return max(self.floor, min(self.most, wanted))
