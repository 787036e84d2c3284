"""This gateway's part of a fleet: its share of the requests on the backends it shares
with other replicas, learned from the backends' own metrics.

Several replicas of the gateway (pods behind a Service, `--workers`) each run their own
limiters in front of the same backends and know nothing of one another. A scrape shows a
backend's requests (running + waiting), of which this process knows its own; over all the
backends and scrapes, its own part of what they show is its part of the fleet's traffic,
about 1/R for R replicas behind an even Service. Each replica claims that part of a
backend's free KV room (`SluiceLimiter`, docs/limiter.md "Shared backends"), so that R
replicas claim it once between them, also on a backend that is idle, where a scrape shows
nobody (the burst-start overshoot: R idle replicas each sending a burst's first requests
into the same idle backend).

The estimate is the ratio of two sums over fresh scrapes of busy backends: our requests
the scrape surely shows (those sent before the previous scrape: a scrape shows the engine
as of its last step, so ours sent since may not be in it yet; counting only these keeps
the estimate on the low side) and all requests it shows, both decayed with the time
during which backends were busy (`tau_s`; a gap between busy scrapes counts at most
`max_gap_s`), so an idle fleet keeps what it learned until the next burst. The sums start
from a prior (`prior` weighted as `prior_weight` requests, fading as evidence does):
before any evidence a replica assumes it is one of 1/prior (`expect_peers` sets it from a
count of the live gateway processes, when the shell knows one). A gateway whose scrapes
have shown `ALONE_AFTER` requests and none that could not be its own is alone: share 1,
the whole budget (as before there were fleets).
Pure: time is passed in.
"""

from __future__ import annotations

import math

PRIOR = 1 / 16  # a fresh replica's assumed share: a fleet of up to 16 claims a room once
PRIOR_WEIGHT = 4.0  # the prior counts as this many requests seen
ALONE_AFTER = 4.0  # requests seen, none of them surely another's: a lone gateway
TAU_S = 5.0  # busy seconds over which older evidence fades
MAX_GAP_S = 0.5  # an idle gap between busy scrapes ages the evidence at most this much
MIN_SHARE = 1e-3


class FleetShare:
    __slots__ = (
        "_at",
        "_kept",
        "_on",
        "_others",
        "_own",
        "max_gap_s",
        "prior",
        "prior_weight",
        "tau_s",
    )

    def __init__(
        self,
        prior: float = PRIOR,
        *,
        prior_weight: float = PRIOR_WEIGHT,
        tau_s: float = TAU_S,
        max_gap_s: float = MAX_GAP_S,
    ) -> None:
        if not 0 < prior <= 1:
            raise ValueError("the prior share must be in (0, 1]")
        if prior_weight <= 0 or tau_s <= 0 or max_gap_s < 0:
            raise ValueError("prior_weight and tau_s must be positive, max_gap_s >= 0")
        self.prior = prior
        self.prior_weight = prior_weight
        self.tau_s = tau_s
        self.max_gap_s = max_gap_s
        self._own = 0.0  # evidence: our requests the scrapes surely showed (decayed)
        self._on = 0.0  # ... all requests they showed
        self._others = 0.0  # ... and those that could not be ours
        self._kept = 1.0  # what is left of the prior's weight (it fades like evidence)
        self._at: float | None = None  # the last busy scrape

    @property
    def value(self) -> float:
        """Our estimated part of the fleet's requests, in (0, 1]: exactly 1 once the
        scrapes have shown `ALONE_AFTER` requests and none that could not be ours."""
        if self._on >= ALONE_AFTER and self._others <= 1e-9 * self._on:
            return 1.0
        w = self.prior_weight * self._kept
        return max(MIN_SHARE, min(1.0, (self._own + self.prior * w) / (self._on + w)))

    def observe(self, settled: int, inflight: int, on_backend: float, now: float) -> None:
        """A fresh scrape of one backend: `on_backend` requests there (running +
        waiting); `inflight` of ours in flight to it, `settled` of which were sent before
        the previous scrape (the scrape shows the engine as of its last step: those it
        surely shows, unless they ended there since; the others maybe not yet)."""
        if on_backend <= 0:
            return  # an idle backend says nothing about who else is sending
        if self._at is not None:
            gap = min(self.max_gap_s, max(0.0, now - self._at))
            if gap > 0:
                decay = math.exp(-gap / self.tau_s)
                self._own *= decay
                self._on *= decay
                self._others *= decay
                self._kept *= decay
        self._at = now
        self._own += min(float(settled), on_backend)
        self._on += on_backend
        self._others += max(0.0, on_backend - inflight)

    def expect_peers(self, processes: int) -> None:
        """`processes` gateway processes are known to be alive (Redis's count of them):
        the prior becomes 1/processes (what a replica assumes while evidence is thin)."""
        self.prior = 1.0 / max(1, processes)

    def describe(self) -> dict[str, float]:
        return {"share": self.value, "prior": self.prior, "requests_seen": self._on}
