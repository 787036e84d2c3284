"""`slo`: Sluice's limiter steered by the classes' own latency objectives.

Everything of `sluice` (SluiceLimiter: the TTFT-against-expected signal, pending TTFT,
drops, the scrape's hard signals, the KV budget, shared backends, the cut and growth
rules) except what the TPOT is held to. `sluice` keeps the TPOT *mean* (an EWMA) under a
fixed 30 ms, whatever the requests on the backend need; `slo` keeps the *95th
percentile* of the per-request TPOT under the tightest TPOT objective among the classes
the backend is serving, less a tail margin (docs/limiter.md, "`slo`", derives it):

    p95 target  = (1 - tail_margin) * min(objective.tpot of the classes being served)
    mean target = (1 - lag_margin) * min(budget bound of the classes being served)
    budget bound = (budget - objective.ttft) / (p99 of the class's output tokens - 1)
    budget       = min(objective.doneWithin, the time its clients give it, X-Request-Timeout)
    cut    when the p95 of the last `tpot_window` TPOT samples (of requests sent after the
           last cut, once there are `min_samples` of them) is above the p95 target, or the
           TPOT EWMA above the mean target
    grow   only while both are at most slo_grow_below x their target

A request's time budget also bounds its TPOT: a 1,000-token answer whose client waits 30 s
needs 29 ms per token whatever the class's TPOT objective says. Such an answer lives long
enough for its TPOT to be the batch's mean step time over half a minute, so it is the
mean that is held to the budget, with the long answers the class has been seen to give
(the 99th percentile of the last `length_window` of its output lengths here, once there
are `min_lengths`).

A class is being served while it has a request in flight on the backend and for
`serving_hold_s` after its last one left (a class that sends now and then is still
being served between its requests). When no class being served has a TPOT objective,
the target is `lenient_ratio` x the tightest TPOT objective of the policy: the batch
grows toward what the engine can hold (the KV budget and the other signals still apply),
but a class with a TPOT objective that comes back finds a batch that one cut and the
requests' own ends bring back under its objective (no preemption: the requests in
flight keep running).

Every request in a backend's batch gets the same step times, so any class's TPOT
sample measures the batch: the window holds them all.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from sluice.config import Objective
from sluice.core.limiters.sluice import SluiceLimiter
from sluice.core.types import Sample


class SloLimiter(SluiceLimiter):
    def __init__(
        self,
        min_limit: int,
        max_limit: int,
        initial_limit: int,
        *,
        objectives: Mapping[int, Objective],
        classes_in_flight: Callable[[], Sequence[int]] | None = None,
        tail_margin: float = 0.1,
        lag_margin: float = 0.05,
        tpot_window: int = 40,
        min_samples: int = 8,
        slo_grow_below: float = 0.9,
        serving_hold_s: float = 10.0,
        lenient_ratio: float = 2.0,
        length_window: int = 200,
        min_lengths: int = 20,
        length_quantile: float = 0.99,
        **kwargs: Any,
    ) -> None:
        super().__init__(min_limit, max_limit, initial_limit, **kwargs)
        if not 0 <= tail_margin < 1:
            raise ValueError("tail_margin must be in [0, 1)")
        if not 1 <= min_samples <= tpot_window:
            raise ValueError("need 1 <= min_samples <= tpot_window")
        self.objectives = dict(objectives)
        self._classes = classes_in_flight
        self.tail_margin = tail_margin
        self.lag_margin = lag_margin
        self.min_samples = min_samples
        self.slo_grow_below = slo_grow_below
        self.serving_hold_s = serving_hold_s
        self.lenient_ratio = lenient_ratio
        # (sent_at, tpot) of the last requests that ended here
        self._window: deque[tuple[float, float]] = deque(maxlen=tpot_window)
        self._last_served: dict[int, float] = {}  # class -> last time it had one in flight
        self._now = 0.0  # of the last event (for describe)
        self.min_lengths = min_lengths
        self.length_quantile = length_quantile
        # per class: (output tokens, client budget or None) of its last requests here
        self._lengths: dict[int, deque[tuple[int, float | None]]] = {
            p: deque(maxlen=length_window) for p in range(3)
        }

    # -- the objective ----------------------------------------------------------------

    def _note_classes(self, now: float) -> None:
        self._now = now
        if self._classes is None:
            return
        for prio, n in enumerate(self._classes()):
            if n > 0:
                self._last_served[prio] = now

    def serving(self, now: float) -> list[int]:
        """The classes this backend is serving (in flight, or within the hold)."""
        self._note_classes(now)
        return sorted(p for p, t in self._last_served.items() if now - t <= self.serving_hold_s)

    def budget_bound(self, prio: int) -> float | None:
        """The mean TPOT the class's long answers can take within its time budget:
        (budget - its TTFT objective) / (the p99 of its output tokens here - 1); None
        without a budget or before `min_lengths` of its answers ended here."""
        o = self.objectives.get(prio)
        seen = self._lengths.get(prio)
        if seen is None or len(seen) < self.min_lengths:
            return None
        budget = None if o is None else o.done_within
        clients = [b for _, b in seen if b is not None]
        if clients:
            budget = min(clients) if budget is None else min(budget, min(clients))
        if budget is None:
            return None
        lengths = sorted(n for n, _ in seen)
        long = lengths[max(0, math.ceil(self.length_quantile * len(lengths)) - 1)]
        head = 0.0 if o is None or o.ttft is None else o.ttft
        if long < 2 or budget <= head:
            return None
        return (budget - head) / (long - 1)

    def tpot_objective(self, now: float) -> float | None:
        """The tightest TPOT objective among the classes being served; with none of them
        stating one, lenient_ratio x the policy's tightest (None: the policy has none)."""
        stated = [o.tpot for o in self.objectives.values() if o.tpot is not None]
        if not stated:
            return None
        served = [
            o.tpot
            for p in self.serving(now)
            if (o := self.objectives.get(p)) is not None and o.tpot is not None
        ]
        return min(served) if served else self.lenient_ratio * min(stated)

    def tpot_target(self, now: float) -> float:
        """The TPOT the p95 is kept under (the objective less the tail margin); with no
        TPOT objective in the policy, `sluice`'s target."""
        objective = self.tpot_objective(now)
        if objective is None:
            return super().tpot_target(now)
        return (1.0 - self.tail_margin) * objective

    def mean_target(self, now: float) -> float | None:
        """The TPOT the mean (EWMA) is kept under: the tightest budget bound among the
        classes being served, less the lag margin (None: none of them has one)."""
        bounds = [b for p in self.serving(now) if (b := self.budget_bound(p)) is not None]
        return (1.0 - self.lag_margin) * min(bounds) if bounds else None

    def tpot_p95(self) -> float | None:
        """The p95 of the window's TPOT samples sent after the last cut, once there are
        min_samples of them; else of the whole window (None: empty)."""
        fresh = [t for sent, t in self._window if sent >= self._last_cut_at]
        values = fresh if len(fresh) >= self.min_samples else [t for _, t in self._window]
        if not values:
            return None
        values.sort()
        return values[max(0, math.ceil(0.95 * len(values)) - 1)]

    def _fresh_count(self) -> int:
        return sum(1 for sent, _ in self._window if sent >= self._last_cut_at)

    # -- the hooks SluiceLimiter calls --------------------------------------------------

    def on_sample(self, sample: Sample, now: float) -> None:
        if (
            sample.e2e_s is not None
            and not sample.dropped
            and sample.priority in self._lengths
            and sample.completion_tokens > 0
        ):
            self._lengths[sample.priority].append(
                (sample.completion_tokens, sample.client_budget_s)
            )
        super().on_sample(sample, now)

    def _tpot_too_slow(self, sample: Sample, now: float) -> bool:
        sent = sample.sent_at if sample.sent_at is not None else now
        self._window.append((sent, sample.tpot_s or 0.0))
        mean = self.mean_target(now)
        if mean is not None and (self._tpot.value or 0.0) > mean:
            return True
        if self._fresh_count() < self.min_samples:
            return False  # not enough about the limit in force yet
        p95 = self.tpot_p95()
        return p95 is not None and p95 > self.tpot_target(now)

    def _tpot_allows_growth(self, now: float) -> bool:
        mean = self.mean_target(now)
        ewma = self._tpot.value
        if mean is not None and ewma is not None and ewma > self.slo_grow_below * mean:
            return False
        p95 = self.tpot_p95()
        return p95 is None or p95 <= self.slo_grow_below * self.tpot_target(now)

    def on_dispatch(self, inflight: int, footprint_tokens: int, now: float) -> None:
        self._note_classes(now)
        super().on_dispatch(inflight, footprint_tokens, now)

    def on_release(self, inflight: int, now: float) -> None:
        self._note_classes(now)
        super().on_release(inflight, now)

    def describe(self) -> dict[str, object]:
        out = super().describe()
        now = self._now
        out.update(
            {
                "tpot_p95_s": self.tpot_p95(),
                "tpot_objective_s": self.tpot_objective(now),
                "mean_target_s": self.mean_target(now),
                "budget_bounds_s": {f"P{p}": self.budget_bound(p) for p in range(3)},
                "serving": self.serving(now),
            }
        )
        return out
