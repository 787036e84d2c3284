"""The Controller: the one facade the gateway shell and the simulation drive.

It ties the parts together -- tenant quotas, pressure and the drop policies at arrival, the
class queues, the dispatcher, one limiter per backend, token costs and Retry-After -- and
keeps the single source of truth about each request: queued, in flight, or gone (an
unknown id). Time comes only from the injected clock; nothing here sleeps or does I/O.

Driving it: call `arrive` for each request; after every event (arrival, finish, cancel,
health or metrics change) call `step` and act on what it says: the assignments to start,
the queued requests to refuse, and when to call `step` again if nothing else happens.
It is the one way to drive it: the gateway's dispatch bridge and the virtual-time harness
make the same calls.

Dispatch on arrival: a request admitted while every class queue is empty, and that a
backend has room for, is placed by `arrive` itself, exactly as the step right after it
would have placed it alone in its queue (the common case below the limit, without a trip
through the queue). Its state is then INFLIGHT, but its Assignment is reported by the next
`step` like any other (`quiet()` is false until then), so a driver
that steps after every arrival sees no difference. A request cancelled before that step
is not reported; its slot and its quota charge come back. A driver that acts on a
placement at once (the gateway) passes `take=True`: when that step would have reported
nothing else, the assignment comes back in the Admission and the step is not needed
(`quiet()` says when a step after a finish would have nothing to do either).
"""

from __future__ import annotations

import dataclasses
import heapq
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

from sluice.core.backend_state import BackendState
from sluice.core.bounded_outputs import block_pad
from sluice.core.class_queue import ClassQueue
from sluice.core.clock import Clock
from sluice.core.dispatcher import Dispatcher
from sluice.core.drop_policy import admission_code, head_slack
from sluice.core.ewma import Ewma
from sluice.core.fleet_share import FleetShare
from sluice.core.limiters import Limiter, LimiterContext, make_limiter
from sluice.core.prefill_pipeline import engine_view
from sluice.core.pressure import PressureInputs, backend_congestion, compute_pressure
from sluice.core.quota import InProcessQuotas, TenantQuotas, settlement
from sluice.core.request_record import RequestRecord, RequestState
from sluice.core.retry_after import (
    DrainEstimator,
    deadline_code,
    no_retry_fits,
    refusal_excess,
)
from sluice.core.return_slots import Offer, ReturnLedger
from sluice.core.settings import (
    CLASS_NAMES,
    CoreSettings,
    DropPolicy,
    LimiterSettings,
    PressureSettings,
)
from sluice.core.snapshot import (
    BackendSnapshot,
    ClassSnapshot,
    ControllerSnapshot,
    ReturnsSnapshot,
)
from sluice.core.stall_log import StallSource
from sluice.core.token_cost import TokenCostModel, footprint_tokens
from sluice.core.types import (
    SIGNALS,
    Admission,
    Assignment,
    BackendMetrics,
    Outcome,
    RejectCode,
    Rejection,
    RequestInfo,
    Sample,
)

PRIORITIES = (0, 1, 2)
_INFLIGHT = RequestState.INFLIGHT
_DROP_OUTCOMES = frozenset({Outcome.ERROR, Outcome.TIMEOUT, Outcome.OVERLOADED})
_ADMITTED = Admission.ok()  # shared: an answer is never changed
# A burst above is forecast to last at least this much longer (Lindy: as long again as it
# has lasted, but a burst just seen is not over at once).
MIN_BURST_S = 2.0
# A request handed back by a replica that shuts down retries this soon: the Service sends
# it to another replica (the shutting-down one has left its endpoints).
HANDOVER_RETRY_S = 0.1

LimiterFactory = Callable[[LimiterContext, LimiterSettings, int | None], Limiter]


class Step(NamedTuple):
    """What one pass of the controller decided (see `Controller.step`)."""

    assignments: list[Assignment]
    rejections: list[Rejection]
    wake_at: float | None  # call step() again by then if nothing else happens


# Step(...) runs a Python-level __new__; the tuple's own is the same and free (once per event)
_new_step = tuple.__new__


class ClassCounters:
    """Per-class counters. They add up (checked by the tests):
    arrived = admitted + sum(rejected)
    admitted = queued + dispatched + sum(dropped) + cancelled_queued
    dispatched = inflight + sum(finished) + cancelled_inflight"""

    __slots__ = (
        "admitted",
        "arrived",
        "cancelled_inflight",
        "cancelled_queued",
        "dispatched",
        "dropped",
        "finished",
        "rejected",
    )

    def __init__(self) -> None:
        self.arrived = 0
        self.admitted = 0
        self.rejected: dict[str, int] = {}
        self.dispatched = 0
        self.dropped: dict[str, int] = {}
        self.cancelled_queued = 0
        self.cancelled_inflight = 0
        self.finished: dict[str, int] = {}


class ReturnCounters:
    """Per class, what the return slots did (booking rule): refusals that got a slot,
    that were told no slot comes before their deadline, and requests that came back in
    their slot (`returned`) and were let into the queue (`returned_admitted`); for the
    returns of this gateway's own bookings that were dispatched (`waited`), the time from
    their refusal to their dispatch in all (`waited_s`)."""

    __slots__ = ("booked", "returned", "returned_admitted", "unservable", "waited", "waited_s")

    def __init__(self) -> None:
        self.booked = 0
        self.unservable = 0
        self.returned = 0
        self.returned_admitted = 0
        self.waited = 0
        self.waited_s = 0.0


class Forecast(NamedTuple):
    """A class's room, in requests per second it can start, tau s ahead:
    rate - excess * exp(-tau / decay_s); `capacity`: what the gateway starts in all."""

    rate: float
    excess: float
    decay_s: float
    capacity: float


class Refusal(NamedTuple):
    code: RejectCode
    retry_after_s: float
    booking: str | None = None
    window_s: float = 0.0


def class_thresholds(policy: CoreSettings) -> list[PressureSettings]:
    """Per class, the pressure thresholds it is judged by. A class never sheds at a
    pressure below the one at which a lower class is fast-rejected: P2 is refused before
    P1, P1 before P0."""
    out = []
    for prio in PRIORITIES:
        below = [policy.queue(p) for p in PRIORITIES if p > prio]
        shed = policy.pressure.shed_above
        if any(q.drop_policy is DropPolicy.FAST_REJECT for q in below):
            shed = max(shed, policy.pressure.fast_reject_above)
        out.append(dataclasses.replace(policy.pressure, shed_above=shed))
    return out


def _give_up_at(info: RequestInfo) -> float | None:
    return info.client_deadline if info.give_up_at is None else info.give_up_at


def _bump(d: dict[str, int], key: str) -> None:
    d[key] = d.get(key, 0) + 1


class Controller:
    def __init__(
        self,
        policy: CoreSettings,
        clock: Clock,
        backends: Sequence[str] = (),
        *,
        limiter_kwargs: Mapping[str, Mapping[str, Any]] | None = None,
        limiter_factory: LimiterFactory | None = None,
        aging_every: int = 5,
        rate_tau_s: float = 2.0,
        ttft_alpha: float = 0.1,
        no_backend_retry_s: float = 2.0,
        quotas: TenantQuotas | None = None,
        cost_model: TokenCostModel | None = None,
        seed: int | str = 0,
        dispatch_on_arrival: bool = True,
        return_lead: float = 0.5,
        return_lead_max_s: float = 5.0,
        return_slots: Mapping[str, Any] | None = None,
        stalls: StallSource | None = None,
    ) -> None:
        """`stalls` says when the host did not run the gateway (core/stall_log.py): that
        time is taken out of the latency samples and first-token alarms.
        `limiter_kwargs` maps an algorithm name to extra keyword arguments for it;
        `limiter_factory(context, policy.limiter, initial_limit)` replaces the built-in
        factory; `seed` makes each backend's probe jitter reproducible;
        `dispatch_on_arrival=False` makes `arrive` only queue (the behaviour the short cut
        reproduces: the tests compare the two)."""
        self._policy = policy
        self._stalls = stalls
        self._clock = clock
        self._limiter_kwargs = {k: dict(v) for k, v in (limiter_kwargs or {}).items()}
        self._limiter_factory = limiter_factory
        self._seed = seed
        self._queues = [ClassQueue(policy.queue(p)) for p in PRIORITIES]
        self._dispatcher = Dispatcher(
            reserved_p0=policy.dispatcher.reserved_p0,
            aging_after_s=policy.dispatcher.aging_after,
            aging_every=aging_every,
            hold_for_large_s=policy.dispatcher.hold_for_large,
            seed=seed,
        )
        self._records: dict[str, RequestRecord] = {}
        self._thresholds = class_thresholds(policy)
        self._drain = DrainEstimator(
            len(PRIORITIES), tau_s=rate_tau_s, max_s=policy.pressure.max_retry_after
        )
        self._ledger = ReturnLedger(
            len(PRIORITIES),
            **{
                "horizon_s": policy.pressure.max_retry_after,
                "id_prefix": f"{seed}-",
                **(return_slots or {}),
            },
        )
        self._returns = [ReturnCounters() for _ in PRIORITIES]
        self._return_lead = return_lead
        self._return_lead_max = return_lead_max_s
        self._service = Ewma(0.05)  # time a request holds its slot (dispatch to finish)
        self._cost = cost_model or TokenCostModel()
        self._quotas: TenantQuotas = quotas or InProcessQuotas(policy.tenants)
        self._ttft = Ewma(ttft_alpha)  # expected time to first token, for early drop
        self._slack_cache: tuple[float, list[float]] | None = None  # (ttft, slacks)
        self._pending: list[Rejection] = []  # found due inside a pass: for its step
        # dispatched by arrive(), for the next step() to report (unless cancelled by then)
        self._ready: list[tuple[RequestRecord, Assignment]] = []
        self._dispatch_on_arrival = dispatch_on_arrival
        # (due, seq, id, after): a first token overdue `after` s from its dispatch
        self._alarms: list[tuple[float, int, str, float]] = []
        self._seq = 0
        self._counters = [ClassCounters() for _ in PRIORITIES]
        self._no_backend_retry_s = no_backend_retry_s
        self._congestion_sum = 0.0
        self._congestion_n = 0
        # our part of the fleet of gateway replicas sharing the backends (fleet_share.py)
        self._fleet = FleetShare()
        self._handed_over = False  # shutting down: nothing queued or admitted any more
        self.set_backends(backends)

    # -- backends ----------------------------------------------------------------------

    def _new_limiter(self, name: str, initial: int | None = None) -> Limiter:
        lp = self._policy.limiter
        context = self._limiter_context(name)
        if self._limiter_factory is not None:
            return self._limiter_factory(context, lp, initial)
        kwargs = self._limiter_kwargs.get(lp.algorithm, {})
        return make_limiter(lp, context, initial_limit=initial, **kwargs)

    def _limiter_context(self, name: str) -> LimiterContext:
        """What a backend's limiter may ask of this controller."""
        return LimiterContext(
            backend=name,
            seed=f"{self._seed}:{name}",
            usable_share=1.0 - self._policy.dispatcher.reserved_p0,
            objectives=self._policy.objectives(),
            demand_footprint=self._admitted_footprint_of(name),
            classes_in_flight=self._classes_in_flight_of(name),
        )

    def _admitted_footprint_of(self, name: str) -> Callable[[], float | None]:
        """For a backend's limiter: the footprint of the requests being admitted for the
        models it serves (the mix it will be sent next)."""
        backends = self._dispatcher.backends
        cost = self._cost

        def admitted() -> float | None:
            b = backends.get(name)
            return cost.admitted_footprint(frozenset() if b is None else b.models)

        return admitted

    def _classes_in_flight_of(self, name: str) -> Callable[[], Sequence[int]]:
        """For a backend's limiter: its requests in flight by priority."""
        backends = self._dispatcher.backends

        def in_flight() -> Sequence[int]:
            b = backends.get(name)
            return (0, 0, 0) if b is None else b.inflight_by_class

        return in_flight

    def set_backends(self, names: Sequence[str]) -> None:
        wanted = list(dict.fromkeys(names))
        for name in list(self._dispatcher.backends):
            if name not in wanted:
                b = self._dispatcher.backends[name]
                self._set_congestion(b, None)
                self._dispatcher.remove(name)
        for name in wanted:
            if name not in self._dispatcher.backends:
                self._dispatcher.add(BackendState(name, self._new_limiter(name)))

    def set_backend_models(self, backend: str, models: Sequence[str]) -> None:
        b = self._dispatcher.backends.get(backend)
        if b is not None:
            self._dispatcher.set_models(b, models)

    def set_backend_health(self, backend: str, healthy: bool) -> None:
        b = self._dispatcher.backends.get(backend)
        if b is not None and b.healthy != healthy:
            self._dispatcher.set_health(b, healthy)

    def on_metrics(self, backend: str, m: BackendMetrics) -> None:
        b = self._dispatcher.backends.get(backend)
        if b is None:
            return
        b.last_metrics = m
        b.metrics_fresh = True
        b.scraped = True
        capacity = m.kv_capacity  # in blocks (vLLM, TensorRT-LLM) or in tokens (the rest)
        if capacity and not m.kv_capacity_estimated:
            b.kv_capacity = capacity
        if m.block_size:
            b.block_pad = block_pad(m.block_size)
        if m.running is not None:
            on_backend = m.running + (m.waiting or 0.0)
            self._fleet.observe(b.inflight, b.left, on_backend, self._clock.now())
        b.left = 0
        b.early_head.on_scrape(m.waiting, self._clock.now())
        self._tell_fleet(b)
        view = _engine_view(b, m)
        self._set_congestion(b, backend_congestion(view.kv_usage, view.waiting))
        b.limiter.on_metrics(view, self._clock.now())
        self._dispatcher.refresh(b)

    def metrics_stale(self, backend: str) -> None:
        b = self._dispatcher.backends.get(backend)
        if b is None:
            return
        b.metrics_fresh = False
        b.scraped = True
        self._set_congestion(b, None)
        b.limiter.on_metrics_stale(self._clock.now())
        self._dispatcher.refresh(b)

    def _set_congestion(self, b: BackendState, value: float | None) -> None:
        if b.congestion is not None:
            self._congestion_sum -= b.congestion
            self._congestion_n -= 1
        b.congestion = value
        if value is not None:
            self._congestion_sum += value
            self._congestion_n += 1

    # -- arrival -----------------------------------------------------------------------

    def arrive(self, req: RequestInfo, take: bool = False) -> Admission:
        now = self._clock.now()
        rid = req.request_id
        if rid in self._records:
            raise ValueError(f"request id {rid!r} is already queued or in flight")
        prio = req.priority
        if prio not in PRIORITIES:
            raise ValueError(f"priority must be 0, 1 or 2, got {prio!r}")
        if not req.weight > 0:
            raise ValueError("a tenant weight must be positive")
        counters = self._counters[prio]
        counters.arrived += 1
        q = self._queues[prio]
        claim = None
        if req.booking is not None and self._policy.retry_after.rule == "booking":
            claim = self._ledger.claim(
                req.booking, tenant=req.tenant, priority=prio, now=now, slot=req.booked_slot
            )
            if claim is not None:
                self._returns[prio].returned += 1
        returning = claim is not None
        self._drain.record_arrival(prio, now, returning)
        if self._handed_over:
            return self._refuse(counters, RejectCode.SHUTTING_DOWN, HANDOVER_RETRY_S)
        if not self._dispatcher.serves(req.model):
            return self._refuse(counters, RejectCode.NO_BACKEND, self._no_backend_retry_s)

        cost = self._cost
        prompt, expected_out, footprint = self._estimate(req)
        if self._dispatcher.never_fits(req.model, prompt):
            return self._refuse(counters, RejectCode.TOO_LARGE, 0.0)
        charge = self._quotas.charge_for(req.tenant, footprint)
        quota = self._quotas.acquire(req.tenant, charge, now)
        if not quota.ok:
            retry = min(60.0, max(self._drain.min_s, quota.retry_after_s))
            quota_code = deadline_code(RejectCode.TENANT_QUOTA, retry, now, _give_up_at(req))
            if quota_code is RejectCode.CANNOT_SERVE_IN_TIME:
                self._returns[prio].unservable += 1
            return self._refuse(counters, quota_code, retry)

        policy = q.policy
        patience = policy.timeout
        if req.client_deadline is not None:
            patience = min(patience, req.client_deadline - now)
        code: RejectCode | None
        if patience <= 0:
            code = RejectCode.QUEUE_TIMEOUT
        elif returning:
            # back in its slot: ahead of fresh arrivals, past the pressure rules and the
            # queue's size (the returns waiting at once are bounded by the room booked)
            code = None
        else:
            pressure = 0.0 if policy.drop_policy is DropPolicy.TAIL else self.pressure()
            predicted = 0.0
            thresholds = self._thresholds[prio]
            if pressure >= thresholds.shed_above and self._drain.warm(now):
                predicted = self._drain.wait_estimate(
                    prio, now, ahead=len(q), queued_above=self._queued_above(prio)
                )
            code = admission_code(
                policy,
                thresholds,
                queued=len(q),
                can_dispatch_now=self._dispatcher.has_free_slot(prio),
                pressure=pressure,
                predicted_wait_s=predicted,
                patience_s=patience,
            )
        if code is not None:
            self._quotas.refund(req.tenant, charge, now, quota.outage)
            refusal = self._refusal(prio, now, code, patience, req.tenant, _give_up_at(req))
            return self._refuse(counters, refusal.code, refusal.retry_after_s, refusal)

        self._seq += 1
        rec = RequestRecord(
            req,
            seq=self._seq,
            now=now,
            prompt_est=prompt,
            expected_output=expected_out,
            cost=footprint,
        )
        rec.quota_tokens = charge
        rec.quota_outage = quota.outage
        self._records[rid] = rec
        counters.admitted += 1
        if claim is not None:
            rec.returning = True
            rec.refused_at = claim.made
            self._returns[prio].returned_admitted += 1
        cost.note_admitted(req.model, rec.kv_tokens)
        q0, q1, q2 = self._queues
        if (
            not (q0.by_arrival or q1.by_arrival or q2.by_arrival)
            and self._dispatch_on_arrival
            and q.idle()
            and not (self._alarms and self._alarms[0][0] <= now)  # step fires them first
            and not q.due_at_once(rec, now, self._slacks()[prio])
        ):
            b = self._dispatcher.dispatch_alone(rec, now)
            if b is not None:
                q.passed(rec)
                if take and not self._ready and not self._pending:
                    # what the next step would report, and all it would: report it now
                    return Admission(True, assignment=self._started(rec, b, now))
                # its first-token alarm is armed when it is reported, as step() would
                self._ready.append((rec, self._started(rec, b, now, arm=False)))
                return _ADMITTED
        q.push(rec, returning=returning)
        return _ADMITTED

    def _estimate(self, req: RequestInfo) -> tuple[float, float, int]:
        """(corrected prompt, expected output of all its sequences, KV footprint)."""
        cost = self._cost
        prompt = cost.prompt_tokens(req.model, req.prompt_tokens)
        if req.prefill_only:
            expected_out = 0.0  # it generates nothing: KV for its prompt only
        else:
            expected_out = max(1, req.sequences) * cost.expected_output(
                req.tenant, req.model, req.max_tokens
            )
        return prompt, expected_out, footprint_tokens(prompt, expected_out)

    def cost_of(self, req: RequestInfo) -> int:
        """The request's estimated cost in tokens, as `arrive` would charge the tenant's
        token quota (a shared quota store is charged the same, before `arrive`)."""
        return self._estimate(req)[2]

    def _refuse(
        self,
        counters: ClassCounters,
        code: RejectCode,
        retry_s: float,
        refusal: Refusal | None = None,
    ) -> Admission:
        _bump(counters.rejected, code.value)
        if refusal is None or refusal.booking is None:
            return Admission(admitted=False, code=code, retry_after_s=retry_s)
        return Admission(
            admitted=False,
            code=code,
            retry_after_s=retry_s,
            booking=refusal.booking,
            retry_window_s=refusal.window_s,
        )

    def _refusal(
        self,
        prio: int,
        now: float,
        code: RejectCode,
        patience: float | None,
        tenant: str,
        give_up_at: float | None,
    ) -> Refusal:
        """What a refusal of this cause says: the policy's Retry-After rule
        (`retryAfter.rule`); with `booking`, the return slot booked for it, or
        `cannot_serve_in_time` when the earliest room is past the client's deadline."""
        rule = self._policy.retry_after.rule
        if rule == "fixed":
            return Refusal(code, self._policy.retry_after.fixed_seconds)
        if rule == "drain":
            return Refusal(code, self._retry_after(prio, now, code, patience))
        ledger = self._ledger
        not_after = None if give_up_at is None else give_up_at - self._ttft.get(0.0)
        if give_up_at is not None and no_retry_fits(now, give_up_at):
            not_after = -math.inf  # no whole-second Retry-After fits in what is left
        offer = self._offer(prio, now, tenant, not_after)
        returns = self._returns[prio]
        if offer.booking is not None:
            returns.booked += 1
            ra = max(self._drain.min_s, offer.booking.due - now)
            return Refusal(code, ra, offer.booking.id, offer.booking.window)
        horizon = ledger.horizon_s
        if offer.slot is not None or (not_after is not None and not_after < now + horizon):
            returns.unservable += 1
            room = horizon if offer.slot is None else offer.slot - now
            return Refusal(RejectCode.CANNOT_SERVE_IN_TIME, room)
        # no room forecast within the horizon: the longest answer, no promise
        return Refusal(code, horizon)

    def _offer(
        self, prio: int, now: float, tenant: str, not_after: float | None, book: bool = True
    ) -> Offer:
        """The ledger's return slot for a refusal of this class now (a quote: book=False)."""
        f = self._room_forecast(now, prio)
        return self._ledger.offer(
            prio,
            now,
            rate=f.rate,
            excess=f.excess,
            decay_s=f.decay_s,
            capacity=f.capacity,
            ahead=float(sum(len(self._queues[p]) for p in range(prio + 1))),
            tenant=tenant,
            not_after=not_after,
            lead_s=self._lead(prio, self._ttft.get(0.0)),
            book=book,
        )

    def _lead(self, prio: int, ttft: float) -> float:
        """How much earlier than its forecast room a refused client is told to come back:
        half the wait its queue allows (the class timeout less the early-drop slack). If
        the forecast holds it waits that long in the queue, ahead of fresh arrivals; if
        room comes sooner than forecast (a burst above ends), it is served that much
        sooner; later, the queue absorbs up to the other half."""
        q = self._queues[prio].policy
        lead = self._return_lead * max(0.0, q.timeout - head_slack(q, ttft))
        return min(self._return_lead_max, lead)

    def _room_forecast(self, now: float, prio: int) -> Forecast:
        """The room forecast for class `prio` (requests per second it can start, tau s
        ahead: rate - excess * exp(-tau / decay)), from what is dispatched now: all of
        it (plus what free slots would turn over) less the fresh (not returning) demand of
        the classes above at its long-run level (`rate`), less what they take above that
        level now (`excess`): a burst above, expected to last as long again as it has
        lasted so far (`decay`, Lindy). The booked returns of the classes above are the
        ledger's to subtract, bin by bin (return_slots.py)."""
        d = self._drain
        total = 0.0
        for p in PRIORITIES:
            total += d.rate(p, now)
        # free slots turn over once per time a request holds one (1 s until one has
        # finished: an idle gateway has room now, not in a minute; at least 10 ms)
        total += self._free_slots(prio) / max(0.01, self._service.get(1.0))
        rate = total
        excess = 0.0
        age = 0.0
        for p in range(prio):
            # the demand above: fresh arrivals (admitted now, or refused and booked:
            # they take room before this class either way), against its usual level
            fresh = d.fresh_arrival_rate(p, now)
            usual = d.usual_arrival_rate(p, now)
            if usual is None:
                usual = fresh
            burst = d.burst_age(p, now)
            if burst is not None:
                age = max(age, burst)
            rate -= min(fresh, usual)
            excess += max(0.0, fresh - usual)
        return Forecast(max(0.0, rate), excess, max(MIN_BURST_S, age), total)

    def _free_slots(self, prio: int) -> int:
        free = 0
        for b in self._dispatcher.backends.values():
            if b.healthy:
                cap = b.limit if prio == 0 else b.cap_low
                if cap > b.inflight:
                    free += cap - b.inflight
        return free

    def _queued_above(self, prio: int) -> int:
        return sum(len(self._queues[p]) for p in range(prio))

    def _retry_after(
        self, prio: int, now: float, code: RejectCode | None, patience: float | None = None
    ) -> float:
        """Retry-After for a refusal of this cause (retry_after.py has the rule): how far
        the queue must drain before such a newcomer is accepted, over the net drain."""
        q = self._queues[prio]
        timeout = q.policy.timeout
        excess = refusal_excess(
            code,
            queued=len(q),
            max_queue_size=q.policy.max_queue_size,
            patience_s=timeout if patience is None else patience,
            class_rate=self._drain.rate(prio, now),
            queued_total=sum(len(x) for x in self._queues),
            limit_total=self._dispatcher.limit_total,
            fast_reject_above=self._policy.pressure.fast_reject_above,
        )
        return self._drain.retry_after(prio, now, excess=excess, timeout_s=timeout)

    # -- dispatch and expiry -----------------------------------------------------------

    def _slacks(self) -> list[float]:
        """Per priority: how much earlier than its deadline a queued request is dropped.
        Cached: it changes only with the expected TTFT or the policy."""
        ttft = self._ttft.get(0.0)
        cached = self._slack_cache
        if cached is not None and cached[0] == ttft:
            return cached[1]
        slacks = [head_slack(q.policy, ttft) for q in self._queues]
        self._slack_cache = (ttft, slacks)
        return slacks

    def step(self) -> Step:
        """One pass after any event: overdue first-token alarms, queued requests whose
        wait is over, what may be dispatched now, and when to look again. The shell calls
        it after every arrival, finish, cancel and health or metrics change, and when the
        time it returned comes."""
        now = self._clock.now()
        if self._alarms and self._alarms[0][0] <= now:
            self._check_alarms(now)
        ready = self._take_ready() if self._ready else []
        q0, q1, q2 = self._queues
        if not (q0.by_arrival or q1.by_arrival or q2.by_arrival):
            # Nothing queued: nothing to dispatch or drop (the common case below the limit).
            out, self._pending = self._pending, []
            return _new_step(Step, (ready, out, now if out else self._next_alarm()))
        slacks = self._slacks()
        assignments = self._dispatch_at(now, slacks)
        if ready:
            assignments = ready + assignments
        out, self._pending = self._pending, []
        return _new_step(Step, (assignments, out, now if out else self._wakeup(slacks)))

    def quiet(self) -> bool:
        """Whether a step now could only say when to look again (nothing queued, nothing
        to report, no alarm due). A driver that keeps its timer armed for the times steps
        return (and `next_alarm_at` after a placement taken on arrival) may skip it."""
        q0, q1, q2 = self._queues
        if self._pending or self._ready or q0.by_arrival or q1.by_arrival or q2.by_arrival:
            return False
        alarms = self._alarms
        return not (alarms and alarms[0][0] <= self._clock.now())

    def next_alarm_at(self) -> float | None:
        """When the earliest first-token alarm is due (maybe one no longer needed)."""
        return self._alarms[0][0] if self._alarms else None

    def _take_ready(self) -> list[Assignment]:
        """The assignments made by `arrive` since the last pass, but for the cancelled.
        Called after the pass has fired its due alarms, where it would have placed them."""
        ready, self._ready = self._ready, []
        out = []
        for rec, a in ready:
            if rec.state is RequestState.INFLIGHT:
                if rec.info.first_token_visible:
                    assert rec.backend is not None and rec.dispatched_at is not None
                    self._arm(rec, rec.backend, rec.dispatched_at)
                out.append(a)
        return out

    def _dispatch_at(self, now: float, slacks: list[float]) -> list[Assignment]:
        self._collect_due(now, slacks)
        placed, dropped = self._dispatcher.dispatch(self._queues, now, slacks)
        for rec in dropped:
            self._drop(rec, RejectCode.QUEUE_TIMEOUT, now)
        return [self._started(rec, b, now) for rec, b in placed]

    def _started(
        self, rec: RequestRecord, b: BackendState, now: float, arm: bool = True
    ) -> Assignment:
        """Book-keeping for a request the dispatcher just placed on `b`."""
        rec.state = RequestState.INFLIGHT
        rec.dispatched_at = now
        rec.inflight_at_send = b.inflight
        prio = rec.priority
        self._counters[prio].dispatched += 1
        self._drain.record_dispatch(prio, now, rec.returning)
        if rec.refused_at is not None:
            returns = self._returns[prio]
            returns.waited_s += now - rec.refused_at
            returns.waited += 1
        if arm and rec.info.first_token_visible:
            self._arm(rec, b, now)
        return Assignment(
            rec.request_id,
            b.name,
            now - rec.enqueued_at,
            # a stated deadline may still end before the first token: a 504, not an
            # error event after a 200 (core/early_head.py)
            rec.info.give_up_at is None and b.early_head.allowed(b.metrics_fresh, now),
        )

    def _stalled(self, start: float, end: float) -> float:
        """Seconds of [start, end] the host did not run the gateway (0 without a source)."""
        return 0.0 if self._stalls is None else self._stalls.stalled(start, end)

    def _arm(self, rec: RequestRecord, b: BackendState, now: float) -> None:
        """The alarm that feeds the limiter if the first token is overdue."""
        alarm = b.limiter.ttft_alarm_after(rec.prompt_est + rec.prefill_ahead)
        if alarm is not None:
            heapq.heappush(self._alarms, (now + alarm, rec.seq, rec.request_id, alarm))

    def _wakeup(self, slacks: list[float]) -> float | None:
        at: float | None = None
        for q, slack in zip(self._queues, slacks, strict=True):
            if q.by_arrival:
                t = q.next_due(slack)
                if t is not None and (at is None or t < at):
                    at = t
        alarm = self._next_alarm()
        if alarm is not None and (at is None or alarm < at):
            at = alarm
        hold = self._dispatcher.hold_ends_at
        if hold is not None and (at is None or hold < at):
            at = hold  # a large request stops holding the others back then
        return at

    def _next_alarm(self) -> float | None:
        alarms = self._alarms
        while alarms and not self._alarm_live(alarms[0]):
            heapq.heappop(alarms)
        return alarms[0][0] if alarms else None

    def _collect_due(self, now: float, slacks: list[float]) -> None:
        for q, slack in zip(self._queues, slacks, strict=True):
            if q.by_arrival:
                for rec in q.pop_due(now, slack):
                    self._drop(rec, RejectCode.QUEUE_TIMEOUT, now)

    def _forget_dropped(self, rec: RequestRecord, code: RejectCode, now: float) -> None:
        """A request taken out of its queue unserved: counted as dropped, its quota back."""
        del self._records[rec.request_id]
        rec.state = RequestState.GONE
        _bump(self._counters[rec.priority].dropped, code.value)
        self._quotas.refund(rec.tenant, rec.quota_tokens, now, rec.quota_outage)

    def _drop(self, rec: RequestRecord, code: RejectCode, now: float) -> None:
        self._forget_dropped(rec, code, now)
        refusal = self._refusal(rec.priority, now, code, None, rec.tenant, _give_up_at(rec.info))
        self._pending.append(
            Rejection(
                rec.request_id,
                refusal.code,
                refusal.retry_after_s,
                now - rec.enqueued_at,
                refusal.booking,
                refusal.window_s,
            )
        )

    def _alarm_live(self, alarm: tuple[float, int, str, float]) -> bool:
        rec = self._records.get(alarm[2])
        return (
            rec is not None
            and rec.seq == alarm[1]
            and rec.state is RequestState.INFLIGHT
            and rec.first_token_at is None
        )

    def _check_alarms(self, now: float) -> None:
        alarms = self._alarms
        while alarms and alarms[0][0] <= now:
            alarm = heapq.heappop(alarms)
            if not self._alarm_live(alarm):
                continue
            rec = self._records[alarm[2]]
            b = rec.backend
            assert b is not None and rec.dispatched_at is not None
            waited = now - rec.dispatched_at
            stalled = self._stalled(rec.dispatched_at, now)
            if stalled > 0:
                # the host stopped while it waited: the alarm is due once the engine has
                # had its whole time
                waited -= stalled
                left = alarm[3] - waited
                if left > 1e-6:  # (not a rounding error's worth)
                    heapq.heappush(alarms, (now + left, *alarm[1:]))
                    continue
            b.limiter.on_sample(
                Sample(
                    ttft_s=waited,
                    prompt_tokens=round(rec.prompt_est),
                    inflight=rec.inflight_at_send,
                    sent_at=rec.dispatched_at,
                    prefill_ahead=rec.prefill_ahead,
                    pending=True,
                ),
                now,
            )
            self._dispatcher.refresh(b)

    # -- request lifecycle -------------------------------------------------------------

    def cancel(self, request_id: str) -> None:
        rec = self._records.pop(request_id, None)
        if rec is None:
            return
        now = self._clock.now()
        counters = self._counters[rec.priority]
        if rec.state is RequestState.QUEUED:
            self._queues[rec.priority].remove(request_id)
            counters.cancelled_queued += 1
            self._quotas.refund(rec.tenant, rec.quota_tokens, now, rec.quota_outage)
        else:
            self._dispatcher.release(rec, now)
            counters.cancelled_inflight += 1
            if self._ready and any(r is rec for r, _ in self._ready):
                # dispatched by arrive() but never reported, so never sent
                self._quotas.refund(rec.tenant, rec.quota_tokens, now, rec.quota_outage)
            else:
                self._quotas.release(rec.tenant, now, rec.quota_outage)
        rec.state = RequestState.GONE

    def hand_over(self) -> None:
        """The gateway is shutting down: every queued request is handed back at once
        (`shutting_down`, to retry on another replica after `HANDOVER_RETRY_S`; the next
        step reports them), and nothing is admitted any more. What is in flight goes on.
        Kept, the queue would be served at this replica's claims on the backends, which
        follow what it holds and shrink as it drains: `sluice bench fleet`'s replicas
        still held 1,184 queued requests when their grace period ended and cut them."""
        if self._handed_over:
            return
        self._handed_over = True
        now = self._clock.now()
        code = RejectCode.SHUTTING_DOWN
        for q in self._queues:
            for rec in list(q.by_arrival.values()):
                q.remove(rec.request_id)
                self._forget_dropped(rec, code, now)
                self._pending.append(
                    Rejection(rec.request_id, code, HANDOVER_RETRY_S, now - rec.enqueued_at)
                )

    def on_first_token(self, request_id: str) -> None:
        rec = self._records.get(request_id)
        if rec is None or rec.state is not RequestState.INFLIGHT or rec.first_token_at is not None:
            return
        now = self._clock.now()
        assert rec.dispatched_at is not None and rec.backend is not None
        self._dispatcher.prefilled(rec)
        rec.first_token_at = now
        ttft = now - rec.dispatched_at
        stalled = self._stalled(rec.dispatched_at, now)
        ttft -= stalled
        self._ttft.update(ttft)
        b = rec.backend
        b.limiter.on_sample(
            Sample(
                ttft_s=ttft,
                prompt_tokens=round(rec.prompt_est),
                inflight=rec.inflight_at_send,
                sent_at=rec.dispatched_at,
                prefill_ahead=rec.prefill_ahead,
                priority=rec.priority,
                stalled_s=stalled,
                client_budget_s=None if rec.deadline is None else rec.deadline - rec.enqueued_at,
                max_tokens=rec.info.max_tokens,
            ),
            now,
        )
        self._dispatcher.refresh(b)

    def on_finish(
        self,
        request_id: str,
        outcome: Outcome,
        prompt_tokens: int | None = None,
        completion_tokens: int | None = None,
    ) -> None:
        rec = self._records.get(request_id)
        if rec is None or rec.state is not _INFLIGHT:
            return
        if rec.pipelined and outcome is Outcome.OK:
            # Its answer is its first token: the first-token signals (its TTFT against
            # what the backend explains, the prefill rate and bound, the classes' TTFT
            # objectives) hear of it as of a streamed request's, and steer the pipeline.
            # Beside generation requests they steer by those requests' own (embeddings'
            # samples grew the limit there, and P0 chat waited: `mixed-routes` P0 98 %).
            self.on_first_token(request_id)
        del self._records[request_id]
        rec.state = RequestState.GONE
        now = self._clock.now()
        b = rec.backend
        assert b is not None and rec.dispatched_at is not None
        self._dispatcher.release(rec, now, refresh=False)  # refreshed once, below
        if outcome is Outcome.OVERLOADED:
            b.early_head.on_refusal(now)
        self._service.update(now - rec.dispatched_at)
        finished = self._counters[rec.priority].finished
        key = str(outcome)  # its value (StrEnum), without enum's Python-level property
        finished[key] = finished.get(key, 0) + 1
        info = rec.info
        if outcome is Outcome.OK:
            # a prefill-only request teaches the prompt ratio, never an output length
            self._cost.observe(
                rec.tenant,
                rec.model,
                info.prompt_tokens,
                prompt_tokens,
                None if info.prefill_only else completion_tokens,
                info.sequences,
            )
        delta = settlement(rec.quota_tokens, outcome, prompt_tokens, completion_tokens)
        if delta:
            self._quotas.settle(rec.tenant, delta, now, rec.quota_outage)
        self._quotas.release(rec.tenant, now, rec.quota_outage)
        if outcome is Outcome.CANCELLED:
            self._dispatcher.refresh(b)
            return  # no latency signal
        e2e = now - rec.dispatched_at
        first = rec.first_token_at
        ttft = None if first is None else first - rec.dispatched_at
        stalled = self._stalled(rec.dispatched_at, now)
        e2e -= stalled
        if first is not None and stalled:
            ttft = first - rec.dispatched_at - self._stalled(rec.dispatched_at, first)
        if info.prefill_only:
            ttft = e2e  # its one step is its prefill: its whole time is its TTFT
        tpot = None
        if ttft is not None and completion_tokens is not None and completion_tokens >= 2:
            tpot = (e2e - ttft) / (completion_tokens - 1)
        b.limiter.on_sample(
            Sample(
                ttft_s=ttft,
                tpot_s=tpot,
                prompt_tokens=prompt_tokens if prompt_tokens is not None else round(rec.prompt_est),
                completion_tokens=completion_tokens or 0,
                inflight=rec.inflight_at_send,
                dropped=outcome in _DROP_OUTCOMES,
                sent_at=rec.dispatched_at,
                e2e_s=e2e,
                priority=rec.priority,
                client_budget_s=None if rec.deadline is None else rec.deadline - rec.enqueued_at,
                max_tokens=rec.info.max_tokens,
                stalled_s=stalled,
            ),
            now,
        )
        self._dispatcher.refresh(b)

    # -- state -------------------------------------------------------------------------

    def _pressure_inputs(self, now: float) -> PressureInputs:
        d = self._dispatcher
        queued = 0
        ratio = 0.0
        for q in self._queues:
            n = len(q)
            if n:
                queued += n
                r = q.head_sojourn(now) / q.policy.timeout
                if r > ratio:
                    ratio = r
        cong = self._congestion_sum / self._congestion_n if self._congestion_n else 0.0
        return PressureInputs(
            inflight=d.inflight_total,
            limit_total=d.limit_total,
            queued=queued,
            max_sojourn_ratio=ratio,
            backend_congestion=cong,
        )

    def pressure(self) -> float:
        return compute_pressure(self._pressure_inputs(self._clock.now()))

    def fleet_share(self) -> float:
        """This gateway's estimated part of the fleet sharing its backends (1: alone)."""
        return self._fleet.value

    def _tell_fleet(self, b: BackendState) -> None:
        """Before a scrape reaches its limiter: what is ours in the scrape's KV usage (the
        rest is other replicas'), and our part of the fleet's claim on what is left."""
        b.limiter.on_fleet(float(b.inflight_tokens), self._fleet.value, self._fleet.fresh)

    def expect_peers(self, processes: int | None) -> None:
        """`processes` gateway processes are alive (`--workers`, the policy's
        `fleet.gateways`, Redis's count): this one's part of the fleet is 1/processes
        (core/fleet_share.py); None: not known, learned from the scrapes."""
        self._fleet.expect_peers(processes)
        self._dispatcher.peers_known = processes is not None and processes > 1

    def state_of(self, request_id: str) -> RequestState:
        rec = self._records.get(request_id)
        return RequestState.GONE if rec is None else rec.state

    def backend_of(self, request_id: str) -> str | None:
        rec = self._records.get(request_id)
        if rec is None or rec.backend is None:
            return None
        return rec.backend.name

    def snapshot(self) -> ControllerSnapshot:
        """What the controller shows of itself (core/snapshot.py; its `as_dict()` is the
        JSON form /admin/state serves)."""
        now = self._clock.now()
        classes: dict[str, ClassSnapshot] = {}
        for q, c in zip(self._queues, self._counters, strict=True):
            prio = q.priority
            classes[CLASS_NAMES[prio]] = ClassSnapshot(
                name=q.policy.name,
                queued=len(q),
                head_sojourn_s=q.head_sojourn(now),
                dispatch_rate=self._drain.rate(prio, now),
                arrival_rate=self._drain.arrival_rate(prio, now),
                retry_after_s=self._quote(prio, now),
                returns=self._returns_snapshot(prio, now),
                tenants_queued=q.tenant_depths(),
                arrived=c.arrived,
                admitted=c.admitted,
                rejected=dict(c.rejected),
                dispatched=c.dispatched,
                dropped=dict(c.dropped),
                cancelled_queued=c.cancelled_queued,
                cancelled_inflight=c.cancelled_inflight,
                finished=dict(c.finished),
            )
        backends: dict[str, BackendSnapshot] = {}
        for b in self._dispatcher.backends.values():
            m = b.last_metrics if b.metrics_fresh else None
            engine, signals = _signals(b.last_metrics)
            backends[b.name] = BackendSnapshot(
                healthy=b.healthy,
                limit=b.limit,
                inflight=b.inflight,
                inflight_tokens=b.inflight_tokens,
                kv_budget_tokens=b.kv_budget,
                kv_usage=None if m is None else m.kv_usage,
                waiting=None if m is None else m.waiting,
                metrics_fresh=b.metrics_fresh,
                models=tuple(sorted(b.models)),
                engine=engine,
                signals=signals,
                limiter=b.limiter.describe(),
                outputs_bounded=b.bounded,
                ceiling=b.ceiling,
            )
        return ControllerSnapshot(
            pressure=self.pressure(),
            algorithm=self._policy.limiter.algorithm,
            expected_ttft_s=self._ttft.get(0.0),
            aged_dispatches=self._dispatcher.aged_dispatches,
            fleet=self._fleet.describe(),
            classes=classes,
            backends=backends,
        )

    def limits(self) -> dict[str, int]:
        """Each backend's limit in force: what a driver sampling them often reads instead
        of a whole snapshot."""
        return {name: b.limit for name, b in self._dispatcher.backends.items()}

    def _quote(self, prio: int, now: float) -> float:
        """The Retry-After a refusal of this class would be given now (nothing booked)."""
        rule = self._policy.retry_after.rule
        if rule != "booking":
            return self._refusal(prio, now, RejectCode.QUEUE_FULL, None, "", None).retry_after_s
        offer = self._offer(prio, now, "", None, book=False)
        if offer.due is None:
            return self._ledger.horizon_s
        return max(self._drain.min_s, offer.due - now)

    def _returns_snapshot(self, prio: int, now: float) -> ReturnsSnapshot:
        ledger = self._ledger
        r = self._returns[prio]
        return ReturnsSnapshot(
            booked=r.booked,
            returned=r.returned,
            returned_admitted=r.returned_admitted,
            unservable=r.unservable,
            waited=r.waited,
            waited_s=r.waited_s,
            outstanding=ledger.outstanding(prio),
            expired=ledger.expired[prio],
            show_rate=round(ledger.show_rate(prio), 4),
            booked_ahead_s=round(ledger.booked_until(prio, now), 3),
            room_rate=round(self._room_forecast(now, prio).rate, 3),
        )

    # -- hot reload --------------------------------------------------------------------

    def apply_policy(self, policy: CoreSettings) -> None:
        """New sizes, timeouts, drop policies, thresholds, reservations, quotas and limiter
        settings; queued and in-flight requests stay where they are (a queue over its new
        size keeps its requests and refuses newcomers until it is below)."""
        now = self._clock.now()
        old = self._policy
        self._policy = policy
        for q in self._queues:
            q.policy = policy.queue(q.priority)
        self._slack_cache = None
        self._thresholds = class_thresholds(policy)
        self._drain.max_s = policy.pressure.max_retry_after
        self._ledger.horizon_s = policy.pressure.max_retry_after
        d = self._dispatcher
        d.aging_after_s = policy.dispatcher.aging_after
        d.hold_for_large_s = policy.dispatcher.hold_for_large
        d.set_reserved(policy.dispatcher.reserved_p0)
        for b in d.backends.values():
            b.limiter.on_policy(self._limiter_context(b.name))
        self._quotas.set_limits(policy.tenants, now)
        if policy.limiter != old.limiter:
            for b in d.backends.values():
                b.limiter = self._new_limiter(b.name, initial=b.limit)
                b.limiter.on_release(b.inflight, now)
                if b.metrics_fresh and b.last_metrics is not None:
                    self._tell_fleet(b)
                    b.limiter.on_metrics(_engine_view(b, b.last_metrics), now)
                d.refresh(b)


def _engine_view(b: BackendState, m: BackendMetrics) -> BackendMetrics:
    """The scrape without the queue places and KV our prefill-only requests' pipeline
    takes there by design (core/prefill_pipeline.py)."""
    return engine_view(m, b.pipelined, b.pipelined_tokens, b.kv_capacity)


def _signals(m: BackendMetrics | None) -> tuple[str | None, dict[str, bool] | None]:
    """The engine behind a backend and which of its signals the limiter has (from the last
    scrape that said so, fresh or not: what an engine exports does not change when one
    scrape fails)."""
    if m is None or m.signals is None:
        return (None if m is None else m.engine), None
    return m.engine, {s: s in m.signals for s in SIGNALS}
