"""The dispatcher: which queued request goes next, and to which backend.

Rules (docs/overload.md):
  * Strict priority: P0's next request first, then P1's, then P2's. When a class's next
    request cannot be placed, lower classes may only use backends that do not serve its
    model (they would take what it is waiting for).
  * Prefill-only requests (embeddings, rerank, score) sent to a backend with nothing but
    prefill-only requests in flight count against its KV at their share of a two-step
    pipeline (core/prefill_pipeline.py): the engine computes one step's worth while the
    next waits for the blocks it frees. Beside generation requests they count whole: their
    prefill shares the steps that decode and prefill the others' first tokens.
  * Reserved P0 slots: P1 and P2 may fill a backend only up to
    cap_low = max(1, floor(limit * (1 - reserved.p0))) requests in flight, and only up to
    low_kv_share of its KV budget (1 - reserved.p0 / 2 alone on it, 1 - reserved.p0
    shared); P0 may use the whole limit and budget. What the
    budget is compared with, alone on a backend, is the in-flight requests' projected
    joint peak (core/kv_projection.py, `_project`) plus the new request's footprint.
  * Bounded outputs (core/bounded_outputs.py): while the requests in flight on a backend
    this replica has alone are expected to run to their max_tokens, a request may go past
    the limit (cap_low for P1/P2) up to the limiter's latency limit, and past the KV
    budget, when the in-flight requests' projected peak at their bounds (max_tokens,
    rounded up a block) plus its own fits the cache (P0) or `low_share` of it (P1/P2).
  * P0 through a fall of the limit (core/p0_refill.py): where a backend's limit falls
    below its in-flight count for the KV cache's sake (its KV cap, or a `kv` cut), P0
    may still refill what ends there, up to the count the fall found, until the count is
    within the limit or the limiter cuts for latency; P1/P2 wait for the new limit.
  * A return (a P1/P2 request back in its booked slot, return_slots.py) leaves the
    lower classes' last slot too, where P0 has a reserve: it is placed only while a
    backend has fewer than return_cap = max(1, cap_low - 1) in flight (cap_low with no
    reserve; of the bounded ceilings while outputs are bounded). Returns are let in past
    the pressure rules, so during a burst they are a standing backlog that would take
    every slot the moment it opens, the one a growing limit just added included; when
    the limiter cuts back, the slots they hold stay held until they end and P0 waits
    (issue 17: P0 in the real-mode burst, docs/bench.md).
  * Aging guard: while P0 has requests waiting and P1's oldest request has waited longer
    than `agingAfter`, every `aging_every`-th dispatch goes to P1 (its fair-queue next
    request) with P0's rights; the other dispatches stay P0's. P1 thus gets at least 1 in
    `aging_every` slots freed under a P0 flood; P2 has no aging (it is shed first).
  * Within a class, the class queue's deficit round robin picks the request. When that
    request cannot be placed (its model's backends are full), the oldest request of
    another model whose backends have room goes instead (charged to its tenant's round
    robin credit): an embedding backend with room does not wait behind a full chat one.
  * Large requests: one whose estimated footprint exceeds the KV budget (the class's share
    of it) of every healthy backend serving its model can only go to an empty backend.
    At the head of its class it holds the others back (its class, and lower classes on
    its model's backends) while a backend drains for it, for at most `hold_for_large_s`
    (policy `dispatcher.holdForLarge`, 2 s); then it is parked: still queued until its
    timeout, placed whenever a backend serving its model is empty, holding nobody back.
    (One whose prompt exceeds every such backend's whole KV cache never gets this far:
    the controller refuses it at arrival, `never_fits`.)
  * Prefill bound: when the limiter states one (`prefill_budget_tokens`), the prompt
    tokens sent to a backend that await their first token (the prefill it has queued)
    may not exceed it with the new request's prompt: a burst of long prompts queued on
    the engine would delay every first token sent after them. Every class has the
    whole bound (P0 goes first at the gateway anyway; a P1/P2 share of it left the
    engine short of prefill between steps). A backend with no prefill queued takes any
    prompt.
  * Backend choice: among healthy backends serving the model with a free slot for the
    class and room in their KV budget and prefill bound, the one with the fewest
    requests in flight; ties go to the fewest estimated tokens in flight, then to the
    name, or on shared backends to this replica's own order of them (a hash of its seed
    and the name): replicas that each hold nothing on most engines would otherwise all
    pick the same ones (in `sluice bench fleet` the preemptions were engines that 5 to 8
    replicas had filled within a scrape interval). A request pinned to a
    backend (RequestInfo.backend: a continuation of a response stored there) waits for a
    slot on that one; at the head of its class it holds its class back until then (a
    slot frees with the next finish there), not the lower classes. A backend with nothing
    in flight takes any request whatever its KV budget (or it could never serve it).
  * Shared backends (other gateway replicas send to them too: the limiter's `kv_shared`):
    the budget is this replica's claim on the backend's room, often part of one request,
    and having nothing in flight there does not make the backend empty. A request past
    what is left r of the claim goes when the scrape's draw u has u * cost < r (with
    probability r / cost: the replicas' claims add up to the room in expectation) and the
    room the scrape showed has it (a request larger than the whole budget: only when the
    backend looked idle); then r < 0 until ours end: one request past the claim at most.
    P1/P2 do so with half those odds (`LOW_OVERDRAFT`), P0 up to the limiter's floor,
    its replica's part of the whole budget, besides; a P1/P2 request larger than a
    typical one (the limiter's footprint, `SharedRoom.footprint_tokens`) at odds scaled
    down by footprint / cost besides, so that it adds no more to the spread of the
    draws than a typical one. On a backend the scrape showed idle,
    a replica that knows nothing of the fleet yet (no count, no scrape that showed
    requests) sends its one request past the claim without a draw: a fresh gateway,
    alone or not, starts at once (R fresh replicas put at most R requests past their
    claims there, as on any backend; later, 8 replicas each doing so on the idle
    engines of a quiet night put 8 requests on engines of 10 when the day came). A
    replica that knows other live ones share the backends (`peers_known`: the controller's
    count) sends nothing to a backend before its first scrape of it has answered: with no
    KV figures its limiter has no budget at all (a replacement in `sluice bench fleet`'s
    rolling restart put 700-1,000-token requests on engines the others had filled). "Too
    large for every budget" is judged against the backends' whole budgets.

Cost: the backends with a free slot are kept in two dicts updated on every change, so a
dispatch call with no free slot is O(1) and a placement is O(backends with a free slot).
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence

from sluice.core.backend_state import BackendState
from sluice.core.bounded_outputs import CALM_S, bound_output, low_share, outputs_bounded
from sluice.core.class_queue import ClassQueue
from sluice.core.kv_projection import projected_peak
from sluice.core.p0_refill import refill_to
from sluice.core.prefill_pipeline import kv_charge
from sluice.core.request_record import RequestRecord

# P1/P2 take a request past their claim on a shared backend with this part of the odds:
# what they leave of the fleet's claims is in the room the next scrapes show, for the P0
# requests of whichever replica has them (each replica's priorities are its own: without
# this, one replica's P2 took the room another's P0 was waiting for).
LOW_OVERDRAFT = 0.5


def low_cap(limit: int, reserved_p0: float) -> int:
    """In-flight requests P1/P2 may have on a backend of this limit."""
    return max(1, math.floor(limit * (1.0 - reserved_p0) + 1e-9))


# The part of P0's reserve kept in a lone backend's KV budget: P1/P2 may fill
# 1 - KV_RESERVE_PART x reserved.p0 of it (0.9 at the default 0.2). The budget has its
# own margin (0.8 of the cache) and P0 its slots (cap_low) and its refill after a fall
# (core/p0_refill.py); with the whole reserve in KV too (0.64 of the cache for P1/P2) the
# KV share, not the count, held P1/P2 on a small engine's burst (of 2,406 backends that
# turned a P1/P2 request down in `burst --real-size` seed 1's burst, 2,284 were past the
# KV share), and the engine ran at 83 % of its sweet spot (docs/bench.md, "Half of P0's
# reserve in KV"). Shared backends keep the whole reserve: their claims are parts of it.
KV_RESERVE_PART = 0.5


def low_kv_share(b: BackendState, reserved_p0: float) -> float:
    """The part of the backend's KV budget P1/P2 may fill."""
    if b.kv_shared is None:
        return 1.0 - KV_RESERVE_PART * reserved_p0
    return 1.0 - reserved_p0


def return_cap(limit: int, cap_low: int) -> int:
    """In-flight requests below which a P1/P2 return may be placed (module docstring)."""
    return cap_low if cap_low >= limit else max(1, cap_low - 1)


class Dispatcher:
    def __init__(
        self,
        *,
        reserved_p0: float = 0.2,
        aging_after_s: float = 10.0,
        aging_every: int = 5,
        hold_for_large_s: float = 2.0,
        seed: int | str = 0,
    ) -> None:
        if aging_every < 1:
            raise ValueError("aging_every must be at least 1")
        self.reserved_p0 = reserved_p0
        self.now = 0.0  # of the pass being made (kv projections)
        self.aging_after_s = aging_after_s
        self.aging_every = aging_every
        self.hold_for_large_s = hold_for_large_s
        self.seed = seed  # this replica's order of the shared backends (`shuffled`)
        # other live replicas are known to share the backends (the controller's count)
        self.peers_known = False
        # the earliest time a large request holding the others back stops (last pass)
        self.hold_ends_at: float | None = None
        self.backends: dict[str, BackendState] = {}
        self._open_all: dict[str, BackendState] = {}
        self._open_low: dict[str, BackendState] = {}
        self._served_models: set[str] = set()
        self._any_model = False  # a healthy backend serves any model
        self._p0_since_aged = 0
        self.aged_dispatches = 0
        self.inflight_total = 0  # over healthy backends
        self.limit_total = 0  # sum of the limits of healthy backends

    # -- the backend registry ----------------------------------------------------------

    def add(self, b: BackendState) -> None:
        key = f"{self.seed}/{b.name}".encode()
        b.shuffled = hashlib.blake2b(key, digest_size=8).hexdigest()
        self.backends[b.name] = b
        self.refresh(b)
        self._recount_models()

    def remove(self, name: str) -> BackendState | None:
        b = self.backends.pop(name, None)
        if b is not None:
            b.removed = True
            self.refresh(b)  # leaves the free-slot sets and the totals
            self._recount_models()
        return b

    def set_health(self, b: BackendState, healthy: bool) -> None:
        b.healthy = healthy
        self.refresh(b)
        self._recount_models()

    def set_models(self, b: BackendState, models: Sequence[str]) -> None:
        b.models = frozenset(models)
        self._recount_models()

    def _recount_models(self) -> None:
        served: set[str] = set()
        any_model = False
        for b in self.backends.values():
            if b.healthy:
                if b.models:
                    served |= b.models
                else:
                    any_model = True
        self._served_models = served
        self._any_model = any_model

    def serves(self, model: str) -> bool:
        """Some healthy backend serves this model."""
        return self._any_model or model in self._served_models

    def never_fits(self, model: str, prompt_tokens: float) -> bool:
        """The prompt is larger than the whole KV cache of every backend (healthy or not)
        serving the model, all of whose sizes are known: it can never run anywhere."""
        largest = None
        for b in self.backends.values():
            if b.models and model not in b.models:
                continue
            cap = b.kv_capacity
            if cap is None:
                return False
            if largest is None or cap > largest:
                largest = cap
        return largest is not None and prompt_tokens > largest

    def _needs_empty(self, rec: RequestRecord, full_rights: bool) -> bool:
        """Too large for the KV budget of every healthy backend serving its model: it
        fits only a backend with nothing in flight."""
        model = rec.model
        found = False
        for b in self.backends.values():
            if not b.healthy or b.removed or (b.models and model not in b.models):
                continue
            shared = b.kv_shared
            budget = b.kv_budget if shared is None else shared.full_tokens
            share = 1.0 if full_rights else low_kv_share(b, self.reserved_p0)
            if budget is None or rec.kv_tokens <= budget * share:  # (its least)
                return False
            found = True
        return found

    def _held_long_enough(self, rec: RequestRecord, full_rights: bool, now: float) -> bool:
        """A head that could not be placed: whether it is a large request that has held
        the others back for `hold_for_large_s` (then it is parked); else it holds them."""
        if not self._needs_empty(rec, full_rights):
            return False
        if rec.held_since is None:
            rec.held_since = now
        end = rec.held_since + self.hold_for_large_s
        if now >= end:
            return True
        if self.hold_ends_at is None or end < self.hold_ends_at:
            self.hold_ends_at = end
        return False

    def refresh(self, b: BackendState) -> None:
        """Re-read the limiter and update the free-slot sets."""
        limiter = b.limiter
        limit = limiter.limit
        limit_before = b.limit
        if limit != limit_before or b.cap_low < 0:
            b.limit = limit
            b.cap_low = low_cap(limit, self.reserved_p0)
        b.kv_budget = limiter.kv_budget_tokens
        b.prefill_budget = limiter.prefill_budget_tokens
        b.kv_shared = shared = limiter.kv_shared
        cut_at = limiter.last_cut_at
        if cut_at != b.cut_seen:
            b.cut_seen = cut_at
            b.p0_refill = refill_to(
                b.p0_refill, b.inflight, limit_before, limit, limiter.last_cut_reason
            )
        elif limit < limit_before:
            b.p0_refill = refill_to(b.p0_refill, b.inflight, limit_before, limit, None)
        if shared is not None:
            b.p0_refill = 0  # left to the replicas' claims
        b.tie = b.name if shared is None else b.shuffled
        self._set_ceilings(b)
        name = b.name
        # Totals over usable backends, kept incrementally so pressure is O(1).
        if b.healthy and not b.removed:
            inflight = b.inflight
            self.inflight_total += inflight - b.counted_inflight
            b.counted_inflight = inflight
            if limit != b.counted_limit:
                self.limit_total += limit - b.counted_limit
                b.counted_limit = limit
            if inflight < b.ceiling:
                self._open_all[name] = b
            else:
                self._open_all.pop(name, None)
            if inflight < b.ceiling_low:
                self._open_low[name] = b
            else:
                self._open_low.pop(name, None)
        else:
            self.inflight_total -= b.counted_inflight
            self.limit_total -= b.counted_limit
            b.counted_inflight = b.counted_limit = 0
            self._open_all.pop(name, None)
            self._open_low.pop(name, None)

    def _set_ceilings(self, b: BackendState) -> None:
        """The in-flight counts below which each class may be placed: the limit and
        cap_low, or, while the outputs in flight are bounded (core/bounded_outputs.py) on
        a backend of known size this replica has alone and its limiter has not cut for
        `CALM_S`, the limiter's latency limit and its cap_low (`place` then checks the
        bounds' peak for the requests past them)."""
        ceiling = b.limit
        bounded = (
            b.kv_capacity is not None
            and b.kv_shared is None
            and b.inflight > 0
            and outputs_bounded(b.bound_tokens, b.inflight_tokens)
        )
        if bounded:  # the limiter's figures only then (this runs on every refresh)
            limiter = b.limiter
            latency_limit = limiter.latency_limit
            if latency_limit is None or self.now - limiter.last_cut_at < CALM_S:
                bounded = False
            elif latency_limit > ceiling:
                ceiling = int(latency_limit)
        b.bounded = bounded
        b.ceiling_low = (
            b.cap_low if ceiling == b.limit else max(b.cap_low, low_cap(ceiling, self.reserved_p0))
        )
        refill = b.p0_refill
        if refill:
            if b.inflight <= ceiling:
                b.p0_refill = 0  # within the limit again: the fall has taken effect
            elif refill > ceiling:
                ceiling = refill
        b.ceiling = ceiling

    def set_reserved(self, reserved_p0: float) -> None:
        self.reserved_p0 = reserved_p0
        for b in self.backends.values():
            b.cap_low = -1  # recompute
            self.refresh(b)

    def has_free_slot(self, priority: int) -> bool:
        return bool(self._open_all if priority == 0 else self._open_low)

    # -- accounting --------------------------------------------------------------------

    def assign(self, rec: RequestRecord, b: BackendState, now: float) -> None:
        rec.pipelined = pipelined = _pipelines(rec, b)  # as `place` judged it
        rec.kv_tokens = kv_charge(rec.cost, pipelined)
        b.inflight += 1
        b.inflight_by_class[rec.priority] += 1
        b.inflight_tokens += rec.kv_tokens
        b.records[rec.request_id] = rec
        b.kv_peak += rec.kv_tokens
        rec.bound_tokens = _bound(rec)
        b.bound_tokens += rec.bound_tokens
        b.kv_bound_peak += rec.bound_tokens + b.block_pad  # an upper bound, as kv_peak's
        if pipelined:
            b.pipelined += 1
            b.pipelined_tokens += rec.prompt_est
        rec.backend = b
        rec.prefill_ahead = b.prefill_tokens
        if rec.info.first_token_visible or rec.info.prefill_only:  # its end is its prefill's
            b.prefill_tokens += rec.prompt_est
        b.limiter.on_dispatch(b.inflight, rec.kv_tokens, now)
        self.refresh(b)

    def release(self, rec: RequestRecord, now: float, *, refresh: bool = True) -> None:
        """The request left its backend. `refresh=False` when the caller refreshes the
        backend itself right after (after feeding its limiter a sample)."""
        b = rec.backend
        if b is None:
            return
        b.inflight -= 1
        b.inflight_by_class[rec.priority] -= 1
        b.inflight_tokens -= rec.kv_tokens
        b.bound_tokens -= rec.bound_tokens
        del b.records[rec.request_id]
        if rec.pipelined:
            b.pipelined -= 1
            b.pipelined_tokens = max(0.0, b.pipelined_tokens - rec.prompt_est)
        b.kv_peak_stale = b.kv_bound_stale = True
        b.left += 1
        if rec.first_token_at is None and (rec.info.first_token_visible or rec.info.prefill_only):
            self.prefilled(rec)
        if b.inflight == 0:  # no float drift left behind
            b.prefill_tokens = b.pipelined_tokens = b.bound_tokens = 0.0
        b.limiter.on_release(b.inflight, now)
        if refresh:
            self.refresh(b)

    def prefilled(self, rec: RequestRecord) -> None:
        """The request's prompt is no longer waiting (first token, or it left)."""
        b = rec.backend
        if b is not None:
            b.prefill_tokens = max(0.0, b.prefill_tokens - rec.prompt_est)

    # -- choosing ----------------------------------------------------------------------

    def place(
        self, rec: RequestRecord, full_rights: bool, blocked_models: set[str] | None = None
    ) -> BackendState | None:
        """The backend this request would go to now, or None."""
        cands = self._open_all if full_rights else self._open_low
        if rec.pinned is not None:  # it must run where its stored state is
            b = cands.get(rec.pinned)
            cands = {} if b is None else {b.name: b}
        a_return = rec.returning and not full_rights
        best: BackendState | None = None
        for b in cands.values():
            if a_return and b.inflight >= return_cap(b.ceiling, b.ceiling_low):
                continue
            if not _serves(b, rec.model, blocked_models):
                continue
            if self.peers_known and not b.scraped:
                continue  # shared, and its room unknown until our first scrape of it
            if b.kv_peak_stale and b.kv_shared is None and b.kv_budget is not None:
                self._project(b)  # only a lone backend's budget counts the projection
            past = b.inflight >= (max(b.limit, b.p0_refill) if full_rights else b.cap_low)
            share = 1.0 if full_rights else low_kv_share(b, self.reserved_p0)
            if (
                past or not _kv_fits(b, kv_charge(rec.cost, _pipelines(rec, b)), share, full_rights)
            ) and not self._bound_fits(b, rec, full_rights):
                continue
            if not _prefill_fits(b, rec.prompt_est):
                continue
            if best is None or _less_loaded(b, best):
                best = b
        return best

    def _bound_fits(self, b: BackendState, rec: RequestRecord, full_rights: bool) -> bool:
        """Past the limit (or cap_low) or the KV budget, the request may still go while the
        outputs in flight are bounded and the in-flight requests' projected peak at their
        bounds plus its own fits the cache (P0) or P1/P2's part of it: no preemption
        whatever they generate (core/bounded_outputs.py). Prefill-only requests are held
        by their pipeline's share, not by this."""
        cache = b.kv_capacity
        if not b.bounded or cache is None or rec.info.prefill_only:
            return False
        if b.kv_bound_stale:
            self._project_bounds(b)
        room = cache if full_rights else cache * low_share(self.reserved_p0)
        return b.kv_bound_peak + _bound(rec) + b.block_pad <= room

    def _project(self, b: BackendState) -> None:
        """Recompute the backend's projected KV peak (core/kv_projection.py) from its
        requests' progress: the tokens a request has generated are estimated from its
        first token's time and the backend's TPOT (before its first token, or with no
        TPOT known: none, so it counts at its prompt now and its whole output ahead)."""
        now = self.now
        tpot = b.limiter.tpot_estimate_s
        held_ahead = []
        for r in b.records.values():
            out = r.cost - r.prompt_est
            if r.info.prefill_only:  # done in its step: its pipeline share, nothing ahead
                held_ahead.append((float(r.kv_tokens), 0.0))
                continue
            done = _generated(r, out, tpot, now)
            held_ahead.append((r.prompt_est + done, out - done))
        b.kv_peak = projected_peak(held_ahead)
        b.kv_peak_stale = False
        if b.inflight_tokens:
            mean = b.inflight_tokens / b.inflight
            b.limiter.on_kv_projection(b.kv_peak / b.inflight_tokens, mean)
        else:
            b.limiter.on_kv_projection(1.0, None)

    def _project_bounds(self, b: BackendState) -> None:
        """`_project` at the requests' bounds: each holds its block rounding from the start
        and runs until its max_tokens (the estimate of what it has generated is the same)."""
        now = self.now
        tpot = b.limiter.tpot_estimate_s
        pad = b.block_pad
        held_ahead = []
        for r in b.records.values():
            if r.info.prefill_only:
                held_ahead.append((r.bound_tokens + pad, 0.0))
                continue
            out = bound_output(r.info.max_tokens, r.info.sequences)
            done = _generated(r, out, tpot, now)
            held_ahead.append((r.prompt_est + pad + done, out - done))
        b.kv_bound_peak = projected_peak(held_ahead)
        b.kv_bound_stale = False

    def dispatch_alone(self, rec: RequestRecord, now: float) -> BackendState | None:
        """Place `rec` as `dispatch` would if it were the only request queued (and not
        due): the backend it went to, or None (then it must be queued)."""
        self.now = now
        if not self._open_all:
            return None
        self._p0_since_aged = 0  # no P1 request waits behind P0: no aged turn owed
        b = self.place(rec, rec.priority == 0)
        if b is not None:
            self.assign(rec, b, now)
        return b

    def _another_model(
        self,
        q: ClassQueue,
        head: RequestRecord,
        full_rights: bool,
        blocked: set[str],
        now: float,
        slack: float,
    ) -> tuple[RequestRecord, BackendState] | None:
        """The class's next request waits for its model's backends: the oldest request of
        another model that may go now (an embedding for the embedding backend while the
        chat backend is full), so that one model's backlog does not hold up another's
        free capacity. A pinned head's own model is not blocked: its other requests too."""
        for model, of_model in q.by_model.items():
            if (model == head.model and head.pinned is None) or model in blocked:
                continue
            for rec in of_model.values():
                if rec is head or rec.request_id in q.parked:
                    continue
                if not q.is_due(rec, now, slack):  # the due ones the next pass drops
                    b = self.place(rec, full_rights, blocked)
                    if b is not None:
                        return rec, b
                break  # the oldest of its model only (arrival order within a model)
        return None

    def _place_parked(
        self, q: ClassQueue, full_rights: bool, blocked: set[str], now: float
    ) -> tuple[RequestRecord, BackendState] | None:
        """The first parked request of the class that a backend can take now (an empty
        one, for a large request), placed."""
        for rec in q.parked.values():
            b = self.place(rec, full_rights, blocked)
            if b is not None:
                q.remove(rec.request_id)
                self.assign(rec, b, now)
                return rec, b
        return None

    def dispatch(
        self,
        queues: Sequence[ClassQueue],
        now: float,
        slacks: Sequence[float],
    ) -> tuple[list[tuple[RequestRecord, BackendState]], list[RequestRecord]]:
        """Pop what can go now. Returns (placements, requests found due and dropped)."""
        placed: list[tuple[RequestRecord, BackendState]] = []
        dropped: list[RequestRecord] = []
        self.now = now
        q0, q1 = queues[0], queues[1]
        self.hold_ends_at = None
        while self._open_all:
            aged = False
            if q1.by_arrival and q0.by_arrival:
                oldest = q1.oldest()
                aged = oldest is not None and now - oldest.enqueued_at > self.aging_after_s
            if not aged:
                self._p0_since_aged = 0
            guard = aged and self._p0_since_aged >= self.aging_every - 1
            blocked: set[str] = set()
            progress = False
            for q in (q1, q0, queues[2]) if guard else queues:
                if not q.by_arrival:
                    continue
                full = q.priority == 0 or (guard and q is q1)
                if q.parked and (took := self._place_parked(q, full, blocked, now)) is not None:
                    placed.append(took)
                    progress = True
                    break
                rec = q.peek()
                if rec is None:
                    continue
                if q.is_due(rec, now, slacks[q.priority]):
                    q.remove(rec.request_id)
                    dropped.append(rec)
                    progress = True
                    break
                b = self.place(rec, full, blocked)
                if b is None:
                    # A failed aged turn does not block P0; a pinned request waits for its
                    # own backend, not for its model's capacity: lower classes may use the
                    # others.
                    if not (guard and q is q1):
                        if self._held_long_enough(rec, full, now):
                            q.park(rec)  # the next request of its class gets its turn
                            progress = True
                            break
                        if rec.pinned is None:
                            blocked.add(rec.model)
                    if len(q.by_model) < 2 and rec.pinned is None:
                        continue
                    found = self._another_model(q, rec, full, blocked, now, slacks[q.priority])
                    if found is None:
                        continue
                    rec, b = found
                    q.take(rec)
                else:
                    q.pop()
                self.assign(rec, b, now)
                placed.append((rec, b))
                if q is q1 and guard:
                    self._p0_since_aged = 0
                    self.aged_dispatches += 1
                elif q is q0 and aged:
                    self._p0_since_aged += 1
                progress = True
                break
            if not progress:
                break
        return placed, dropped


# -- place()'s steps: may this backend take the request, and which of two is better -------


def _serves(b: BackendState, model: str, blocked_models: set[str] | None) -> bool:
    """It serves the request's model (a backend with no model list serves any) and none
    of the models blocked this pass."""
    models = b.models
    if not models:
        return not blocked_models
    if model not in models:
        return False
    return not blocked_models or models.isdisjoint(blocked_models)


def _pipelines(rec: RequestRecord, b: BackendState) -> bool:
    """A prefill-only request goes to the backend as part of a pipeline (counted at its
    share of one, core/prefill_pipeline.py) while nothing but such a pipeline is in flight
    there: the engine then runs nothing its prefill would hold up."""
    return rec.info.prefill_only and b.inflight == b.pipelined


def _kv_fits(b: BackendState, cost: int, share: float, full_rights: bool) -> bool:
    """The request's KV footprint fits the part of the backend's budget it may use. Alone
    on the backend, an empty one takes any request; shared with other replicas, a request
    past what is left of our claim goes on the scrape's draw (the overdraft, P1/P2 at
    LOW_OVERDRAFT odds), never past the backend's room; an empty backend that looked idle
    before we knew the fleet takes it."""
    budget = b.kv_budget
    shared = b.kv_shared
    if shared is not None and full_rights and budget is not None:
        budget = max(budget, shared.floor_tokens)
    # alone on the backend: the in-flight requests' projected peak (their ends are
    # staggered); shared, the claims are made in whole footprints, so is our part
    held = b.kv_peak if shared is None else b.inflight_tokens
    if budget is None or held + cost <= budget * share:
        return True
    if shared is None:
        return not b.inflight
    if b.inflight == 0 and shared.first_free:
        return True
    left = budget * share - b.inflight_tokens
    odds = 1.0 if full_rights else LOW_OVERDRAFT
    fp = shared.footprint_tokens
    if not full_rights and 0 < fp < cost:
        # A larger P1/P2 request draws at odds scaled down by its size: one of cost c past
        # r adds up to r x c to the variance of the fleet's sum, and the spread kept back
        # is for typical ones (several replicas drew 1,000-1,600-token requests, a third
        # to a half of a `tiny` budget, into the same room within a scrape interval: most
        # of the preemption episodes left in `sluice bench fleet`). It still goes soon:
        # it has a draw on every backend at each scrape. P0 keeps its odds: scaled too,
        # its large requests waited past their TTFT objective (fleet-16: P0 92-96 %).
        odds *= fp / cost
    return (
        left > 0
        and shared.draw * cost < odds * left
        and b.inflight_tokens + cost <= shared.room_tokens * share
    )


def _generated(rec: RequestRecord, out: float, tpot: float | None, now: float) -> float:
    """The tokens a request has generated, estimated from its first token's time and the
    backend's TPOT (none before its first token or without a TPOT), at most `out`."""
    if not tpot or rec.first_token_at is None:
        return 0.0
    return min(out, (now - rec.first_token_at) / tpot)


def _bound(rec: RequestRecord) -> float:
    """The most tokens the request can hold in KV (core/bounded_outputs.py), before the
    engine rounds them up to whole blocks: its charge for a prefill-only one, else its
    prompt and max_tokens."""
    if rec.info.prefill_only:
        return float(rec.kv_tokens)
    return rec.prompt_est + bound_output(rec.info.max_tokens, rec.info.sequences)


def _prefill_fits(b: BackendState, prompt: float) -> bool:
    """The prompt fits the backend's prefill budget (a backend with no prefill queued
    takes any prompt)."""
    pf = b.prefill_budget
    return pf is None or not b.prefill_tokens or b.prefill_tokens + prompt <= pf


def _less_loaded(b: BackendState, best: BackendState) -> bool:
    """Fewer requests in flight, then fewer KV tokens, then the tie order (the name, or on
    shared backends this replica's own order of them): one order, so placement does not
    depend on the dict's order."""
    if b.inflight != best.inflight:
        return b.inflight < best.inflight
    if b.inflight_tokens != best.inflight_tokens:
        return b.inflight_tokens < best.inflight_tokens
    return b.tie < best.tie
