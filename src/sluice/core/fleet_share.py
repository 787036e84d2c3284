"""This gateway's part of a fleet: its share of the requests on the backends it shares
with other replicas, learned from the backends' own metrics.

Several replicas of the gateway (pods behind a Service, `--workers`) each run their own
limiters in front of the same backends and know nothing of one another. A scrape shows a
backend's requests (running + waiting), of which this process knows its own; over all the
backends and scrapes, its own part of what they show is its part of the fleet's traffic,
about 1/R for R replicas behind an even Service. Each replica claims that part of a
backend's free KV room (`KvBudget`, docs/limiter.md "Shared backends"), so that R
replicas claim it once between them, also on a backend that is idle, where a scrape shows
nobody (the burst-start overshoot: R idle replicas each sending a burst's first requests
into the same idle backend).

When the shell knows how many gateway processes are alive (`--workers N`, the policy's
`fleet.gateways` times that; Redis's count of the processes sharing the quotas,
gateway/shared_quota.py) the share is 1/N: the replicas' claims then add up to the room,
whatever each holds.

Else it is estimated, as the ratio of two sums over fresh scrapes of busy backends: our
requests there (those in flight, at most what the scrape shows) and all requests it
shows, both decayed with the time during which backends were busy (`tau_s`; a gap
between busy scrapes counts at most `max_gap_s`), so an idle fleet keeps what it learned
until the next burst. Ours sent since the engine's last step are counted although the
scrape may not show them yet: over replicas the estimates then add up to about 1
(counting only those sent before the previous scrape left the fleet claiming 70 % of a
backend at a 250 ms scrape, and a lone gateway at 0.56). The sums start from a prior
(`prior` weighted as `prior_weight` requests, fading as evidence does), and the share is
never below it: the estimate follows what a replica holds, so one that holds little (a
replacement in a rolling update, one the others outgrew) would claim ever less and hold
ever less. An estimate is no count: replicas that outgrew the others keep their larger
estimates (`sluice bench fleet` without the count saw 0.06 to 0.3 among 8), which is why
the count wins when there is one.

A gateway whose scrapes have shown `ALONE_AFTER` requests of which at most `ALONE_STRAY`
could not be its own is alone: share 1, the whole budget (as before there were fleets).
A request of ours that left since the previous scrape may still be in it (an abort the
engine has not processed yet): not another replica's. Before this was counted, and with
no tolerance, one such stray kept a lone gateway from being alone for good (the stray and
the sums fade at the same rate: their ratio never went back to 0), at the share its
scrapes gave (0.56 in `sluice bench fleet`'s one gateway).
Pure: time is passed in.
"""

from __future__ import annotations

import math

from sluice.core.snapshot import FleetSnapshot

PRIOR = 1 / 16  # a fresh replica's assumed share: a fleet of up to 16 claims a room once
PRIOR_WEIGHT = 4.0  # the prior counts as this many requests seen
ALONE_AFTER = 4.0  # requests seen, (almost) none of them surely another's: a lone gateway
ALONE_STRAY = 0.02  # ... at most this part of them: a stray abort, not a peer
TAU_S = 5.0  # busy seconds over which older evidence fades
MAX_GAP_S = 0.5  # an idle gap between busy scrapes ages the evidence at most this much


class FleetShare:
    __slots__ = (
        "_at",
        "_kept",
        "_learned_prior",
        "_on",
        "_others",
        "_own",
        "_processes",
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
        self._learned_prior = prior  # the prior again when a count is withdrawn
        self.prior_weight = prior_weight
        self.tau_s = tau_s
        self.max_gap_s = max_gap_s
        self._own = 0.0  # evidence: our requests the scrapes showed (decayed)
        self._on = 0.0  # ... all requests they showed
        self._others = 0.0  # ... and those that could not be ours
        self._kept = 1.0  # what is left of the prior's weight (it fades like evidence)
        self._at: float | None = None  # the last busy scrape
        self._processes: int | None = None  # the live gateway processes, when told

    @property
    def value(self) -> float:
        """Our part of the fleet, in (0, 1]: 1/N when N live processes are known;
        else exactly 1 once the scrapes have shown `ALONE_AFTER` requests and (almost)
        none that could not be ours; else the estimate, never below the prior."""
        if self._processes is not None:
            return 1.0 / self._processes
        if self._on >= ALONE_AFTER and self._others <= ALONE_STRAY * self._on:
            return 1.0
        return max(self.prior, self.estimate)

    @property
    def fresh(self) -> bool:
        """Nothing known of the fleet yet: no count, no scrape that showed a request."""
        return self._processes is None and self._on <= 0

    @property
    def estimate(self) -> float:
        """What the scrapes say: our requests over all they showed, from the prior."""
        w = self.prior_weight * self._kept
        return min(1.0, (self._own + self.prior * w) / (self._on + w))

    def observe(self, inflight: int, left: int, on_backend: float, now: float) -> None:
        """A fresh scrape of one backend: `on_backend` requests there (running +
        waiting); `inflight` of ours in flight to it, and `left` of ours that left it
        since the previous scrape (it may still show them: an abort the engine has not
        processed yet)."""
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
        self._own += min(float(inflight), on_backend)
        self._on += on_backend
        self._others += max(0.0, on_backend - inflight - left)

    def expect_peers(self, processes: int | None) -> None:
        """`processes` gateway processes are known to be alive (`--workers`, the policy's
        `fleet.gateways`, Redis's count of them): the share is 1/processes, whatever the
        scrapes say. None: no count any more (a reloaded policy dropped it); the share is
        learned again, from the evidence kept."""
        if processes is None:
            self._processes = None
            self.prior = self._learned_prior
            return
        self._processes = max(1, processes)
        self.prior = 1.0 / self._processes

    def describe(self) -> FleetSnapshot:
        return FleetSnapshot(
            share=self.value,
            estimate=round(self.estimate, 4),
            prior=self.prior,
            processes=self._processes,
            requests_seen=self._on,
        )
