"""Redis as the shared tenant quotas use it, in virtual time: one store for a fleet of
gateway replicas, its scripts' semantics, a round trip per call, and outages.

Each method is one of the gateway's Lua scripts (src/sluice/gateway/lua/), run atomically
at `now`, the store's own time (Redis's TIME: the replicas' clocks do not matter):

    acquire    prelude.lua + demand.lua + acquire.lua: refill both buckets, record this
               process's demand, refuse over maxConcurrency or short of a request or of
               the (capped) tokens, else charge them
    finish     prelude.lua + finish.lua: give back requests and tokens (negative tokens:
               charge more), release slots
    sight      prelude.lua + demand.lua + sight.lua: the levels and this process's part
               of the demand, charging nothing
    resume     prelude.lua + resume.lua: charge what a process admitted on its own while
               the store was lost, restoring first the levels it last saw if the store
               has lost them
    heartbeat  heartbeat.lua: a process's open requests of a capped tenant
    processes  processes.lua: a process is alive; how many are
    leave      the ZREM of a process that stops

What the scripts keep: per tenant a hash of token buckets (level and time of each; capacity
the per-minute amount, refilled at amount/60 per second; a call takes no level below minus
a bucket, nor below where it was if deeper: no debt forgiven; the hand-back has no floor;
the key expiring 1 s after the buckets would be full again), the per-process demand
(exponentially decayed with `tau`, the parts adding up to 1; the key expiring after 10 tau
without demand), the per-process open counts with their last beat, and the live processes.
Every read after an expiry sees no key, as Redis's would. Not modelled: the hour-long
EXPIRE of the open counts and of the process set (runs are shorter), Cluster slots.

An `Outage` makes the store unreachable from `at` to `back`: a call reaching it meanwhile
is refused (`refused`: the connection is refused or reset, the caller learns it after a
round trip) or never answered (`timeout`: the caller's own timeout ends it); with `wiped`
the store comes back empty (a restart without persistence). `forgiven` counts, per
(tenant, "requests" | "tokens"), what a bucket's floor (minus a bucket) wiped off a debt:
a debt the quota never collects (a request's usage reported past a bucket of debt).
Pure: no I/O, time is the caller's.
"""

from __future__ import annotations

import itertools
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

from sluice.bench.noise import Jitter

Failure = Literal["refused", "timeout"]


@dataclass(frozen=True, slots=True)
class Outage:
    """The store cannot be reached from `at` to `back` (virtual seconds)."""

    at: float
    back: float
    failure: Failure = "refused"
    wiped: bool = False  # it comes back empty (a restart)

    def __post_init__(self) -> None:
        if not 0 <= self.at < self.back:
            raise ValueError("an outage needs 0 <= at < back")
        if self.failure not in ("refused", "timeout"):
            raise ValueError("an outage's failure is refused or timeout")


@dataclass(frozen=True, slots=True)
class Sight:
    """What a script shows a process of a tenant's quota: the levels (None: no such limit)
    and this process's part of the recent demand (None: none recorded)."""

    requests_level: float | None
    tokens_level: float | None
    part: float | None


@dataclass(frozen=True, slots=True)
class AcquireAnswer:
    ok: bool
    retry_after_s: float  # as the script formats it ('%.6f')
    sight: Sight


@dataclass(slots=True)
class _Rate:
    """A tenant's `:rate` hash: a field is None until written."""

    rl: float | None = None
    rt: float | None = None
    tl: float | None = None
    tt: float | None = None
    expires_at: float = math.inf


@dataclass(slots=True)
class _Share:
    """A tenant's `:share` hash (demand.lua)."""

    total: float = 0.0
    total_at: float | None = None
    mine: dict[str, float] = field(default_factory=dict)  # d:<process>
    mine_at: dict[str, float] = field(default_factory=dict)  # t:<process>
    sweep_at: float = 0.0  # S: the next forgetting of silent processes
    expires_at: float = math.inf


@dataclass(frozen=True, slots=True)
class StoreSpec:
    """A fleet's store: its round trip (fixed, or a lognormal draw per call) and outages."""

    round_trip_s: float = 0.001
    round_trip: Jitter | None = None
    outages: tuple[Outage, ...] = ()

    def build(self) -> QuotaStore:
        return QuotaStore(
            round_trip_s=self.round_trip_s, round_trip=self.round_trip, outages=self.outages
        )


class QuotaStore:
    """The shared store of a fleet's tenant quotas (module docstring)."""

    def __init__(
        self,
        *,
        round_trip_s: float = 0.001,
        round_trip: Jitter | None = None,
        outages: Sequence[Outage] = (),
    ) -> None:
        if round_trip_s < 0:
            raise ValueError("a round trip cannot be negative")
        self.round_trip_s = round_trip_s
        self.round_trip_jitter = round_trip
        self.outages = tuple(sorted(outages, key=lambda o: o.at))
        for a, b in itertools.pairwise(self.outages):
            if b.at < a.back:
                raise ValueError("outages must not overlap")
        self._wiped: set[int] = set()  # outages whose wipe has been applied
        self._rate: dict[str, _Rate] = {}
        self._share: dict[str, _Share] = {}
        self._conc: dict[str, dict[str, int]] = {}
        self._beat: dict[str, dict[str, float]] = {}
        self._processes: dict[str, float] = {}
        # per (tenant, process, loss): the last hand-back applied (its number, charges)
        self._hand_backs: dict[tuple[str, str, int], tuple[int, float, float]] = {}
        self.forgiven: dict[tuple[str, str], float] = {}
        self.calls = 0

    # -- reachability ---------------------------------------------------------------------

    def round_trip(self, rng: random.Random) -> float:
        """One call's round trip (a draw when the store has a jitter)."""
        if self.round_trip_jitter is not None:
            return self.round_trip_jitter.draw(rng)
        return self.round_trip_s

    def failure(self, now: float) -> Failure | None:
        """How a call reaching the store at `now` fails (None: it is answered)."""
        for o in self.outages:
            if o.at <= now < o.back:
                return o.failure
        return None

    def _catch_up(self, now: float) -> None:
        """Apply the wipe of every outage over by `now` (it came back empty)."""
        for i, o in enumerate(self.outages):
            if o.wiped and o.back <= now and i not in self._wiped:
                self._wiped.add(i)
                self._rate.clear()
                self._share.clear()
                self._conc.clear()
                self._beat.clear()
                self._processes.clear()
                self._hand_backs.clear()

    def _answered(self, now: float) -> None:
        if self.failure(now) is not None:
            raise RuntimeError(f"the store does not answer at {now:g} s")
        self._catch_up(now)
        self.calls += 1

    # -- prelude.lua: the buckets ---------------------------------------------------------

    def _rate_hash(self, tenant: str, now: float) -> _Rate | None:
        h = self._rate.get(tenant)
        if h is not None and now >= h.expires_at:
            del self._rate[tenant]
            return None
        return h

    @staticmethod
    def _level(cap: float, level: float | None, at: float | None, now: float) -> float:
        if level is None or at is None:
            return float(cap)
        if now > at:
            level += (now - at) * cap / 60
        return min(float(cap), level)

    def _levels(self, tenant: str, rpm: float, tpm: float, now: float) -> tuple[float, float]:
        h = self._rate_hash(tenant, now)
        rl = tl = 0.0
        if rpm > 0:
            rl = self._level(rpm, None if h is None else h.rl, None if h is None else h.rt, now)
        if tpm > 0:
            tl = self._level(tpm, None if h is None else h.tl, None if h is None else h.tt, now)
        return rl, tl

    def _store(
        self,
        tenant: str,
        rpm: float,
        tpm: float,
        rl: float,
        tl: float,
        now: float,
        before: tuple[float, float] | None,
    ) -> tuple[float, float]:
        """prelude.lua's store(): floor (from the levels `before` the call; None: none,
        the hand-back's), write, expire. The levels as written."""
        if before is not None:
            floor = min(before[0], -rpm)
            if rl < floor:
                self._forgive(tenant, "requests", floor - rl if rpm > 0 else 0.0)
                rl = floor
            floor = min(before[1], -tpm)
            if tl < floor:
                self._forgive(tenant, "tokens", floor - tl if tpm > 0 else 0.0)
                tl = floor
        ttl = 0.0
        h = self._rate_hash(tenant, now) or _Rate()
        if rpm > 0:
            h.rl, h.rt = rl, now
            ttl = max(ttl, (rpm - rl) * 60 / rpm)
        if tpm > 0:
            h.tl, h.tt = tl, now
            ttl = max(ttl, (tpm - tl) * 60 / tpm)
        if ttl > 0:  # PEXPIRE ceil(ttl ms) + 1000 ms
            h.expires_at = now + (math.ceil(ttl * 1000) + 1000) / 1000
            self._rate[tenant] = h
        else:  # a bucket that would be full again is the same as no key
            self._rate.pop(tenant, None)
        return rl, tl

    def _forgive(self, tenant: str, what: str, amount: float) -> None:
        if amount > 0:
            key = (tenant, what)
            self.forgiven[key] = self.forgiven.get(key, 0.0) + amount

    # -- demand.lua -----------------------------------------------------------------------

    def _demand(self, tenant: str, me: str, add: float, tau: float, now: float) -> float | None:
        s = self._share.get(tenant)
        if s is not None and now >= s.expires_at:
            del self._share[tenant]
            s = None
        total = 0.0 if s is None else s.total
        mine = 0.0 if s is None else s.mine.get(me, 0.0)
        if s is not None and s.total_at is not None:
            total *= math.exp(-max(0.0, now - s.total_at) / tau)
        if s is not None and me in s.mine_at:
            mine *= math.exp(-max(0.0, now - s.mine_at[me]) / tau)
        if add > 0:
            if s is None:
                s = self._share[tenant] = _Share()
            total, mine = total + add, mine + add
            s.total, s.total_at = total, now
            s.mine[me], s.mine_at[me] = mine, now
            if now >= s.sweep_at:  # forget processes silent for 10 tau
                for name in [n for n, at in s.mine_at.items() if now - at > 10 * tau]:
                    del s.mine_at[name]
                    s.mine.pop(name, None)
                s.sweep_at = now + tau
            s.expires_at = now + math.ceil(10 * tau * 1000) / 1000
        if total <= 0:
            return None
        return min(1.0, mine / total)

    @staticmethod
    def _sight(rpm: float, tpm: float, rl: float, tl: float, part: float | None) -> Sight:
        return Sight(rl if rpm > 0 else None, tl if tpm > 0 else None, part)

    # -- the scripts ----------------------------------------------------------------------

    def acquire(
        self,
        now: float,
        tenant: str,
        *,
        rpm: int,
        tpm: int,
        max_concurrency: int,
        tokens: int,
        process: str,
        stale_s: float,
        concurrency_retry_s: float,
        tau_s: float,
    ) -> AcquireAnswer:
        """acquire.lua: charge one request of `tokens` (at most a full bucket)."""
        self._answered(now)
        rl, tl = self._levels(tenant, rpm, tpm, now)
        if tpm > 0 and tokens > tpm:
            tokens = tpm
        weight = max(1, tokens) if tpm > 0 else 1
        part = self._demand(tenant, process, weight, tau_s, now)
        if max_concurrency > 0:
            conc = self._conc.setdefault(tenant, {})
            beats = self._beat.setdefault(tenant, {})
            open_ = 0
            for name in list(conc):
                beat = beats.get(name, 0.0)
                if name != process and now - beat > stale_s:
                    del conc[name]
                    beats.pop(name, None)
                else:
                    open_ += conc[name]
            if open_ >= max_concurrency:
                return AcquireAnswer(
                    False, concurrency_retry_s, self._sight(rpm, tpm, rl, tl, part)
                )
        wait = 0.0
        if rpm > 0 and rl < 1:
            wait = (1 - rl) * 60 / rpm
        if tpm > 0:
            need = tokens - tl
            if need > 0:
                wait = max(wait, need * 60 / tpm)
        if wait > 0:
            retry = float(f"{wait:.6f}")
            return AcquireAnswer(False, retry, self._sight(rpm, tpm, rl, tl, part))
        rl, tl = self._store(tenant, rpm, tpm, rl - 1, tl - tokens, now, (rl, tl))
        if max_concurrency > 0:
            conc = self._conc.setdefault(tenant, {})
            conc[process] = conc.get(process, 0) + 1
            self._beat.setdefault(tenant, {})[process] = now
        return AcquireAnswer(True, 0.0, self._sight(rpm, tpm, rl, tl, part))

    def finish(
        self,
        now: float,
        tenant: str,
        *,
        rpm: int,
        tpm: int,
        requests_back: int,
        tokens_back: int,
        releases: int,
        process: str,
    ) -> tuple[float | None, float | None]:
        """finish.lua: give back; the levels after it (None: no such limit)."""
        self._answered(now)
        rl, tl = self._levels(tenant, rpm, tpm, now)
        if (rpm > 0 and requests_back != 0) or (tpm > 0 and tokens_back != 0):
            before = (rl, tl)
            rl = min(float(rpm), rl + requests_back)
            tl = min(float(tpm), tl + tokens_back)
            rl, tl = self._store(tenant, rpm, tpm, rl, tl, now, before)
        conc = self._conc.get(tenant)
        if releases > 0 and conc is not None and process in conc:
            conc[process] -= releases
            if conc[process] <= 0:
                del conc[process]
        return (rl if rpm > 0 else None), (tl if tpm > 0 else None)

    def sight(
        self, now: float, tenant: str, *, rpm: int, tpm: int, process: str, tau_s: float
    ) -> Sight:
        """sight.lua: the levels and this process's part of the demand."""
        self._answered(now)
        rl, tl = self._levels(tenant, rpm, tpm, now)
        return self._sight(rpm, tpm, rl, tl, self._demand(tenant, process, 0, tau_s, now))

    def resume(
        self,
        now: float,
        tenant: str,
        *,
        rpm: int,
        tpm: int,
        requests_used: float,
        tokens_used: float,
        requests_level: float,
        tokens_level: float,
        hand_back: tuple[str, int, int] | None = None,
    ) -> bool:
        """resume.lua: charge for what a process admitted on its own meanwhile (its use
        less what its share refilled), restoring first its estimate of a level the store
        has lost (-1: unknown). With `hand_back` (process, loss, number), the charges are
        the loss's whole: one applied already, or older, charges nothing (False), a newer
        one what it adds."""
        self._answered(now)
        key = None if hand_back is None else (tenant, hand_back[0], hand_back[1])
        last = None if key is None else self._hand_backs.get(key)
        if last is not None and hand_back is not None and hand_back[2] <= last[0]:
            return False
        rl, tl = self._levels(tenant, rpm, tpm, now)
        h = self._rate_hash(tenant, now)
        r0 = t0 = 0.0
        if last is None:
            if rpm > 0 and requests_level >= 0 and (h is None or h.rt is None):
                rl = min(float(rpm), requests_level)
            if tpm > 0 and tokens_level >= 0 and (h is None or h.tt is None):
                tl = min(float(tpm), tokens_level)
        else:
            r0, t0 = last[1], last[2]
        self._store(tenant, rpm, tpm, rl - (requests_used - r0), tl - (tokens_used - t0), now, None)
        if key is not None and hand_back is not None:
            self._hand_backs[key] = (hand_back[2], requests_used, tokens_used)
        return True

    def heartbeat(self, now: float, tenant: str, *, process: str, open_requests: int) -> None:
        """heartbeat.lua: the absolute count of a process's open requests."""
        self._answered(now)
        if open_requests > 0:
            self._conc.setdefault(tenant, {})[process] = open_requests
            self._beat.setdefault(tenant, {})[process] = now
        else:
            self._conc.get(tenant, {}).pop(process, None)
            self._beat.get(tenant, {}).pop(process, None)

    def processes(self, now: float, *, process: str, stale_s: float) -> int:
        """processes.lua: `process` is alive; how many were within `stale_s`."""
        self._answered(now)
        self._processes[process] = now
        for name in [n for n, at in self._processes.items() if at <= now - stale_s]:
            del self._processes[name]
        return len(self._processes)

    def leave(self, now: float, process: str) -> None:
        """The ZREM of a process that stops."""
        self._answered(now)
        self._processes.pop(process, None)

    def ping(self, now: float) -> None:
        self._answered(now)

    # -- for the bench's figures (no script: what an operator would read with HGETALL) ----

    def levels(self, now: float, tenant: str, rpm: int, tpm: int) -> tuple[float, float]:
        """A tenant's (requests, tokens) levels now, refilled (during an outage: as they
        were when it began, refilled since)."""
        self._catch_up(now)
        return self._levels(tenant, rpm, tpm, now)

    def open_requests(self, tenant: str) -> int:
        return sum(self._conc.get(tenant, {}).values())
