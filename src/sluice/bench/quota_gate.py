"""One gateway replica's shared-quota gate in virtual time: `SharedQuotaGate`
(gateway/shared_quota.py) with its calls to Redis made events against a `QuotaStore`.

What it decides is the gateway's own code: the circuit (`QuotaCircuit`), what the
Controller charges while the store is lost (`FailoverQuotas` over an `InProcessQuotas`),
the sights, the take-over and the hand-back (core/quota_failover.py), the charge cap and
the one charge rule (core/quota.py), and the gateway's constants. What this module does is
the shell's I/O, in the same order as `SharedQuotaGate`:

* a request of a tenant with a quota is checked in the store before the Controller sees
  it (`acquire`): the call reaches the store half a round trip after it is sent and the
  answer is back half a round trip later; a refused call fails after the round trip, one
  the store never answers at the call's timeout (1 s); calls out with none answered for
  `STALL_S` are stalled; a failed or stalled call makes the circuit go local, and every
  request still waiting for its check goes on at once, checked by the local share;
  while local, no call is made;
* what a finished request gives back (`close`, the ticket's rule: never ran, all of it;
  ran, by its usage) is summed per tenant and sent in one call `FLUSH_S` later; while
  local it is not sent (the local quotas have it);
* a background loop wakes every quarter of a second: while local it probes (a PING, then
  the hand-back, within `PROBE_TIMEOUT_S`) every `REPROBE_S`; while shared it beats every
  `HEARTBEAT_S` (faster in its first seconds): the live processes, the stale sights, the
  open requests of capped tenants; a probe is due at once when a timeout or a stall made
  the circuit go local, and a wake during a turn brings the next turn at once.

Events go through `schedule(t, fn)` (the harness's heap); `fn(t)` runs at virtual time `t`.
The circuit and the sights read the replica's own clock; the store its own time. Not
modelled: a client leaving while its check is in flight (a check takes milliseconds, the
clients' deadlines are seconds), the quota-mode metrics and logs.
"""

from __future__ import annotations

import functools
import math
import random
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

from sluice.bench.quota_store import AcquireAnswer, QuotaStore, Sight
from sluice.core.clock import Clock
from sluice.core.quota import InProcessQuotas, capped_charge, settlement
from sluice.core.quota_failover import (
    FailoverQuotas,
    HandBack,
    HandBackDue,
    QuotaCircuit,
    QuotaSight,
    has_quota,
)
from sluice.core.settings import TenantLimits
from sluice.core.types import Outcome
from sluice.gateway.shared_quota import (
    CALL_TIMEOUT_S,
    CONCURRENCY_RETRY_S,
    DEMAND_TAU_S,
    FLUSH_S,
    HEARTBEAT_S,
    PROBE_TIMEOUT_S,
    REPROBE_S,
    RETRY_MAX_S,
    RETRY_MIN_S,
    SIGHTS_PER_BEAT,
    STALE_AFTER_S,
    STALL_S,
)

T = TypeVar("T")
Schedule = Callable[[float, Callable[[float], None]], None]
Done = Callable[[float, bool | None], None]  # a call is back at t (None: it failed)
Call = Callable[[float, Done], None]  # start a call at t


class Ticket:
    """One request's charge in the store (gateway/shared_quota.py `QuotaTicket`);
    `settled_at`: when what it gave back reached the store (inf: never, or not yet)."""

    __slots__ = (
        "charged_at",
        "closed",
        "ok",
        "retry_after_s",
        "settled_at",
        "shared",
        "tenant",
        "tokens",
    )

    def __init__(
        self,
        tenant: str,
        tokens: int,
        *,
        ok: bool,
        shared: bool,
        retry_after_s: float = 0.0,
        charged_at: float = math.nan,
    ) -> None:
        self.tenant = tenant
        self.tokens = tokens  # what was charged (at most a full bucket)
        self.ok = ok
        self.shared = shared  # charged in the store (else the Controller charged locally)
        self.retry_after_s = retry_after_s
        self.charged_at = charged_at  # the store's time of the charge
        self.settled_at = math.inf
        self.closed = not (ok and shared)


class VirtualQuotaGate:
    """`SharedQuotaGate` of one replica, in virtual time (module docstring).

    `on_local(t, gate)` is told when the circuit goes local (after the take-over);
    `on_reshare(t, gate)` when a share moved with the fleet share (no count of the
    processes); `on_hand_back(t, gate, owed)` when the hand-back is in (before the circuit
    closes)."""

    def __init__(
        self,
        store: QuotaStore,
        tenants: Iterable[TenantLimits],
        clock: Clock,
        schedule: Schedule,
        *,
        process: str,
        rng: random.Random,
        on_local: Callable[[float, VirtualQuotaGate], None] | None = None,
        on_hand_back: Callable[[float, VirtualQuotaGate, dict[str, HandBack]], None] | None = None,
        on_reshare: Callable[[float, VirtualQuotaGate], None] | None = None,
        call_timeout_s: float = CALL_TIMEOUT_S,
        reprobe_s: float = REPROBE_S,
        heartbeat_s: float = HEARTBEAT_S,
        stale_after_s: float = STALE_AFTER_S,
        stall_s: float = STALL_S,
    ) -> None:
        self.store = store
        self.clock = clock  # the replica's own
        self._schedule = schedule
        self.process = process
        self._rng = rng
        self._on_local = on_local
        self._on_hand_back = on_hand_back
        self._on_reshare = on_reshare
        self.call_timeout_s = call_timeout_s
        self.heartbeat_s = heartbeat_s
        self.stale_after_s = stale_after_s
        # as SharedQuotaGate's: how long another process may still be local after a return
        self.hold_after_return_s = reprobe_s + min(reprobe_s, heartbeat_s) / 4 + PROBE_TIMEOUT_S
        self.circuit = QuotaCircuit(clock, reprobe_s=reprobe_s, stall_s=stall_s)
        self._limits: dict[str, TenantLimits] = {}
        self.controller_quotas = FailoverQuotas(
            InProcessQuotas(concurrency_retry_s=CONCURRENCY_RETRY_S),
            self.circuit,
            on_limits=self.set_limits,
        )
        self.controller_quotas.set_limits(tenants)
        self._open: dict[str, int] = {}  # charged in the store and not yet finished
        self._charged: dict[str, int] = {}  # of those, the ones the store said yes to
        self._busy: dict[str, int] = {}  # calls in flight per tenant
        # requests waiting for their check, by a key: tenant, tokens, where to answer
        self._waiting: dict[int, tuple[str, int, Callable[[float, Ticket], None]]] = {}
        self._keys = 0
        self._stall_armed = False
        self._woken = False  # woken during a turn: the next one comes at once
        self._beating = False  # a heartbeat is under way (going local cuts it short)
        self._beat_gen = 0
        self._exit_until: float | None = None  # exiting while local: hand back until then
        self._exit_probe = False
        self._owed: dict[str, list[int]] = {}  # per tenant: requests, tokens, slots back
        self._owed_tickets: dict[str, list[Ticket]] = {}
        self._flush_pending = False
        self._looping = False  # the background loop is doing something (not waiting)
        self._loop_gen = 0  # a wake-up or a tick of an older wait is void
        self._started = 0.0
        self._next_beat = 0.0
        self.stopped = False
        self.went_local = 0
        self.unchecked = 0  # requests let through unchecked: their call failed, still shared
        self.late = 0  # checks answered after their request went on (checked locally)

    @property
    def mode(self) -> str:
        return "redis" if self.circuit.shared else "local"

    def set_limits(self, tenants: Iterable[TenantLimits]) -> None:
        self._limits = {t.name: t for t in tenants if has_quota(t)}

    def limits(self, tenant: str) -> TenantLimits | None:
        return self._limits.get(tenant)

    # -- one call -------------------------------------------------------------------------

    def _call(
        self,
        t: float,
        op: Callable[[float], T],
        then: Callable[[float, T | None], None],
        *,
        timeout_s: float | None = None,
        raw: bool = False,
    ) -> None:
        """Send a call at `t`: `op(store_time)` runs when it reaches the store, `then(t,
        result)` when its answer is back (None: it failed). Unless `raw` (the probe), the
        circuit learns of it as `SharedQuotaGate._call` makes it."""
        rtt = self.store.round_trip(self._rng)
        limit = self.call_timeout_s if timeout_s is None else timeout_s
        late = rtt >= limit  # answered, but after the caller gave up
        epoch = -1
        if not raw:
            epoch = self.circuit.sent()
            self._watch_stall(t)

        def at_store(ts: float) -> None:
            failure = self.store.failure(ts)
            if failure is None:
                result = op(ts)
                if not late:
                    self._schedule(
                        ts + rtt / 2, lambda ta: self._answer(ta, result, then, raw, epoch)
                    )
            elif failure == "refused" and not late:
                self._schedule(
                    ts + rtt / 2, lambda ta: self._fail(ta, "connection", then, raw, epoch)
                )
            elif not late:
                self._schedule(t + limit, lambda ta: self._fail(ta, "timeout", then, raw, epoch))

        self._schedule(t + rtt / 2, at_store)
        if late:
            self._schedule(t + limit, lambda ta: self._fail(ta, "timeout", then, raw, epoch))

    def _answer(
        self, t: float, result: T, then: Callable[[float, T | None], None], raw: bool, epoch: int
    ) -> None:
        if not raw and not self.stopped:
            self.circuit.answered(epoch)
        then(t, result)

    def _fail(
        self, t: float, kind: str, then: Callable[[float, Any], None], raw: bool, epoch: int
    ) -> None:
        if not raw and not self.stopped and self.circuit.failed(epoch, timeout=kind == "timeout"):
            self._went_local(t)
        then(t, None)

    def _watch_stall(self, t: float) -> None:
        """`SharedQuotaGate._watch_stall`: one timer for the calls out."""
        at = self.circuit.stall_at()
        if at is None or self._stall_armed or self.stopped:
            return
        self._stall_armed = True
        self._schedule(t + max(0.0, at - self.clock.now()), self._stall_due)

    def _stall_due(self, t: float) -> None:
        self._stall_armed = False
        if self.stopped:
            return
        if self.circuit.stalled():
            self._went_local(t)
        else:
            self._watch_stall(t)

    def _went_local(self, t: float) -> None:
        """`SharedQuotaGate._went_local`: the take-over, then every request waiting for
        its check goes on, checked by the local share; the probe is due at once when the
        store is only suspect."""
        self.went_local += 1
        self.controller_quotas.take_over(self.clock.now(), self._charged)
        waiting, self._waiting = self._waiting, {}
        for tenant, tokens, answer in waiting.values():
            ticket = Ticket(tenant, tokens, ok=True, shared=False)
            self._schedule(t, functools.partial(_give, answer, ticket))
        if self._on_local is not None:
            self._on_local(t, self)
        cut = self._beating
        if cut:  # cut short: its calls may hang a second each
            self._beat_gen += 1
            self._beating = False
            self._looping = False
        if cut or not self.circuit.confirmed:  # (suspect: the probe is due at once)
            self._wake(t)

    # -- the request path -----------------------------------------------------------------

    def acquire(
        self, t: float, tenant: str, tokens: int, answer: Callable[[float, Ticket], None]
    ) -> Ticket | None:
        """Charge one request of `tokens` in the store; None: `answer(t, ticket)` comes
        when the call is back. While local (or for a tenant without a quota) the ticket
        is returned at once and the Controller charges the local quotas."""
        lim = self._limits.get(tenant)
        if lim is None or not self.circuit.shared:
            return Ticket(tenant, tokens, ok=True, shared=False)
        if self.circuit.stalled():  # the calls out went unanswered
            self._went_local(t)
            return Ticket(tenant, tokens, ok=True, shared=False)
        tokens = capped_charge(tokens, lim.tokens_per_minute)
        self._open[tenant] = self._open.get(tenant, 0) + 1
        self._busy[tenant] = self._busy.get(tenant, 0) + 1
        key = self._keys = self._keys + 1
        self._waiting[key] = (tenant, tokens, answer)

        def op(ts: float) -> tuple[float, AcquireAnswer]:
            got = self.store.acquire(
                ts,
                tenant,
                rpm=lim.requests_per_minute,
                tpm=lim.tokens_per_minute,
                max_concurrency=lim.max_concurrency,
                tokens=tokens,
                process=self.process,
                stale_s=self.stale_after_s,
                concurrency_retry_s=CONCURRENCY_RETRY_S,
                tau_s=DEMAND_TAU_S,
            )
            return ts, got

        def back(ta: float, result: tuple[float, AcquireAnswer] | None) -> None:
            self._busy[tenant] -= 1
            charged = result is not None and result[1].ok
            if charged:
                self._charged[tenant] = self._charged.get(tenant, 0) + 1
            if self._waiting.pop(key, None) is None:  # it went on, checked locally
                self._late(ta, tenant, tokens, result if charged else None)
                return
            if result is None:  # failed: the circuit is local now, so is the check
                self._open[tenant] -= 1
                answer(ta, Ticket(tenant, tokens, ok=True, shared=False))
                return
            at, got = result
            self._observe(tenant, got.sight)
            if got.ok:
                answer(ta, Ticket(tenant, tokens, ok=True, shared=True, charged_at=at))
                return
            self._open[tenant] -= 1
            retry = min(RETRY_MAX_S, max(RETRY_MIN_S, got.retry_after_s))
            answer(ta, Ticket(tenant, tokens, ok=False, shared=True, retry_after_s=retry))

        self._call(t, op, back)
        return None

    def _late(
        self, t: float, tenant: str, tokens: int, charged: tuple[float, AcquireAnswer] | None
    ) -> None:
        """`SharedQuotaGate._checked` for a request that went on without its answer: a
        charge the store made is given back (shared again) or taken off the hand-back."""
        if charged is None:
            self._open[tenant] -= 1
            return
        self.late += 1
        if self.circuit.shared:
            ticket = Ticket(tenant, tokens, ok=True, shared=True, charged_at=charged[0])
            self.finish(t, ticket, 1, tokens)
            return
        self._open[tenant] -= 1
        self._charged[tenant] -= 1
        self.controller_quotas.charged_late(tenant, tokens)

    def _observe(self, tenant: str, sight: Sight) -> None:
        self.controller_quotas.observe(
            tenant,
            QuotaSight(sight.requests_level, sight.tokens_level, sight.part, self.clock.now()),
        )

    def close(
        self,
        t: float,
        ticket: Ticket,
        *,
        ran: bool,
        outcome: Outcome = Outcome.CANCELLED,
        prompt_tokens: int | None = None,
        completion_tokens: int | None = None,
    ) -> None:
        """The request is gone (`QuotaTicket.close`): never ran, everything back; ran,
        the charge becomes what the one charge rule says."""
        if ticket.closed:
            return
        ticket.closed = True
        if not ran:
            self.finish(t, ticket, 1, ticket.tokens)
            return
        delta = settlement(ticket.tokens, outcome, prompt_tokens, completion_tokens)
        self.finish(t, ticket, 0, -delta)

    def finish(self, t: float, ticket: Ticket, requests_back: int, tokens_back: int) -> None:
        tenant = ticket.tenant
        self._open[tenant] -= 1
        self._charged[tenant] -= 1
        if not self.circuit.shared or self.stopped:
            return  # lost: the local quotas have it (the heartbeat re-states the slots)
        owed = self._owed.get(tenant)
        if owed is None:
            owed = self._owed[tenant] = [0, 0, 0]
            self._owed_tickets[tenant] = []
        owed[0] += requests_back
        owed[1] += tokens_back
        owed[2] += 1
        self._owed_tickets[tenant].append(ticket)
        if not self._flush_pending:
            self._flush_pending = True
            self._schedule(t + FLUSH_S, self._flush)

    def _flush(self, t: float) -> None:
        self._flush_pending = False
        owed, self._owed = self._owed, {}
        tickets, self._owed_tickets = self._owed_tickets, {}
        for tenant, (requests_back, tokens_back, releases) in owed.items():
            self._send_back(t, tenant, requests_back, tokens_back, releases, tickets[tenant])

    def _send_back(
        self,
        t: float,
        tenant: str,
        requests_back: int,
        tokens_back: int,
        releases: int,
        tickets: list[Ticket],
    ) -> None:
        lim = self._limits.get(tenant)
        rpm = lim.requests_per_minute if lim else 0
        tpm = lim.tokens_per_minute if lim else 0
        self._busy[tenant] = self._busy.get(tenant, 0) + 1

        def op(ts: float) -> tuple[float | None, float | None]:
            for ticket in tickets:
                ticket.settled_at = ts
            return self.store.finish(
                ts,
                tenant,
                rpm=rpm,
                tpm=tpm,
                requests_back=requests_back,
                tokens_back=tokens_back,
                releases=releases,
                process=self.process,
            )

        def back(ta: float, levels: tuple[float | None, float | None] | None) -> None:
            self._busy[tenant] -= 1
            last = self.controller_quotas.sight(tenant)
            if levels is not None and tenant in self._limits:
                part = None if last is None else last.part
                self._observe(tenant, Sight(levels[0], levels[1], part))

        self._call(t, op, back)

    # -- the background loop --------------------------------------------------------------

    @property
    def _tick_s(self) -> float:
        return min(self.circuit.reprobe_s, self.heartbeat_s) / 4

    def start(self, t: float) -> None:
        self._started = self._next_beat = self.clock.now()
        self._looping = True
        self._loop(t)

    def stop(self, t: float, hand_back_until: float | None = None, *, killed: bool = False) -> None:
        """The replica exits (`SharedQuotaGate.stop`): it leaves the count of live
        processes and sends what is owed; nothing after that. Local, with what it admitted
        on its own not handed back, it first probes (and hands back) at once, then every
        reprobe until `hand_back_until` (its SIGTERM plus its grace; None: the one try);
        `killed` (SIGKILL): nothing."""
        if self.stopped or self._exit_until is not None:
            return
        if killed or self.circuit.shared or not self.controller_quotas.owes():
            self._stopped(t)
            return
        self._exit_until = t if hand_back_until is None else max(t, hand_back_until)
        self._exit_probe = True
        self._wake(t)

    def _stopped(self, t: float) -> None:
        if self.circuit.shared:
            self._call(t, lambda ts: self.store.leave(ts, self.process), _nothing)
        if self._owed:
            self._flush(t)
        self.stopped = True

    def _loop(self, t: float) -> None:
        """One turn of `SharedQuotaGate._background` (or, exiting, of its stop)."""
        if self.stopped:
            return
        self._woken = False
        now = self.clock.now()
        if self._exit_until is not None:
            done = self.circuit.shared or not self.controller_quotas.owes()
            if done or (t >= self._exit_until and not self._exit_probe):
                self._stopped(t)
            elif self._exit_probe or self.circuit.probe_due():
                self._exit_probe = False
                self._probe(t)
            else:
                self._wait(t)
            return
        if self.circuit.probe_due():
            self._probe(t)
        elif self.circuit.shared and now >= self._next_beat:
            early = now - self._started < 2 * self.heartbeat_s
            self._next_beat = now + (self.heartbeat_s / 4 if early else self.heartbeat_s)
            self._beat(t)
        elif self.circuit.shared and self.controller_quotas.owes():
            self._send_owed(t)
        else:
            moved = not self.circuit.shared and self.controller_quotas.reshare(now)
            if moved and self._on_reshare is not None:
                self._on_reshare(t, self)
            self._wait(t)

    def _wait(self, t: float) -> None:
        """`wait_for(wake, tick)`: a wake-up meanwhile, or the tick, runs the next turn."""
        self._looping = False
        self._loop_gen += 1
        gen = self._loop_gen
        delay = 0.0 if self._woken else self._tick_s
        self._schedule(t + delay, lambda ta: self._turn(ta, gen))

    def _turn(self, t: float, gen: int) -> None:
        if gen == self._loop_gen and not self._looping:
            self._looping = True
            self._loop(t)

    def _wake(self, t: float) -> None:
        if self.stopped:
            return
        if self._looping:  # during a turn: the next one comes at once
            self._woken = True
            return
        self._loop_gen += 1
        gen = self._loop_gen
        self._schedule(t, lambda ta: self._turn(ta, gen))

    def _probe(self, t: float) -> None:
        """A PING, then the hand-back while local, all within PROBE_TIMEOUT_S."""
        deadline = t + PROBE_TIMEOUT_S

        def pinged(ta: float, ok: bool | None) -> None:
            if ok is None:
                self._probe_failed(ta)
            elif not self.circuit.shared:
                self._hand_back(ta, deadline)
            else:
                self._probe_done(ta)

        def ping(ts: float) -> bool:
            self.store.ping(ts)
            return True

        self._call(t, ping, pinged, timeout_s=PROBE_TIMEOUT_S, raw=True)

    def _hand_back(self, t: float, deadline: float) -> None:
        quotas = self.controller_quotas
        owed = quotas.hand_back(self.clock.now())  # (the loss going on, for the records)
        dues = quotas.due(self.clock.now())
        calls = self._resumes(dues, deadline)

        def all_back(ta: float, ok: bool) -> None:
            if not ok:
                self._probe_failed(ta)
                return
            for due in dues:
                quotas.acked(due)
            if self._on_hand_back is not None:
                self._on_hand_back(ta, self, dict(owed))
            quotas.handed_back(self.clock.now(), self.hold_after_return_s)
            self._probe_done(ta)

        _gather(t, calls, all_back)

    def _resumes(self, dues: list[HandBackDue], deadline: float) -> list[Call]:
        """The calls of these hand-backs, one per tenant of each (`SharedQuotaGate._resumes`)."""
        return [
            self._resume(lim, hb, deadline, due)
            for due in dues
            for name, hb in due.owed.items()
            if (lim := self._limits.get(name)) is not None
        ]

    def _resume(self, lim: TenantLimits, hb: HandBack, deadline: float, due: HandBackDue) -> Call:
        """One tenant's hand-back (resume.lua), within what is left of the probe's time."""

        def op(ts: float) -> bool:
            self.store.resume(
                ts,
                lim.name,
                rpm=lim.requests_per_minute,
                tpm=lim.tokens_per_minute,
                requests_used=hb.requests_charge,
                tokens_used=hb.tokens_charge,
                requests_level=hb.requests_level,
                tokens_level=hb.tokens_level,
                hand_back=(self.process, due.outage, due.seq),
            )
            return True

        def call(tc: float, done: Done) -> None:
            self._call(tc, op, done, timeout_s=max(1e-9, deadline - tc), raw=True)

        return call

    def _send_owed(self, t: float) -> None:
        """`SharedQuotaGate._send_owed`: back from a loss, what its requests that ran on
        used after the hand-back, sent as the loss's charge again (charged once)."""
        quotas = self.controller_quotas
        dues = quotas.due(self.clock.now())
        calls = self._resumes(dues, t + PROBE_TIMEOUT_S)

        def sent(ta: float, ok: bool) -> None:
            if ok:
                for due in dues:
                    quotas.acked(due)
            self._wait(ta)

        _gather(t, calls, sent)

    def _probe_done(self, t: float) -> None:
        self.circuit.probe_answered()
        self._wait(t)

    def _probe_failed(self, t: float) -> None:
        self.circuit.probe_failed()  # (the gateway logs the outage if it was suspect)
        self._wait(t)

    def _beat(self, t: float) -> None:
        """The processes, the stale sights, then each capped tenant's open requests; cut
        short when the circuit goes local (`_went_local`), as the gateway cancels it."""
        quotas = self.controller_quotas
        self._beat_gen += 1
        gen = self._beat_gen
        self._beating = True

        def alive(ta: float, count: int | None) -> None:
            if gen != self._beat_gen:
                return
            if count is None:
                self._beat_done(ta)
                return
            quotas.set_processes(count, self.clock.now())
            stale = quotas.stale_sights(self.clock.now(), self.heartbeat_s / 4, SIGHTS_PER_BEAT)
            calls = [self._sight_refresher(name, gen) for name in stale]
            _gather(ta, calls, lambda tb, _ok: heartbeats(tb, list(self._limits)))

        def heartbeats(ta: float, names: list[str]) -> None:
            if gen != self._beat_gen:
                return
            while names and self.circuit.shared:
                name = names.pop(0)
                lim = self._limits.get(name)
                if lim is None or lim.max_concurrency <= 0:
                    continue
                if self._busy.get(name, 0) > 0 or name in self._owed:
                    continue
                n = self._open.get(name, 0)

                def beat(ts: float, name: str = name, n: int = n) -> None:
                    self.store.heartbeat(ts, name, process=self.process, open_requests=n)

                self._call(ta, beat, lambda tb, _r: heartbeats(tb, names))
                return
            self._beat_done(ta)

        self._call(
            t,
            lambda ts: self.store.processes(ts, process=self.process, stale_s=self.stale_after_s),
            alive,
        )

    def _beat_done(self, t: float) -> None:
        self._beating = False
        self._wait(t)

    def _sight_refresher(self, tenant: str, gen: int) -> Call:
        return lambda t, done: self._refresh_sight(t, tenant, done, gen)

    def _refresh_sight(self, t: float, tenant: str, done: Done, gen: int) -> None:
        lim = self._limits.get(tenant)
        if lim is None:
            done(t, True)
            return

        def back(ta: float, sight: Sight | None) -> None:
            if sight is not None and gen == self._beat_gen:
                self._observe(tenant, sight)
            done(ta, sight is not None)

        self._call(
            t,
            lambda ts: self.store.sight(
                ts,
                tenant,
                rpm=lim.requests_per_minute,
                tpm=lim.tokens_per_minute,
                process=self.process,
                tau_s=DEMAND_TAU_S,
            ),
            back,
        )


def _nothing(_t: float, _result: object) -> None:
    pass


def _give(answer: Callable[[float, Ticket], None], ticket: Ticket, t: float) -> None:
    answer(t, ticket)


def _gather(t: float, calls: list[Call], then: Callable[[float, bool], None]) -> None:
    """Start every call at `t`; `then(t_last, all_ok)` once the last is back."""
    if not calls:
        then(t, True)
        return
    left = [len(calls), 1]  # calls not back, all ok so far

    def one(ta: float, ok: bool | None) -> None:
        left[0] -= 1
        if not ok:
            left[1] = 0
        if left[0] == 0:
            then(ta, bool(left[1]))

    for call in calls:
        call(t, one)
