"""`slo`: Sluice's limiter steered by the classes' own latency objectives.

Everything of `sluice` (SluiceLimiter: the TTFT-against-expected signal, pending TTFT,
drops, the scrape's hard signals, the KV budget, shared backends, the cut and growth
rules) except what the TPOT is held to. `sluice` keeps the TPOT *mean* (an EWMA) under a
fixed 30 ms, whatever the requests on the backend need; `slo` keeps the *95th
percentile* of the per-request TPOT under the tightest TPOT objective among the classes
the backend is serving, less a tail margin (docs/limiter.md, "`slo`", derives it):

    p95 target  = (1 - tail_margin) * min(objective.tpot of the classes being served)
    mean target = (1 - lag_margin) * min(budget bound of the classes being served)
    budget bound = (budget - objective.ttft) / (the class's longest answer here - 1)
    budget       = min(objective.doneWithin, the time its clients give it, X-Request-Timeout)
    cut    when the p95 of the last `tpot_window` TPOT samples (of requests sent after the
           last cut, once there are `min_samples` of them) is above the p95 target, or the
           TPOT EWMA above the mean target
    grow   only while both are at most slo_grow_below x their target

`sluice`'s first-token ratio rules (`ttft`, `ttft-pending`) count only once a first token
takes `calm_share` of the backend's TTFT target (`calm_ttft_s`): sooner, it leaves the
objective most of its room, whatever its ratio to the expected one (docs/limiter.md, "A
first token far inside the objective").

A request's time budget also bounds its TPOT: a 1,000-token answer whose client waits 30 s
needs 29 ms per token whatever the class's TPOT objective says. Such an answer lives long
enough for its TPOT to be the batch's mean step time over half a minute, so it is the
mean that is held to the budget, with the longest answer of the class's last
`length_window` here (once `min_lengths` ended; before, the most tokens its requests
asked for: the first answers to end are the short ones). The longest, not a p99: the
class's 1 % of misses is not spent before the TPOT tail and the TTFT take theirs.

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

The prefill bound (SluiceLimiter.prefill_budget_tokens, which the dispatcher enforces) is
on: the prompt tokens awaiting their first token on the backend are kept to what a TTFT
of (1 - tail_margin) x prefill_share x the policy's tightest TTFT objective allows (0.45 s
with the defaults), whichever classes are being served: a P0 request may come at any
time, and it waits behind the prefill queued before it.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from sluice.core.limiters.base import LimiterContext
from sluice.core.limiters.latency_feedback import SluiceLimiter
from sluice.core.settings import Objective
from sluice.core.types import Sample


class SloLimiter(SluiceLimiter):
    @staticmethod
    def from_context(context: LimiterContext) -> dict[str, Any]:
        """`sluice`'s, and the classes' objectives and what is in flight by class."""
        return {
            **SluiceLimiter.from_context(context),
            "objectives": context.objectives,
            "classes_in_flight": context.classes_in_flight,
        }

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
        length_quantile: float = 1.0,
        ttft_share: float | None = 0.5,
        ttft_window: int = 40,
        prefill_share: float | None = 0.5,
        calm_share: float = 0.5,
        **kwargs: Any,
    ) -> None:
        kwargs.setdefault("cut_from_cap", True)
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
        self.ttft_share = ttft_share
        self.prefill_share = prefill_share
        self.calm_share = calm_share
        # (sent_at, ttft, class) of the last first tokens here
        self._ttfts: deque[tuple[float, float, int]] = deque(maxlen=ttft_window)
        self.length_quantile = length_quantile
        # per class, of its last requests here: output tokens (ended), client budgets and
        # max_tokens (from the first token on)
        self._lengths: dict[int, deque[int]] = {p: deque(maxlen=length_window) for p in range(3)}
        self._budgets: dict[int, deque[float]] = {p: deque(maxlen=length_window) for p in range(3)}
        self._asked: dict[int, deque[int]] = {p: deque(maxlen=length_window) for p in range(3)}

    # -- the objective ----------------------------------------------------------------

    def _note_classes(self, now: float) -> None:
        self._now = now
        if self._classes is None:
            return
        for prio, n in enumerate(self._classes()):
            if n > 0:
                self._last_served[prio] = now

    def serving(self, now: float) -> list[int]:
        """The classes this backend is serving (in flight, or within the hold). Reads only:
        the events record what was in flight (`_note_classes`), so that reading the
        snapshot (`describe`) changes nothing the next decision sees."""
        live = self._classes() if self._classes is not None else ()
        return sorted(
            p
            for p in range(3)
            if (p < len(live) and live[p] > 0)
            or now - self._last_served.get(p, -math.inf) <= self.serving_hold_s
        )

    def budget_bound(self, prio: int) -> float | None:
        """The mean TPOT the class's long answers can take within its time budget:
        (budget - its TTFT objective) / (long - 1), `long` being the longest of its last
        `length_window` answers here once `min_lengths` of them ended, the most tokens
        its requests may ask for (max_tokens) before; None without a budget, and for a
        class whose objective says nothing of its answers' pace or end (neither `tpot`
        nor `doneWithin`: P1's first token within 15 s): its clients' deadlines alone do
        not bound the batch. In `retry-storm` P1's clients wait 20 s, which left
        (20 - 15) / 1023 = 4.9 ms per token for its longest answers, below the engine's
        6 ms at one request: the limit fell to 3 and P0 got 4.7 % of its objective."""
        o = self.objectives.get(prio)
        if o is None or (o.tpot is None and o.done_within is None):
            return None
        budget = o.done_within
        clients = self._budgets.get(prio)
        if clients:
            budget = min(clients) if budget is None else min(budget, min(clients))
        if budget is None:
            return None
        seen = self._lengths.get(prio) or ()
        if len(seen) >= self.min_lengths:
            lengths = sorted(seen)
            long = lengths[max(0, math.ceil(self.length_quantile * len(lengths)) - 1)]
        elif self._asked.get(prio):
            long = max(self._asked[prio])
        else:
            return None
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

    def ttft_target(self, now: float) -> tuple[float, int] | None:
        """(backend TTFT the p95 is kept under, the class it is for): ttft_share of the
        tightest TTFT objective among the classes being served, less the tail margin (the
        rest of the objective is the gateway queue's); None without one."""
        if self.ttft_share is None:
            return None
        best: tuple[float, int] | None = None
        for p in self.serving(now):
            o = self.objectives.get(p)
            if o is not None and o.ttft is not None and (best is None or o.ttft < best[0]):
                best = (o.ttft, p)
        if best is None:
            return None
        return (1.0 - self.tail_margin) * self.ttft_share * best[0], best[1]

    def calm_ttft_s(self, now: float) -> float:
        """`calm_share` of the backend's TTFT target for the tightest class it serves: a
        first token sooner than that leaves the objective most of its room whatever its
        ratio to the expected one (on a CPU engine a batch of 6 has first tokens 3-5x the
        lone one's and 0.1-0.3 s, which the ratio rules cut to a limit of 3 and P0 then
        queued for a second at the gateway: the real mixed flood)."""
        target = self.ttft_target(now)
        return 0.0 if target is None else self.calm_share * target[0]

    def prefill_target_s(self) -> float | None:
        """The prefill bound's target: ttft_share of the tightest TTFT objective of the
        policy, less the tail margin, whether or not its class is being served (a P0
        request may come at any time, and it waits behind the prefill queued before it);
        with none, `sluice`'s."""
        stated = [o.ttft for o in self.objectives.values() if o.ttft is not None]
        if self.prefill_share is None or not stated:
            return super().prefill_target_s()
        return (1.0 - self.tail_margin) * self.prefill_share * min(stated)

    def ttft_p95(self, prio: int) -> float | None:
        """The p95 TTFT of the class's first tokens here sent after the last cut, once
        there are min_samples of them (None before)."""
        values = sorted(t for sent, t, p in self._ttfts if p == prio and sent >= self._last_cut_at)
        if len(values) < self.min_samples:
            return None
        return values[max(0, math.ceil(0.95 * len(values)) - 1)]

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
        self._note_classes(now)
        prio = sample.priority
        if prio in self._lengths and not sample.dropped and not sample.pending:
            first = sample.e2e_s is None
            if first or sample.ttft_s is None:  # once per request: at its first token
                if sample.client_budget_s is not None:
                    self._budgets[prio].append(sample.client_budget_s)
                if sample.max_tokens:
                    self._asked[prio].append(sample.max_tokens)
            if not first and sample.completion_tokens > 0:
                self._lengths[prio].append(sample.completion_tokens)
            if first and sample.ttft_s is not None and prio is not None:
                sent = sample.sent_at if sample.sent_at is not None else now
                self._ttfts.append((sent, sample.ttft_s, prio))
                target = self.ttft_target(now)
                if target is not None and target[1] == prio:
                    p95 = self.ttft_p95(prio)
                    if p95 is not None and p95 > target[0]:
                        self._cut(now, sample.sent_at, "ttft-objective")
                        return
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
        target = self.ttft_target(now)
        if target is not None:
            p95 = self.ttft_p95(target[1])
            if p95 is not None and p95 > self.slo_grow_below * target[0]:
                return False
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

    def on_policy(self, context: LimiterContext) -> None:
        super().on_policy(context)
        self.objectives = dict(context.objectives)

    def describe(self) -> dict[str, object]:
        out = super().describe()
        now = self._now
        out.update(
            {
                "tpot_p95_s": self.tpot_p95(),
                "tpot_objective_s": self.tpot_objective(now),
                "mean_target_s": self.mean_target(now),
                "ttft_target_s": (t := self.ttft_target(now)) and t[0],
                "ttft_p95_s": t and self.ttft_p95(t[1]),
                "budget_bounds_s": {f"P{p}": self.budget_bound(p) for p in range(3)},
                "serving": self.serving(now),
            }
        )
        return out
