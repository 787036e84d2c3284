"""`sluice`: the latency-feedback rules `slo` (the default) builds on, with a fixed TPOT target
(docs/limiter.md explains the design and why).

Signals, from fastest to slowest:
  * TTFT of each request at its first token, against what the backend's current state
    explains: E = step_wait * step + base * (prefill_ahead + prompt_tokens + fixed), where
    `step` is the TPOT EWMA (the engine's current step time: a new request waits for the
    step in progress, then its prefill shares steps with the running decodes),
    `prefill_ahead` the prompt tokens sent to the backend before it still without a first
    token (a short prompt behind a long one waits for that prefill: head-of-line
    blocking, not congestion), and `base` the per-token TTFT of a request's own prompt,
    a windowed minimum re-measured every probe interval with jitter (never a minimum kept
    forever). The
    ratio x = ttft / E is about 1 without queueing at any load; its EWMA `short` jumps
    when the backend starts queueing requests.
  * A pending TTFT: a request still without its first token after ttft_alarm_ratio * E;
    the controller reports it, so a backend that starts queueing is seen before its first
    slow answer returns.
  * TPOT of each request at its end (EWMA), against a target: the larger of
    `tpot_target_s` (30 ms: the EWMA is a mean, kept well inside the 100 ms interactive
    SLO so that its tail and long answers stay inside too) and tpot_base_ratio * its
    windowed-min base (a slow model is not held at the minimum), that base never above
    the lowest TPOT seen over the last `tpot_floor_s` (5 min) for the same request mix:
    sustained load raises the windowed minimum (no light moment left in a window), which
    would raise the target with the load it should hold back (after a burst whose refused
    clients came back at once, 3 x a base of 20 ms let TPOT reach 35 ms and 1,000-token P0
    answers miss their 30 s deadline). A new mix has a new base: when the mean footprint
    of the requests sent (a slow EWMA) moves by more than `tpot_floor_mix` x from the one
    the floor was learned with (prompts of 500 tokens become 4,000), the floor starts
    over.
  * Drops (error, timeout, backend refusal).
  * Each metrics scrape: waiting > waiting_tolerance on two scrapes in a row (a request
    that arrived since the last engine step is waiting for a moment at any load), KV
    usage >= kv_high, a rising
    preemption counter, or (when waiting is not exported) more requests in flight than
    the backend runs: hard congestion.

Control:
  * Cut (limit *= decrease) when: short > ttft_jump (queueing starts), a pending TTFT,
    TPOT EWMA > its target, a drop, or hard congestion. At most once per
    `cut_interval_s`; a latency or drop sample only cuts when its request was sent after
    the last cut (older ones describe the old limit); a hard signal only cuts when
    in-flight <= limit (the last cut has taken effect). One burst of bad signals costs one
    cut, not a collapse to the minimum. With `cut_from_cap` (`slo` sets it), a cut the KV
    or engine cap would absorb (limit x decrease still above the cap) is taken from the
    cap: the limit in force comes down.
  * Grow only on a good first-token sample (short <= ttft_grow_below, TPOT EWMA <=
    tpot_grow_below * target, no hard signal in the last scrape, KV usage below kv_low)
    and only while in-flight >= near_limit * usable_share * limit (usable_share = 1 -
    reserved.p0: what queued P1/P2 requests may fill): +1 per sample until the first cut
    (slow start: the limit can follow the arrivals), then +min(1, growth / sqrt(limit)).
  * KV budget (core/kv_budget.py, `KvBudget`): when the backend reports its KV capacity,
    in-flight estimated KV tokens may not exceed kv_budget_fraction of capacity (the
    dispatcher checks it per request), and the limit is also capped at budget / footprint,
    the footprint being the larger of the EWMA of the requests dispatched here and, when the
    controller provides it (`demand_footprint`), the EWMA of the requests being admitted for
    this backend's models: the mix that comes next. So the limit falls as soon as long
    prompts arrive, not once the short ones queued before them have been sent, and rises
    back only once the long ones queued have been sent.
  * Prefill bound (off unless `prefill_ttft_s` is set; `slo` sets its own): the prompt
    tokens awaiting their first token on the backend may not exceed what the expected
    TTFT formula above allows within that target, with the lowest per-token TTFT of the
    last `tpot_floor_s` (the dispatcher checks it per request).
  * Engine cap: an engine that refuses requests beyond a number in flight (TGI's
    max_concurrent_requests, from its /info) caps the limit there.
  * Shared backends (several gateway replicas, each with its own limiters): the budget
    is this replica's claim on the room the others leave, from each fresh scrape, and the
    limit in requests the claim over our footprint rounded up (core/kv_budget.py has the
    rule and docs/limiter.md why). A lone gateway (share 1) has the whole budget.
"""

from __future__ import annotations

import math
import random
from collections import deque
from collections.abc import Callable
from typing import Any, Self

from sluice.core.ewma import Ewma
from sluice.core.kv_budget import KvBudget, SharedRoom
from sluice.core.limiters.base import KV_CUT, LimiterBase, LimiterContext
from sluice.core.limiters.windowed_min import WindowedMin
from sluice.core.settings import LimiterSettings
from sluice.core.types import BackendMetrics, Sample


class SluiceLimiter(LimiterBase):
    @classmethod
    def build(
        cls, settings: LimiterSettings, start: int, context: LimiterContext, **kwargs: Any
    ) -> Self:
        tuning = {**cls.from_context(context), **kwargs}
        return cls(settings.min_limit, settings.max_limit, start, **tuning)

    @staticmethod
    def from_context(context: LimiterContext) -> dict[str, Any]:
        """What it takes of the controller: its seed, the usable share, the admitted
        footprint (tuning keyword arguments may override any)."""
        return {
            "seed": context.seed,
            "usable_share": context.usable_share,
            "demand_footprint": context.demand_footprint,
        }

    def __init__(
        self,
        min_limit: int,
        max_limit: int,
        initial_limit: int,
        *,
        prompt_fixed_tokens: float = 64.0,
        step_wait: float = 1.5,
        ttft_alpha: float = 0.5,
        ttft_grow_below: float = 1.5,
        ttft_jump: float = 3.0,
        ttft_alarm_ratio: float = 4.0,
        tpot_alpha: float = 0.3,
        tpot_target_s: float = 0.03,
        tpot_base_ratio: float = 3.0,
        tpot_grow_below: float = 0.8,
        tpot_floor_s: float = 300.0,
        tpot_floor_mix: float = 1.5,
        decrease: float = 0.8,
        cut_interval_s: float = 0.25,
        near_limit: float = 0.8,
        usable_share: float = 1.0,
        growth: float = 4.0,
        probe_interval_s: float = 30.0,
        probe_jitter: float = 0.5,
        kv_high: float = 0.9,
        kv_low: float = 0.8,
        waiting_tolerance: float = 0.0,
        kv_budget_fraction: float = 0.8,
        footprint_alpha: float = 0.5,
        fleet_prior_requests: float = 4.0,
        demand_footprint: Callable[[], float | None] | None = None,
        prefill_ttft_s: float | None = None,
        cut_from_cap: bool = False,
        lone_window: int = 8,
        seed: int | str = 0,
    ) -> None:
        if not 1 <= min_limit <= initial_limit <= max_limit:
            raise ValueError("need 1 <= min_limit <= initial_limit <= max_limit")
        if not 0 < decrease < 1:
            raise ValueError("decrease must be in (0, 1)")
        self.min_limit = min_limit
        self.max_limit = max_limit
        self.prompt_fixed_tokens = prompt_fixed_tokens
        self.step_wait = step_wait
        self.ttft_grow_below = ttft_grow_below
        self.ttft_jump = ttft_jump
        self.ttft_alarm_ratio = ttft_alarm_ratio
        self.tpot_target_s = tpot_target_s
        self.tpot_base_ratio = tpot_base_ratio
        self.tpot_grow_below = tpot_grow_below
        self.decrease = decrease
        self.cut_interval_s = cut_interval_s
        self.near_limit = near_limit
        # the share of the limit queued P1/P2 requests may use (1 - reserved.p0): "near
        # the limit" is judged against it, or an idle P0 reservation would stop growth
        self.usable_share = usable_share
        self.growth = growth
        self.kv_high = kv_high
        self.kv_low = kv_low
        self.waiting_tolerance = waiting_tolerance
        self._waiting_before = False
        self.prefill_ttft_s = prefill_ttft_s
        self.cut_from_cap = cut_from_cap
        # x of the last first tokens of requests that had the backend to themselves (sent
        # alone, nothing ahead), with their times: what the host does with no load of ours
        self._lone: deque[tuple[float, float]] = deque(maxlen=lone_window)
        self._now_seen = 0.0  # the last event's time (the alarm is asked without one)

        rng = random.Random(seed)
        self._ttft_base = WindowedMin(probe_interval_s, probe_jitter, rng)
        self._tpot_base = WindowedMin(probe_interval_s, probe_jitter, rng)
        # its own generator: the windows above keep the draws they had
        self._floor_rng = random.Random(f"{seed}/tpot-floor")
        self._tpot_floor = WindowedMin(tpot_floor_s, 0.0, self._floor_rng)
        self.tpot_floor_s = tpot_floor_s
        self.tpot_floor_mix = tpot_floor_mix
        self._mix = Ewma(0.02)  # mean footprint of the requests sent, slowly
        self._floor_mix: float | None = None  # ... when the floor started
        # the engine's prefill time per prompt token, its lowest over `tpot_floor_s`: the
        # TTFT base rises under sustained load (every first token then waits for a step
        # and a queue), which would shrink the prefill budget with the load it serves
        self._prefill_per_token = WindowedMin(tpot_floor_s, 0.0, random.Random(f"{seed}/pf"))
        self._ttft = Ewma(ttft_alpha)  # of x = ttft / expected ttft
        self._tpot = Ewma(tpot_alpha)
        # the KV budget and, on a shared backend, this replica's claim on it
        self._kv = KvBudget(
            kv_budget_fraction,
            footprint_alpha=footprint_alpha,
            fleet_prior_requests=fleet_prior_requests,
            demand_footprint=demand_footprint,
            seed=seed,
        )

        self._limit = float(initial_limit)
        self._effective = initial_limit
        self._cap = math.inf  # the KV and engine caps on the limit (inf: none)
        self._slow_start = True
        self._last_cut_at = -math.inf
        self._inflight = 0
        self._kv_usage: float | None = None
        self._hard = False  # the last scrape showed hard congestion
        self._preemptions_seen: float | None = None
        self._engine_cap: int | None = None  # requests the engine accepts at once
        self.cuts = 0  # how many times the limit was cut (for tests and the snapshot)
        self._last_cut_reason = ""
        self.cut_reasons: dict[str, int] = {}

    # -- what the controller reads ---------------------------------------------------

    @property
    def limit(self) -> int:
        return self._effective

    @property
    def kv_budget_tokens(self) -> float | None:
        return self._kv.tokens

    def prefill_target_s(self) -> float | None:
        """The backend TTFT the prefill bound keeps a request's wait under (None: none)."""
        return self.prefill_ttft_s

    @property
    def prefill_budget_tokens(self) -> float | None:
        """Prompt tokens that may await their first token on the backend: the prefill
        whose expected TTFT (`expected_ttft`) is the prefill target; None before the
        first TTFT (no base yet) or without a target."""
        target = self.prefill_target_s()
        base = self._prefill_per_token.peek()
        if target is None or not base:
            return None
        step = self._tpot.value or 0.0
        return max(0.0, (target - self.step_wait * step) / base - self.prompt_fixed_tokens)

    @property
    def kv_shared(self) -> SharedRoom | None:
        return self._kv.shared

    @property
    def latency_limit(self) -> float:
        """The limit before the KV cap (what bounded outputs may fill up to), within what
        the engine accepts at once (TGI's max_concurrent_requests: it refuses past it)."""
        cap = self._engine_cap
        return min(self._limit, float(cap)) if cap else self._limit

    @property
    def last_cut_at(self) -> float:
        return self._last_cut_at

    @property
    def last_cut_reason(self) -> str:
        return self._last_cut_reason

    @property
    def ttft_base(self) -> float | None:
        """Base normalised TTFT in seconds per token (for inspection)."""
        return self._ttft_base.peek()

    @property
    def ttft_ratio(self) -> float | None:
        """EWMA of TTFT over its expected value (for inspection)."""
        return self._ttft.value

    def expected_ttft(self, prefill_tokens: float) -> float | None:
        """TTFT the backend's state explains for a request waiting for this prefill (its
        own prompt and the prefill ahead of it); None before any TTFT was seen."""
        base = self._ttft_base.peek()
        return None if base is None else self._expected(prefill_tokens, base)

    def _expected(self, prefill_tokens: float, base: float) -> float:
        step = self._tpot.value or 0.0
        return self.step_wait * step + base * (prefill_tokens + self.prompt_fixed_tokens)

    def host_factor(self, now: float) -> float:
        """How much slower than the windowed best the host makes a first token with none of
        our load on it: the median x of the last `lone_window` first tokens of requests
        that were alone on the backend (within `tpot_floor_s`), over `ttft_grow_below` (the
        spread of x without queueing), at least 1. An engine sharing its cores with other
        work (a CPU engine beside a pooling engine, the gateway and its clients) answers a
        lone request 3-12x slower than its best; fewer requests cannot shorten that, so
        the first-token signals are judged against it."""
        xs = sorted(x for t, x in self._lone if now - t <= self.tpot_floor_s)
        if not xs:
            return 1.0
        return max(1.0, xs[len(xs) // 2] / self.ttft_grow_below)

    def tpot_target(self, now: float) -> float:
        """TPOT above which the limit is cut."""
        base = self._tpot_base.value(now)
        floor = self._tpot_floor.value(now)
        if base is not None and floor is not None:
            base = min(base, floor)
        rel = 0.0 if base is None else base * self.tpot_base_ratio
        return max(self.tpot_target_s, rel)

    def _tpot_too_slow(self, sample: Sample, now: float) -> bool:
        """After a TPOT sample (already in the EWMA): is the backend too slow per token?"""
        return (self._tpot.value or 0.0) > self.tpot_target(now)

    def _tpot_allows_growth(self, now: float) -> bool:
        tpot = self._tpot.value
        return tpot is None or tpot <= self.tpot_grow_below * self.tpot_target(now)

    def on_fleet(self, own_kv_tokens: float, share: float, share_fresh: bool) -> None:
        self._kv.on_fleet(own_kv_tokens, share, share_fresh)

    def on_policy(self, context: LimiterContext) -> None:
        self.usable_share = context.usable_share

    def describe(self) -> dict[str, object]:
        """Internal state for the snapshot (JSON-able)."""
        return {
            "latency_limit": self._limit,
            "slow_start": self._slow_start,
            "cuts": self.cuts,
            "last_cut_reason": self.last_cut_reason,
            "cut_reasons": dict(self.cut_reasons),
            "ttft_base_s_per_token": self._ttft_base.peek(),
            "ttft_ratio_ewma": self._ttft.value,
            "host_factor": self.host_factor(self._now_seen),
            "tpot_base_s": self._tpot_base.peek(),
            "tpot_ewma_s": self._tpot.value,
            "kv_capacity_tokens": self._kv.capacity,
            "kv_budget_tokens": self.kv_budget_tokens,
            "prefill_budget_tokens": self.prefill_budget_tokens,
            "footprint_dispatched": self._kv.footprint_dispatched,
            "footprint_admitted": None if self._kv.demand is None else self._kv.demand(),
        }

    def ttft_alarm_after(self, prefill_tokens: float) -> float | None:
        expected = self.expected_ttft(prefill_tokens)
        if expected is None:
            return None
        alarm = self.ttft_alarm_ratio * expected * self.host_factor(self._now_seen)
        return max(alarm, self.calm_ttft_s(self._now_seen))

    def calm_ttft_s(self, now: float) -> float:
        """A first token sooner than this is no queueing signal, whatever its ratio to the
        expected one (0 here: every ratio counts; `slo` sets it from the objectives)."""
        return 0.0

    # -- inputs ----------------------------------------------------------------------

    def on_dispatch(self, inflight: int, footprint_tokens: int, now: float) -> None:
        self._inflight = inflight
        self._now_seen = now
        self._kv.on_dispatch(footprint_tokens)
        mix = self._mix.update(float(footprint_tokens))
        if self._floor_mix is None:
            self._floor_mix = mix
        elif (
            not self._floor_mix / self.tpot_floor_mix
            <= mix
            <= self._floor_mix * self.tpot_floor_mix
        ):
            self._tpot_floor = WindowedMin(self.tpot_floor_s, 0.0, self._floor_rng)
            self._floor_mix = mix
        if self._kv.capacity is not None:
            self._recompute()

    def on_release(self, inflight: int, now: float) -> None:
        self._inflight = inflight
        kv = self._kv
        if kv.demand is not None and kv.capacity is not None:
            self._recompute()  # the admitted mix may have changed since the last event

    def on_sample(self, sample: Sample, now: float) -> None:
        self._now_seen = now
        if sample.dropped:
            self._cut(now, sample.sent_at, "drop")
            return
        if sample.pending:
            self._cut(now, sample.sent_at, "ttft-pending")
            return
        if sample.e2e_s is None:
            if sample.ttft_s is not None:
                self._on_ttft(sample, now)
            return
        if sample.tpot_s is not None and sample.tpot_s > 0:
            if not sample.stalled_s:  # a floor learns from uncorrected times only
                self._tpot_base.update(sample.tpot_s, now)
                self._tpot_floor.update(sample.tpot_s, now)
            self._tpot.update(sample.tpot_s)
            if self._tpot_too_slow(sample, now):
                self._cut(now, sample.sent_at, "tpot")
                return
        if sample.ttft_s is None:
            # No first-token sample came for this request (non-streaming): the end is its
            # only chance to count as evidence that the limit can grow.
            self._maybe_grow(now)

    def _on_ttft(self, sample: Sample, now: float) -> None:
        ttft: float = sample.ttft_s  # type: ignore[assignment]
        work = sample.prompt_tokens + sample.prefill_ahead
        # judged against the base before this sample (a jump is not its own base), once
        # the base window has moved on to `now`
        base = self._ttft_base.value(now)
        # the base learns from the request's own prompt only: an engine that prefills
        # several prompts in one step would otherwise drag it toward zero
        per_token = ttft / (sample.prompt_tokens + self.prompt_fixed_tokens)
        if not sample.stalled_s:
            # A floor learns from uncorrected times only: a stall correction that took
            # more than the host's pause (the engine ran on while this process waited
            # for a CPU) made first tokens of ~0 s, whose minimum became the base, every
            # first token then 100-1,000x "expected" and overdue (the chat limit pinned
            # at 1 by `ttft-pending` cuts in the real mixed flood).
            self._ttft_base.update(per_token, now)
            self._prefill_per_token.update(per_token, now)
        if not base:
            return
        expected = self._expected(work, base)
        x = ttft / expected
        if sample.inflight == 1 and sample.prefill_ahead <= 0 and not sample.stalled_s:
            self._lone.append((now, x))  # alone (0 ahead: not known), uncorrected
        short = self._ttft.update(x)
        host = self.host_factor(now)
        if short > self.ttft_jump * host:
            if ttft >= self.calm_ttft_s(now):
                self._cut(now, sample.sent_at, "ttft")
        elif short <= self.ttft_grow_below * host:
            self._maybe_grow(now)

    def on_metrics(self, m: BackendMetrics, now: float) -> None:
        self._kv.on_metrics(m, self._inflight)
        self._kv_usage = m.kv_usage
        self._engine_cap = m.max_concurrency
        reason = ""
        # A request that arrived since the engine's last step shows as waiting until the
        # next one: normal at any load. Queueing is waiting seen on two scrapes in a row.
        waiting = m.waiting is not None and m.waiting > self.waiting_tolerance
        if waiting and self._waiting_before:
            reason = "waiting"
        elif m.kv_usage is not None and m.kv_usage >= self.kv_high:
            reason = KV_CUT
        elif (
            m.waiting is None
            and m.running is not None
            and self._inflight - m.running > max(2.0, 0.1 * self._inflight)
        ):
            reason = "inflight>running"
        if m.preemptions_total is not None:
            seen = self._preemptions_seen
            if seen is not None and m.preemptions_total > seen and not reason:
                reason = "preemption"
            self._preemptions_seen = m.preemptions_total
        self._waiting_before = waiting
        # A single waiting scrape does not cut, but it is no time to grow either.
        self._hard = bool(reason) or waiting
        if reason and self._inflight <= self._effective:
            self._cut(now, None, reason)
        self._recompute()

    def on_metrics_stale(self, now: float) -> None:
        # Latency-only control: forget what the last scrape said (capacity is static).
        self._kv_usage = None
        self._kv.on_metrics_stale()
        self._hard = False
        self._preemptions_seen = None

    # -- control ---------------------------------------------------------------------

    def _cut(self, now: float, sent_at: float | None, reason: str) -> None:
        if sent_at is not None and sent_at < self._last_cut_at:
            return  # this request was sent under the old limit
        if now - self._last_cut_at < self.cut_interval_s:
            return
        # from the limit in force: a latency limit the KV cap holds far above it (the
        # long prompts of a new mix) would absorb the cut and change nothing
        # A cut the KV (or engine) cap would absorb, the latency limit staying above the
        # cap (a short-prompt phase grew it; long prompts made the cap the limit in
        # force), acts on the cap: the limit in force comes down.
        cut = self._limit * self.decrease
        if self.cut_from_cap and cut >= self._cap:
            cut = self._cap * self.decrease
        self._limit = max(float(self.min_limit), cut)
        self._last_cut_at = now
        self._slow_start = False
        self.cuts += 1
        self._last_cut_reason = reason
        self.cut_reasons[reason] = self.cut_reasons.get(reason, 0) + 1
        self._recompute()

    def _maybe_grow(self, now: float) -> None:
        if self._hard:
            return
        if self._kv_usage is not None and self._kv_usage >= self.kv_low:
            return
        if self._inflight < self.near_limit * max(1.0, self.usable_share * self._limit):
            return
        if not self._tpot_allows_growth(now):
            return
        step = 1.0 if self._slow_start else min(1.0, self.growth / math.sqrt(self._limit))
        self._limit = min(float(self.max_limit), self._limit + step)
        self._recompute()

    @property
    def tpot_estimate_s(self) -> float | None:
        return self._tpot.value

    def on_kv_projection(self, ratio: float, mean_footprint: float | None) -> None:
        if self._kv.on_kv_projection(ratio, mean_footprint):
            self._recompute()

    def _recompute(self) -> None:
        eff = math.floor(self._limit)
        cap = self._kv.cap()
        if self._engine_cap:
            cap = min(cap, float(self._engine_cap))
        self._cap = cap
        self._effective = max(self.min_limit, min(eff, int(cap)) if cap < math.inf else eff)
