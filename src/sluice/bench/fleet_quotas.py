"""Tenant quotas shared through Redis by a fleet of replicas in virtual time: the glue
between the harness (bench/harness.py) and one `VirtualQuotaGate` per replica
(bench/quota_gate.py) in front of one `QuotaStore` (bench/quota_store.py).

Each replica charges the store as `sluice serve` does (gateway/request_path.py): the
quota ticket is taken before the Controller's `arrive` (stages/quota_ticket.py: a refusal
is the 429 `tenant_quota`, or `cannot_serve_in_time` past the client's deadline), and
closed on the request's every way out (stages/access_record.py): refused by the
Controller, dropped from its queue or cancelled there, everything back; finished, its
charge becomes its usage (stages/account.py). `TicketedController` is that: the
Controller with the ticket closed at each of its exits. Its quotas are the gate's
`FailoverQuotas`, as `sluice serve` gives them (gateway/app.py).

`QuotaRecords` keeps, for the figures (bench/quota_figures.py), every request of a tenant
with a quota that a replica admitted: where it was charged (`shared`: in the store;
`local`: by the replica's share while the store was lost; `unchecked`: let through while
its call failed and the circuit was still closed), what, when, and what it came to; the
refusals and their Retry-After; each replica's take-over (its share of each quota and the
levels it started from) and hand-back; the store's levels when it was lost and back.
"""

from __future__ import annotations

import functools
import math
import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from sluice.bench.quota_gate import Ticket, VirtualQuotaGate
from sluice.bench.quota_store import QuotaStore, StoreSpec
from sluice.core.clock import Clock, FakeClock
from sluice.core.controller import Controller
from sluice.core.quota import settlement
from sluice.core.quota_failover import HandBack
from sluice.core.retry_after import deadline_code
from sluice.core.settings import CoreSettings, TenantLimits
from sluice.core.types import Admission, Outcome, RejectCode, RequestInfo

Push = Callable[[float, Callable[[float], None]], None]
SHARED, LOCAL, UNCHECKED = "shared", "local", "unchecked"


@dataclass(slots=True)
class Admitted:
    """One admitted request of a tenant with a quota (module docstring)."""

    tenant: str
    replica: int
    mode: str
    charge: int  # tokens charged when admitted (unchecked: 0)
    charged_at: float  # virtual time of the charge (the store's, when shared)
    ticket: Ticket | None = None
    tokens: int | None = None  # the charge it came to (None: still open at the end)
    ran: bool = False
    closed_at: float = math.inf

    @property
    def settled_at(self) -> float:
        """When the quota that checks the next request had its final charge."""
        if self.mode == SHARED:
            return math.inf if self.ticket is None else self.ticket.settled_at
        return self.closed_at if self.mode == LOCAL else math.inf


@dataclass(slots=True)
class QuotaRecords:
    admitted: dict[str, Admitted] = field(default_factory=dict)  # by request id
    refusals: list[dict[str, Any]] = field(default_factory=list)
    take_overs: list[dict[str, Any]] = field(default_factory=list)
    reshares: list[dict[str, Any]] = field(default_factory=list)  # t, replica, fractions
    exits: dict[int, float] = field(default_factory=dict)  # replica: when it stopped
    hand_backs: list[dict[str, Any]] = field(default_factory=list)
    store_levels: list[dict[str, Any]] = field(default_factory=list)


class TicketedController(Controller):
    """A replica's Controller with its shell's shared-quota tickets (module docstring)."""

    def __init__(
        self,
        *args: Any,
        gate: VirtualQuotaGate,
        records: QuotaRecords,
        replica: int,
        virtual: FakeClock,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        self.gate = gate
        self.records = records
        self.replica = replica
        self._virtual = virtual
        self.tickets: dict[str, Ticket] = {}  # charged in the store, by request id

    def arrive(self, req: RequestInfo, take: bool = False) -> Admission:
        rid = req.request_id
        ticket = self.tickets.get(rid)
        tenant = req.tenant
        checked = self.gate.limits(tenant) is not None and ticket is None
        local = checked and not self.gate.circuit.shared
        # what the Controller charges the local quotas (the same call it makes)
        charge = self.gate.controller_quotas.charge_for(tenant, self.cost_of(req)) if local else 0
        adm = super().arrive(req, take)
        t = self._virtual.now()
        if not adm.admitted:
            if ticket is not None:
                del self.tickets[rid]
                self.gate.close(t, ticket, ran=False)
            if adm.code is RejectCode.TENANT_QUOTA:
                self.records.refusals.append(
                    {
                        "t": t,
                        "tenant": tenant,
                        "replica": self.replica,
                        "code": adm.code.value,
                        "retry_after_s": adm.retry_after_s,
                        "by": LOCAL,
                    }
                )
            return adm
        if ticket is not None:
            self.records.admitted[rid] = Admitted(
                tenant, self.replica, SHARED, ticket.tokens, ticket.charged_at, ticket
            )
        elif checked:
            if not local:
                self.gate.unchecked += 1
            self.records.admitted[rid] = Admitted(
                tenant, self.replica, LOCAL if local else UNCHECKED, charge, t
            )
        return adm

    def step(self) -> Any:
        step = super().step()
        for rej in step[1]:  # dropped from the queue (or handed over): never ran
            self._gone(rej.request_id, ran=False)
        return step

    def cancel(self, request_id: str) -> None:
        super().cancel(request_id)
        self._gone(request_id, ran=False)  # the harness cancels only what was never sent

    def on_finish(
        self,
        request_id: str,
        outcome: Outcome,
        prompt_tokens: int | None = None,
        completion_tokens: int | None = None,
    ) -> None:
        super().on_finish(request_id, outcome, prompt_tokens, completion_tokens)
        self._gone(request_id, True, outcome, prompt_tokens, completion_tokens)

    def _gone(
        self,
        rid: str,
        ran: bool,
        outcome: Outcome = Outcome.CANCELLED,
        prompt_tokens: int | None = None,
        completion_tokens: int | None = None,
    ) -> None:
        t = self._virtual.now()
        ticket = self.tickets.pop(rid, None)
        if ticket is not None:
            self.gate.close(
                t,
                ticket,
                ran=ran,
                outcome=outcome,
                prompt_tokens=prompt_tokens,
                completion_tokens=completion_tokens,
            )
        rec = self.records.admitted.get(rid)
        if rec is None or rec.tokens is not None:
            return
        rec.ran = ran
        rec.closed_at = t
        delta = settlement(rec.charge, outcome, prompt_tokens, completion_tokens)
        rec.tokens = rec.charge + delta if ran else 0


class FleetQuotas:
    """One store and a gate per replica for a run of the harness (module docstring)."""

    def __init__(
        self,
        spec: StoreSpec,
        tenants: Sequence[TenantLimits],
        clock: FakeClock,
        push: Push,
        seed: int,
    ) -> None:
        self.spec = spec
        self.store: QuotaStore = spec.build()
        self.tenants = {t.name: t for t in tenants}
        self._clock = clock
        self._push = push
        self._seed = seed
        self.gates: list[VirtualQuotaGate] = []
        self.ctrls: list[TicketedController] = []
        self.records = QuotaRecords()

    def start(self) -> None:
        """The store's levels at each outage's start and end (for the figures)."""
        for o in self.store.outages:
            for t, what in ((o.at, "lost"), (o.back, "back")):
                self._push(t, functools.partial(self._store_levels, what=what))

    def _store_levels(self, t: float, what: str) -> None:
        levels = {}
        for name, lim in self.tenants.items():
            rl, tl = self.store.levels(t, name, lim.requests_per_minute, lim.tokens_per_minute)
            levels[name] = {"requests": rl, "tokens": tl}
        self.records.store_levels.append({"t": t, "what": what, "levels": levels})

    def controller(
        self,
        k: int,
        t: float,
        settings: CoreSettings,
        clock: Clock,
        backends: Sequence[str],
        kwargs: Mapping[str, Any],
    ) -> Controller:
        """Replica `k`'s Controller, its gate's loop started at `t`."""
        gate = VirtualQuotaGate(
            self.store,
            settings.tenants,
            clock,
            self._push,
            process=f"replica-{k}",
            rng=random.Random(f"{self._seed}/quota/{k}"),
            on_local=functools.partial(self._took_over, replica=k),
            on_hand_back=functools.partial(self._handed_back, replica=k),
            on_reshare=functools.partial(self._reshared, replica=k),
        )
        ctrl = TicketedController(
            settings,
            clock,
            backends,
            quotas=gate.controller_quotas,
            gate=gate,
            records=self.records,
            replica=k,
            virtual=self._clock,
            **kwargs,
        )
        # as gateway/app.py: with no count of the processes, the part of the fleet it estimates
        gate.controller_quotas.fleet_share = ctrl.fleet_share
        self.gates.append(gate)
        self.ctrls.append(ctrl)
        gate.start(t)
        return ctrl

    def check(
        self,
        t: float,
        k: int,
        info: RequestInfo,
        answer: Callable[[float, tuple[str, float] | None], None],
    ) -> bool:
        """Replica `k`'s quota check of a request, before its `arrive`. True: the answer
        comes later, as `answer(t, refusal)` (None: go on to `arrive`; else the code and
        Retry-After of the 429); False: go on at once."""
        gate = self.gates[k]
        if gate.limits(info.tenant) is None:
            return False
        ctrl = self.ctrls[k]
        # charged as the core charges the local quotas (one rule: Controller.cost_of)
        ticket = gate.acquire(
            t,
            info.tenant,
            ctrl.cost_of(info),
            lambda ta, tk: self._checked(ta, k, info, tk, answer),
        )
        return ticket is None

    def _checked(
        self,
        t: float,
        k: int,
        info: RequestInfo,
        ticket: Ticket,
        answer: Callable[[float, tuple[str, float] | None], None],
    ) -> None:
        ctrl = self.ctrls[k]
        if not ticket.ok:
            now = ctrl.gate.clock.now()  # the replica's own clock
            code = deadline_code(
                RejectCode.TENANT_QUOTA, ticket.retry_after_s, now, info.client_deadline
            )
            self.records.refusals.append(
                {
                    "t": t,
                    "tenant": info.tenant,
                    "replica": k,
                    "code": code.value,
                    "retry_after_s": ticket.retry_after_s,
                    "by": SHARED,
                }
            )
            answer(t, (code.value, ticket.retry_after_s))
            return
        if ticket.shared:
            ctrl.tickets[info.request_id] = ticket
        answer(t, None)

    def replica_exits(self, t: float, k: int, hand_back_until: float | None, killed: bool) -> None:
        """Replica `k` exits: drained (it may hand back until `hand_back_until`, as
        `sluice serve` does within its shutdown grace) or `killed`."""
        self.records.exits[k] = t
        self.gates[k].stop(t, hand_back_until, killed=killed)

    # -- what the gates tell --------------------------------------------------------------

    def _took_over(self, t: float, gate: VirtualQuotaGate, *, replica: int) -> None:
        quotas = gate.controller_quotas
        offset = gate.clock.now() - t  # the replica's clock less virtual time
        shares = {}
        for name, lim in self.tenants.items():
            share = quotas.shares.get(name)
            if share is None:
                continue
            sight = quotas.sight(name)
            f = share.fraction
            shares[name] = {
                "fraction": f,
                # where its local buckets started: f of the levels estimated (None: full)
                "requests_level": _start(f, lim.requests_per_minute, share.requests_level),
                "tokens_level": _start(f, lim.tokens_per_minute, share.tokens_level),
                "sight_at": None if sight is None else sight.at - offset,
                "sight_tokens_level": None if sight is None else sight.tokens_level,
                "sight_part": None if sight is None else sight.part,
            }
        self.records.take_overs.append(
            {"t": t, "replica": replica, "processes": quotas.processes, "tenants": shares}
        )

    def _reshared(self, t: float, gate: VirtualQuotaGate, *, replica: int) -> None:
        shares = gate.controller_quotas.shares
        self.records.reshares.append(
            {"t": t, "replica": replica, "tenants": {n: s.fraction for n, s in shares.items()}}
        )

    def _handed_back(
        self, t: float, gate: VirtualQuotaGate, owed: dict[str, HandBack], *, replica: int
    ) -> None:
        levels = {}
        for name, lim in self.tenants.items():
            rl, tl = self.store.levels(t, name, lim.requests_per_minute, lim.tokens_per_minute)
            levels[name] = {"requests": rl, "tokens": tl}
        self.records.hand_backs.append(
            {
                "t": t,
                "replica": replica,
                "owed": {
                    name: {
                        "requests_charge": hb.requests_charge,
                        "tokens_charge": hb.tokens_charge,
                        "requests_level": hb.requests_level,
                        "tokens_level": hb.tokens_level,
                    }
                    for name, hb in owed.items()
                },
                "store_after": levels,
            }
        )


def _start(fraction: float, per_minute: int, level: float | None) -> float | None:
    """A local bucket's level when its share was taken (None: no such limit)."""
    if per_minute <= 0:
        return None
    return fraction * (per_minute if level is None else min(per_minute, level))
