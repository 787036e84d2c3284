"""Tenant quotas held in a shared store (Redis) that may be lost: the pure part.

`QuotaCircuit` says whether quotas are shared (the store answers) or local (it does not,
or is suspect: a call timed out, or the calls out went unanswered for `STALL_S`);
`FailoverQuotas` is the `TenantQuotas` the Controller gets when a shared store holds
the quotas: it charges nothing while they are shared (the shell charged the store) and
delegates to an `InProcessQuotas` holding this process's share while they are local.
The store's I/O, its scripts and the per-request ticket are the shell's
(gateway/shared_quota.py); nothing here does I/O, time comes from the injected clock.

Going local must not hand a tenant its quota again: each answer of the store shows the
process the tenant's bucket levels and this process's part of the tenant's recent demand
(`QuotaSight`). When the store is lost, each process enforces that part of the quota
(with `SHARE_FLOOR` of it spread evenly over the live processes), starting from that part
of the levels last seen: what the tenant used in the current minute still counts. When
the store is back, each process charges it for what it admitted on its own meanwhile
(`HandBack`: its use as a bucket of its share saw it, `Ledger`, so that what refilled
meanwhile is not charged again), restoring first the levels it last saw if the store
lost them (a restart), and keeps its share as a second check for as long as the other
processes may still be local (`handed_back`'s `hold_s`): until they have handed back
too, the store does not count what they admitted, and a process back first would admit
against it.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

from sluice.core.clock import Clock
from sluice.core.fleet_share import PRIOR as FLEET_PRIOR
from sluice.core.quota import (
    ADMITTED,
    InProcessQuotas,
    QuotaDecision,
    QuotaShare,
    TokenBucket,
    refilled,
)
from sluice.core.settings import TenantLimits

REPROBE_S = 1.0  # while local, try the store again this often (not on every request)
STALL_S = 0.25  # calls out and none answered for this long: the store hangs (it answers
# in about a millisecond); well under a call's timeout, so few requests wait that long
SHARE_FLOOR = 0.1  # of a quota spread evenly over the processes when they go local
RESHARE_BY = 0.05  # with no count, a share follows the fleet share once it moves this much


def has_quota(t: TenantLimits) -> bool:
    return bool(t.tokens_per_minute or t.requests_per_minute or t.max_concurrency)


def share_of(part: float | None, even: float, floor: float) -> float:
    """One process's fraction of a quota that the processes enforce apart: its part of
    the tenant's recent demand (None: unknown, then its even part), with `floor` of the
    quota spread evenly (`even` each), so that a process the traffic moves to is not at
    zero. Over processes whose parts add up to 1 and whose even parts do, so do these."""
    if part is None:
        return even
    return (1.0 - floor) * min(1.0, max(0.0, part)) + floor * even


class QuotaCircuit:
    """Whether quotas are shared (Redis answers) or local (it does not).

    Any failed call goes local at once, so that no request goes through unchecked and
    none waits on a Redis that does not answer: a refused or broken connection (Redis is
    down: probed again every `reprobe_s`), a call that timed out, or calls out with none
    answered for `stall_s` (Redis hangs, or this process's event loop was starved). The
    last two only make Redis suspect: a probe is due at once, and the shell checks
    requests against this process's share of each quota meanwhile, not each one waiting
    for its own timeout. A failed probe `confirmed`s the outage (the shell logs it); a
    probe that answers ends it (after the hand-back). While local, only the background
    task probes, never requests.

    Calls are counted by `epoch`, which every change of mode starts anew: an answer to a
    call sent before a loss must not end it (only the hand-back may), nor a timeout of one
    sent before the return start another."""

    def __init__(
        self, clock: Clock, *, reprobe_s: float = REPROBE_S, stall_s: float = STALL_S
    ) -> None:
        self._clock = clock
        self.reprobe_s = reprobe_s
        self.stall_s = stall_s
        self.shared = True
        self.confirmed = False  # local because Redis refused or a probe failed
        self.epoch = 0
        self._out = 0  # calls of this epoch not back yet
        self._quiet_since = 0.0  # the last answer, or when calls went out with none out
        self._next_probe = 0.0

    def sent(self) -> int:
        """A call goes out; its epoch, for `answered` or `failed`."""
        if self._out == 0:
            self._quiet_since = self._clock.now()
        self._out += 1
        return self.epoch

    def answered(self, epoch: int) -> None:
        if epoch == self.epoch:
            self._out -= 1
            self._quiet_since = self._clock.now()

    def gone(self, epoch: int) -> None:
        """A call was cancelled: neither answered nor failed."""
        if epoch == self.epoch:
            self._out -= 1

    def failed(self, epoch: int, *, timeout: bool) -> bool:
        """A call failed; True if quotas go local now."""
        if epoch != self.epoch or not self.shared:
            return False
        self._out -= 1
        return self._open(confirmed=not timeout)

    def failure(self, *, timeout: bool) -> bool:
        """A call sent just now failed (for callers that do not count calls); True if
        quotas go local now."""
        return self.failed(self.sent(), timeout=timeout)

    def success(self) -> bool:
        """Redis answered a probe (`probe_answered`)."""
        return self.probe_answered()

    def stall_at(self) -> float | None:
        """When the calls out would be stalled if none is answered (None: none out)."""
        if not self.shared or self._out <= 0:
            return None
        return self._quiet_since + self.stall_s

    def stalled(self) -> bool:
        """True if quotas go local now: calls are out and none was answered for
        `stall_s`."""
        at = self.stall_at()
        if at is None or self._clock.now() < at:
            return False
        return self._open(confirmed=False)

    def _open(self, *, confirmed: bool) -> bool:
        self.shared = False
        self.confirmed = confirmed
        self._new_epoch()
        # refused: Redis is down, try again in a while; only suspect: probe at once
        self._next_probe = self._clock.now() + (self.reprobe_s if confirmed else 0.0)
        return True

    def _new_epoch(self) -> None:
        self.epoch += 1
        self._out = 0

    def probe_due(self) -> bool:
        return not self.shared and self._clock.now() >= self._next_probe

    def probe_failed(self) -> bool:
        """The probe got no answer; True if that confirms an outage (log it). The next
        probe waits `reprobe_s`."""
        self._next_probe = self._clock.now() + self.reprobe_s
        if self.shared or self.confirmed:
            return False
        self.confirmed = True
        return True

    def probe_answered(self) -> bool:
        """The probe (and the hand-back) answered; True if quotas are shared again now."""
        if self.shared:
            return False
        self.shared = True
        self.confirmed = False
        self._new_epoch()
        return True


@dataclass(frozen=True, slots=True)
class QuotaSight:
    """A tenant's quota as Redis last showed it to this process: the bucket levels of the
    whole quota (None: no such limit), this process's part of the tenant's recent demand
    (None: none recorded), and when (this process's clock)."""

    requests_level: float | None
    tokens_level: float | None
    part: float | None
    at: float


@dataclass(frozen=True, slots=True)
class HandBack:
    """What Redis, once back, is charged for what this process admitted of a tenant's
    quota on its own while it was lost (`Ledger.charge`: its use, less what the share
    refilled meanwhile; negative: a charge to take off), with its estimate of the
    tenant's levels had nothing been used (-1: unknown), which stands in for buckets
    Redis lost."""

    requests_charge: float
    tokens_charge: float
    requests_level: float
    tokens_level: float


class Ledger:
    """What a process admitted of one tenant's quota while Redis was lost, as a bucket
    of its share would hold it had it seen the usage as it happened: the share's
    capacity and rate, from the share of the levels last seen, so that what refilled
    meanwhile is not charged again. Its charge for Redis is what the same bucket would
    hold with nothing used (kept beside it: a share that follows the fleet share is
    resized alike) less what it holds: the use itself over a short loss; over one longer
    than a minute, at most what the last minute's refill could not cover. Without a
    sight (a process that never heard from Redis) the level is unknown and both start
    empty (the tenant may have used its minute): no refill is credited before the share
    would have filled again from nothing. No floor: every token admitted counts (a
    request's usage past its charge included). Once handed back it is `close`d: what its
    requests still use is counted as at the close, with no refill after it (Redis refills
    the tenant's buckets from then on)."""

    __slots__ = ("closed", "requests", "tokens", "used")

    def __init__(
        self,
        t: TenantLimits,
        fraction: float,
        requests_level: float | None,
        tokens_level: float | None,
        now: float,
    ) -> None:
        self.requests = self._buckets(t.requests_per_minute, fraction, requests_level, now)
        self.tokens = self._buckets(t.tokens_per_minute, fraction, tokens_level, now)
        self.used = False
        self.closed = False

    @staticmethod
    def _buckets(
        per_minute: float, fraction: float, level: float | None, now: float
    ) -> tuple[TokenBucket, TokenBucket] | None:
        """(the share as used, the share unused), alike at the start."""
        if per_minute <= 0:
            return None
        pair = (TokenBucket(per_minute * fraction, now), TokenBucket(per_minute * fraction, now))
        if level is not None:
            for bucket in pair:
                bucket.level = min(bucket.capacity, fraction * level)
        return pair

    def use(self, requests: float, tokens: float, now: float) -> None:
        """Charged (positive) or given back (negative), as the local bucket is."""
        self.used = True
        for pair, amount in ((self.requests, requests), (self.tokens, tokens)):
            if pair is not None and amount:
                bucket = pair[0]
                if not self.closed:
                    bucket.refill(now)
                bucket.level = min(bucket.capacity, bucket.level - amount)

    def close(self, now: float) -> None:
        """Handed back at `now`: no refill is credited past it (`charge` no longer
        depends on the time)."""
        for pair in (self.requests, self.tokens):
            if pair is not None and not self.closed:
                for bucket in pair:
                    bucket.refill(now)
        self.closed = True

    def resize(self, t: TenantLimits, fraction: float, now: float) -> None:
        for pair, per_minute in (
            (self.requests, t.requests_per_minute),
            (self.tokens, t.tokens_per_minute),
        ):
            if pair is not None:
                for bucket in pair:
                    bucket.resize(per_minute * fraction, now)

    def charge(self, now: float) -> tuple[float, float]:
        """(requests, tokens) to charge Redis now."""
        out = []
        for pair in (self.requests, self.tokens):
            if pair is None or not self.used:
                out.append(0.0)
                continue
            seen, unused = pair
            if not self.closed:
                seen.refill(now)
                unused.refill(now)
            out.append(unused.level - seen.level)
        return out[0], out[1]


class Outage:
    """One loss of Redis as this process hands it back: per tenant the `Ledger` of what it
    admitted on its own, what Redis charged late, its requests still open here, and the
    charge (cumulative, for the loss: its hand-back id) Redis has acknowledged.

    A hand-back is sent as the loss's whole charge so far, numbered (`seq`): Redis
    records per process and loss the last one applied and charges only what a newer one
    adds (lua/resume.lua), so a hand-back resent after its answer was lost is not
    charged again, and what the loss's requests use after it (they ran on) is sent the
    same way, the difference alone charged."""

    __slots__ = ("acked", "acked_seq", "late", "ledgers", "number", "open", "seq")

    def __init__(self, number: int) -> None:
        self.number = number
        self.ledgers: dict[str, Ledger] = {}
        self.late: dict[str, list[float]] = {}  # requests, tokens Redis charged late
        self.open: dict[str, int] = {}  # its requests not ended yet, per tenant
        self.seq = 0  # of the last hand-back made
        self.acked_seq = 0  # of the last one Redis answered
        self.acked: dict[str, tuple[float, float]] = {}

    @property
    def closed(self) -> bool:
        return all(ledger.closed for ledger in self.ledgers.values())

    def charge(self, tenant: str, now: float) -> tuple[float, float]:
        ledger = self.ledgers.get(tenant)
        requests, tokens = (0.0, 0.0) if ledger is None else ledger.charge(now)
        late = self.late.get(tenant)
        if late is not None:
            requests -= late[0]
            tokens -= late[1]
        return requests, tokens

    def unacked(self, now: float) -> dict[str, tuple[float, float]]:
        """Tenants whose charge Redis has not acknowledged (as it is now)."""
        out = {}
        for name in self.ledgers.keys() | self.late.keys():
            charge = self.charge(name, now)
            if charge != self.acked.get(name, (0.0, 0.0)):
                out[name] = charge
        return out

    def owes(self) -> bool:
        if not self.closed:
            return bool(self.late) or any(ledger.used for ledger in self.ledgers.values())
        return bool(self.unacked(0.0))  # (closed: the charge is the same at any time)


@dataclass(frozen=True, slots=True)
class HandBackDue:
    """A hand-back to send: loss `outage`'s charge per tenant, as of its `seq`-th send."""

    outage: int
    seq: int
    owed: dict[str, HandBack]


class FailoverQuotas:
    """`TenantQuotas` for the Controller when Redis holds the quotas: charges nothing
    while quotas are shared (the shell has charged Redis), and delegates to `local`
    while they are local.

    `take_over` (the circuit just went local) gives `local` this process's share of each
    tenant's quota (`share_of` its part of the demand last seen and of its even part),
    starting from that share of the levels last seen, refilled since: so the processes
    together hold each quota once, what was used in the current minute included. The even
    part is 1/n of the n processes Redis last counted; a process that never saw the count
    (it started while Redis was lost) is not alone for all it knows: its even part is
    the part of the fleet its scrapes estimate (`fleet_share`, the Controller's
    core/fleet_share.py: 1/N with `--workers N`; else from the prior, 1/16, towards its
    part of the backends' requests, 1 once they show it alone), followed while local.
    Refunds, settles and releases go to `local` only for tenants with requests it holds
    (charged locally, or still running from before), so a request admitted through Redis
    after it is back never gives back to the local buckets. `hand_back` says what was
    admitted locally meanwhile, for Redis; `due` what to send (every loss not fully
    acknowledged, `acked` once Redis answered): a request admitted during a loss carries
    the loss's number (`QuotaDecision.outage`), and what it uses after the hand-back is
    added to that loss's charge and sent again. (A request whose Redis check succeeded in
    the instant the circuit went local is charged locally too: a one-off, on the safe
    side.)"""

    def __init__(
        self,
        local: InProcessQuotas,
        circuit: QuotaCircuit,
        on_limits: Callable[[Iterable[TenantLimits]], None] | None = None,
        *,
        floor: float = SHARE_FLOOR,
        fleet_share: Callable[[], float] | None = None,
    ) -> None:
        self.local = local
        self._circuit = circuit
        self._on_limits = on_limits
        self.floor = floor
        self.fleet_share = fleet_share  # this process's part of the fleet, as it estimates
        self._local_open: dict[str, int] = {}
        self._tenants: dict[str, TenantLimits] = {}
        self._sights: dict[str, QuotaSight] = {}
        # tenants given a local share since the last loss, and what they were given
        self.shares: dict[str, QuotaShare] = {}
        self._outages: dict[int, Outage] = {}  # losses not fully handed back yet
        self._current: Outage | None = None  # the loss going on, until handed back
        self._lost = 0  # losses so far (each one's number)
        self.processes: int | None = None  # the live processes Redis last counted
        self.hold_until = -math.inf  # back from a loss: the local share checks too until then

    def set_limits(self, tenants: Iterable[TenantLimits], now: float = 0.0) -> None:
        self._tenants = {t.name: t for t in tenants}
        self.local.set_limits(self._tenants.values(), now)
        if not self._circuit.shared:  # a tenant new while local gets its share too
            for t in self._tenants.values():
                if has_quota(t) and t.name not in self.shares:
                    self._take(t, now, 0)
        if self._on_limits is not None:
            self._on_limits(self._tenants.values())

    def set_processes(self, processes: int, now: float) -> None:
        """How many gateway processes were alive in Redis (for the next take-over)."""
        self.processes = max(1, processes)

    def observe(self, tenant: str, sight: QuotaSight) -> None:
        """What a Redis answer showed of the tenant's quota."""
        self._sights[tenant] = sight

    def sight(self, tenant: str) -> QuotaSight | None:
        return self._sights.get(tenant)

    def stale_sights(self, now: float, older_than_s: float, limit: int) -> list[str]:
        """Tenants with a quota whose last sight is older than `older_than_s` (or none),
        the oldest first, at most `limit`."""
        ages = []
        for name, t in self._tenants.items():
            if not has_quota(t):
                continue
            sight = self._sights.get(name)
            age = float("inf") if sight is None else now - sight.at
            if age > older_than_s:
                ages.append((-age, name))
        return [name for _, name in sorted(ages)[:limit]]

    def take_over(self, now: float, running: Mapping[str, int]) -> None:
        """Quotas went local: from now on hold this process's share of each; `running`:
        requests per tenant admitted through Redis that are still open here."""
        if self._current is not None:  # (never handed back: closed as it is)
            self._close(self._current, now)
        self._lost += 1
        self._current = self._outages[self._lost] = Outage(self._lost)
        self.shares = {}
        for t in self._tenants.values():
            if has_quota(t):
                self._take(t, now, running.get(t.name, 0))

    def _take(self, t: TenantLimits, now: float, running: int) -> None:
        requests_level, tokens_level = self._estimate(t, now)
        held = self._local_open.get(t.name, 0) + max(0, running)
        if held:
            self._local_open[t.name] = held
        share = QuotaShare(self._fraction(t.name), requests_level, tokens_level, held)
        self.local.set_share(t.name, share, now)
        self.shares[t.name] = share
        if t.name in self._sights:
            ledger = Ledger(t, share.fraction, requests_level, tokens_level, now)
        else:  # (the level unknown: no refill credited before a minute, Ledger)
            ledger = Ledger(t, share.fraction, 0.0, 0.0, now)
        if self._current is not None:
            self._current.ledgers[t.name] = ledger

    def _even(self) -> float:
        """This process's even part of a quota: 1/n of the processes Redis last counted;
        never counted, the part of the fleet it estimates, at most 1 (else the prior)."""
        if self.processes is not None:
            return 1.0 / self.processes
        if self.fleet_share is None:
            return FLEET_PRIOR
        return min(1.0, max(FLEET_PRIOR, self.fleet_share()))

    def _fraction(self, tenant: str) -> float:
        sight = self._sights.get(tenant)
        return share_of(sight.part if sight else None, self._even(), self.floor)

    def reshare(self, now: float) -> bool:
        """While local, a process that never saw Redis's count follows the part of the
        fleet it estimates, as its scrapes learn it (its levels kept, at most the new
        share's capacity); one with a count keeps the share it took. True if a share
        changed."""
        if self._circuit.shared or self.processes is not None or self.fleet_share is None:
            return False
        changed = False
        for name, share in list(self.shares.items()):
            fraction = self._fraction(name)
            if abs(fraction - share.fraction) <= RESHARE_BY * share.fraction:
                continue
            open_here = self._local_open.get(name, 0)
            self.local.set_share(name, QuotaShare(fraction, None, None, open_here), now)
            self.shares[name] = dataclasses.replace(share, fraction=fraction)
            ledger = None if self._current is None else self._current.ledgers.get(name)
            if ledger is not None:
                ledger.resize(self._tenants[name], fraction, now)
            changed = True
        return changed

    def _estimate(self, t: TenantLimits, now: float) -> tuple[float | None, float | None]:
        """The tenant's levels now, from the last sight, had nothing been used since."""
        sight = self._sights.get(t.name)
        if sight is None:
            return None, None
        age = now - sight.at
        rl = tl = None
        if t.requests_per_minute > 0 and sight.requests_level is not None:
            rl = refilled(sight.requests_level, t.requests_per_minute, age)
        if t.tokens_per_minute > 0 and sight.tokens_level is not None:
            tl = refilled(sight.tokens_level, t.tokens_per_minute, age)
        return rl, tl

    def hand_back(self, now: float) -> dict[str, HandBack]:
        """Per tenant, what Redis should be told of the loss going on now that it is back
        (what `due` sends of it): the ledger's charge (what the share admitted, less what
        it refilled meanwhile), less what Redis charged late. Tenants whose levels were
        below full are included even with nothing used: a Redis that lost them must not
        start them full."""
        return {} if self._current is None else self._owed(self._current, now, None)

    def _owed(
        self, outage: Outage, now: float, only: Mapping[str, tuple[float, float]] | None
    ) -> dict[str, HandBack]:
        out: dict[str, HandBack] = {}
        for name, (requests, tokens) in (only or {}).items():
            # (a tenant whose quota was removed since: its charge is sent, no level)
            t = self._tenants.get(name)
            rl, tl = (None, None) if t is None else self._estimate(t, now)
            out[name] = HandBack(
                requests, tokens, -1.0 if rl is None else rl, -1.0 if tl is None else tl
            )
        if only is not None:
            return out
        for name, t in self._tenants.items():
            if not has_quota(t):
                continue
            rl, tl = self._estimate(t, now)
            requests, tokens = outage.charge(name, now)
            below = (rl is not None and rl < t.requests_per_minute) or (
                tl is not None and tl < t.tokens_per_minute
            )
            if requests or tokens or below:
                out[name] = HandBack(
                    requests, tokens, -1.0 if rl is None else rl, -1.0 if tl is None else tl
                )
        return out

    def due(self, now: float) -> list[HandBackDue]:
        """The hand-backs to send now, one per loss: the loss going on (while Redis is
        lost, for the probe), and those handed back whose requests have since used more
        or less than their charge, or whose last hand-back was not acknowledged. Each
        is numbered anew; `acked` it once Redis has answered."""
        out = []
        for outage in list(self._outages.values()):
            if outage is self._current:
                owed = self._owed(outage, now, None)
            else:
                owed = self._owed(outage, now, outage.unacked(now))
            if owed:
                outage.seq += 1
                out.append(HandBackDue(outage.number, outage.seq, owed))
        return out

    def acked(self, due: HandBackDue) -> None:
        """Redis has applied `due` (or a newer hand-back of its loss)."""
        outage = self._outages.get(due.outage)
        if outage is None or due.seq <= outage.acked_seq:
            return
        outage.acked_seq = due.seq
        for name, hb in due.owed.items():
            outage.acked[name] = (hb.requests_charge, hb.tokens_charge)
        self._retire(outage)

    def _retire(self, outage: Outage) -> None:
        """A loss handed back, acknowledged, whose requests have all ended: forgotten."""
        if outage is not self._current and not any(outage.open.values()) and not outage.owes():
            self._outages.pop(outage.number, None)

    def owes(self) -> bool:
        """Something admitted while Redis was lost is not handed back yet."""
        return any(outage.owes() for outage in self._outages.values())

    def handed_back(self, now: float = 0.0, hold_s: float = 0.0) -> None:
        """Redis has been told what `hand_back` said (`acked`). For `hold_s` more, every
        request Redis admits is also checked against this process's share (as while
        Redis was lost, without counting it for Redis again): the processes still local
        have not handed back yet, and until they have, Redis lets through what they used.
        The shell holds for as long as another process's next probe may take. What the
        loss's requests use from now on is counted for the next hand-back of the loss."""
        if self._current is not None:
            outage, self._current = self._current, None
            self._close(outage, now)
        self.hold_until = now + hold_s

    def _close(self, outage: Outage, now: float) -> None:
        for ledger in outage.ledgers.values():
            ledger.close(now)
        if self._current is outage:
            self._current = None
        self._retire(outage)

    def _use(self, tenant: str, requests: float, tokens: float, now: float, outage: int) -> None:
        if outage:  # admitted during a loss: that loss's, handed back or not
            record = self._outages.get(outage)
        elif self._circuit.shared:
            return  # admitted through Redis, back: the shell gives Redis what it owes
        else:
            record = self._current
        ledger = None if record is None else record.ledgers.get(tenant)
        if ledger is not None:
            ledger.use(requests, tokens, now)

    def _ended(self, tenant: str, outage: int) -> None:
        record = self._outages.get(outage) if outage else None
        if record is not None and record.open.get(tenant, 0) > 0:
            record.open[tenant] -= 1
            self._retire(record)

    def charged_late(self, tenant: str, tokens: int) -> None:
        """Redis charged a request after it had stopped waiting for the answer (the
        circuit went local meanwhile, and this process checked it against its share): the
        hand-back takes that charge off again."""
        if self._circuit.shared or self._current is None:
            return
        late = self._current.late.get(tenant)
        if late is None:
            late = self._current.late[tenant] = [0.0, 0.0]
        late[0] += 1
        late[1] += tokens

    def charge_for(self, tenant: str, tokens: int) -> int:
        return self.local.charge_for(tenant, tokens)

    def acquire(self, tenant: str, tokens: int, now: float) -> QuotaDecision:
        if self._circuit.shared and now >= self.hold_until:
            return ADMITTED
        decision = self.local.acquire(tenant, tokens, now)
        if decision.ok:
            self._local_open[tenant] = self._local_open.get(tenant, 0) + 1
            outage = self._current
            if not self._circuit.shared and outage is not None:
                self._use(tenant, 1, tokens, now, outage.number)
                outage.open[tenant] = outage.open.get(tenant, 0) + 1
                return QuotaDecision(True, 0.0, outage.number)
            # (holding: Redis charged it, and is given back what it does not use)
        return decision

    def _leave(self, tenant: str) -> bool:
        n = self._local_open.get(tenant, 0)
        if n <= 0:
            return False
        if n == 1:
            del self._local_open[tenant]
        else:
            self._local_open[tenant] = n - 1
        return True

    def refund(self, tenant: str, tokens: int, now: float, outage: int = 0) -> None:
        if self._leave(tenant):
            self.local.refund(tenant, tokens, now)
            self._use(tenant, -1, -tokens, now, outage)
            self._ended(tenant, outage)

    def settle(self, tenant: str, delta_tokens: int, now: float, outage: int = 0) -> None:
        if self._local_open.get(tenant, 0) > 0:
            self.local.settle(tenant, delta_tokens, now)
            self._use(tenant, 0, delta_tokens, now, outage)

    def release(self, tenant: str, now: float, outage: int = 0) -> None:
        if self._leave(tenant):
            self.local.release(tenant, now)
            self._ended(tenant, outage)
