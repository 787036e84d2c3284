"""Tenant quotas: requests per minute, tokens per minute, open requests.

The interface (`TenantQuotas`) is small so that a Redis-backed store, shared by several
gateway replicas, can replace the in-process one later:

    charge_for(tenant, tokens) -> int               what a request of this estimate is
                                                    charged (at most a full bucket)
    acquire(tenant, tokens, now) -> QuotaDecision   check and, when ok, charge at once
    refund(tenant, tokens, now)                     the request never ran: give back its
                                                    request, its tokens and its slot
    settle(tenant, delta_tokens, now)               actual - charged tokens, at the end
    release(tenant, now)                            an admitted request left (its slot)

`InProcessQuotas` keeps one token bucket per limit: capacity = the per-minute amount,
refilled continuously at amount/60 per second (a minute's worth may come in a burst).
A request is charged 1 request-token and its estimated tokens, at most a full bucket
(`capped_charge`: an estimate of millions, from a client's `max_tokens`, must not lock
its tenant out for ages); when it ends the charge becomes what it used (`settlement`).
No bucket falls below minus its capacity, so whatever a backend reports, a tenant is
never more than a minute in debt. maxConcurrency counts admitted requests that have not
left (queued or in flight).
The retry-after of a refusal is the time the buckets need to refill what is missing
(for maxConcurrency, which has no window: `concurrency_retry_s`).

When several gateway processes enforce one tenant's quota apart (the shared store is
unreachable), each holds a `QuotaShare`: a fraction of every limit, starting from that
fraction of what the tenant had left, so that the processes together hold the quota once.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol

from sluice.core.settings import TenantLimits
from sluice.core.types import Outcome


@dataclass(slots=True)  # one per request: not frozen (5x cheaper to make)
class QuotaDecision:
    ok: bool
    retry_after_s: float = 0.0
    # admitted by this process alone while the shared store was lost: which loss (0: none).
    # The request's refund, settle and release say it again, so that what it uses after
    # the loss's hand-back is still handed back (core/quota_failover.py)
    outage: int = 0


ADMITTED = QuotaDecision(True)  # shared: a decision is never changed


@dataclass(frozen=True, slots=True)
class QuotaShare:
    """This process's part of a tenant's quota while it enforces it on its own.

    `fraction` of every limit (bucket capacity and refill rate; maxConcurrency rounded up,
    at least 1); the buckets start at `fraction` of the tenant's whole levels as last known
    (None: as they are, full if new), so what the tenant used in the current minute still
    counts; `open`
    requests admitted elsewhere (before) are still running here and hold slots."""

    fraction: float
    requests_level: float | None = None
    tokens_level: float | None = None
    open: int = 0


def local_fraction(seen: float | None, processes: int, floor: float) -> float:
    """One process's fraction of a tenant's quota when `processes` enforce it apart:
    its part `seen` of the tenant's recent traffic (None: unknown, then 1/processes),
    with `floor` of the quota spread evenly, so that a process the traffic moves to is
    not at zero. Over processes whose `seen` add up to 1 the fractions add up to 1."""
    n = max(1, processes)
    part = 1.0 / n if seen is None else min(1.0, max(0.0, seen))
    return (1.0 - floor) * part + floor / n


def refilled(level: float, per_minute: float, elapsed_s: float) -> float:
    """A bucket's level `elapsed_s` later, with nothing taken meanwhile."""
    return min(float(per_minute), level + max(0.0, elapsed_s) * per_minute / 60.0)


def capped_charge(tokens: int, per_minute: int | float) -> int:
    """What a request estimated at `tokens` is charged against a bucket of `per_minute`
    (0: no token quota): at most the whole bucket."""
    if per_minute > 0 and tokens > per_minute:
        return max(1, int(per_minute))
    return tokens


_NOTHING_BILLED = frozenset({Outcome.ERROR, Outcome.TIMEOUT, Outcome.OVERLOADED})


def settlement(
    charged: int, outcome: Outcome, prompt_tokens: int | None, completion_tokens: int | None
) -> int:
    """Tokens to add to a finished request's charge (negative: to give back). The one rule
    for every tenant quota, local or shared: with reported usage the charge becomes the
    usage; without it, a request that completed or was cancelled keeps its estimate, one
    the backend refused or failed (4xx, 5xx, overloaded, timed out) is charged nothing."""
    if prompt_tokens is not None or completion_tokens is not None:
        return (prompt_tokens or 0) + (completion_tokens or 0) - charged
    if outcome is Outcome.CLIENT_ERROR or outcome in _NOTHING_BILLED:
        return -charged
    return 0


class TenantQuotas(Protocol):
    def charge_for(self, tenant: str, tokens: int) -> int: ...
    def set_limits(self, tenants: Iterable[TenantLimits], now: float = 0.0) -> None: ...
    def acquire(self, tenant: str, tokens: int, now: float) -> QuotaDecision: ...
    def refund(self, tenant: str, tokens: int, now: float, outage: int = 0) -> None: ...
    def settle(self, tenant: str, delta_tokens: int, now: float, outage: int = 0) -> None: ...
    def release(self, tenant: str, now: float, outage: int = 0) -> None: ...


class TokenBucket:
    __slots__ = ("at", "capacity", "level", "rate")

    def __init__(self, per_minute: float, now: float) -> None:
        self.capacity = float(per_minute)
        self.rate = per_minute / 60.0
        self.level = self.capacity
        self.at = now

    def refill(self, now: float) -> None:
        if now > self.at:
            self.level = min(self.capacity, self.level + (now - self.at) * self.rate)
            self.at = now

    def wait_for(self, amount: float) -> float:
        """Seconds until `amount` is available (after refill)."""
        need = min(amount, self.capacity) - self.level
        return 0.0 if need <= 0 else need / self.rate

    def resize(self, per_minute: float, now: float) -> None:
        self.refill(now)
        self.capacity = float(per_minute)
        self.rate = per_minute / 60.0
        self.level = min(self.level, self.capacity)


class _TenantState:
    __slots__ = ("max_concurrency", "open", "requests", "tokens")

    def __init__(self) -> None:
        self.requests: TokenBucket | None = None
        self.tokens: TokenBucket | None = None
        self.max_concurrency = 0
        self.open = 0


class InProcessQuotas:
    def __init__(self, tenants: Iterable[TenantLimits] = (), *, concurrency_retry_s: float = 1.0):
        self.concurrency_retry_s = concurrency_retry_s
        self._state: dict[str, _TenantState] = {}
        self._limits: dict[str, TenantLimits] = {}
        self._fractions: dict[str, float] = {}
        self.set_limits(tenants)

    def set_limits(self, tenants: Iterable[TenantLimits], now: float = 0.0) -> None:
        self._limits = {t.name: t for t in tenants}
        for name, st in self._state.items():
            self._apply(st, name, now)

    def set_share(self, tenant: str, share: QuotaShare, now: float) -> None:
        """From now on enforce `share` of the tenant's limits (kept across set_limits)."""
        self._fractions[tenant] = share.fraction
        st = self._get(tenant, now)
        self._apply(st, tenant, now)
        f = share.fraction
        if st.requests is not None and share.requests_level is not None:
            st.requests.level = min(st.requests.capacity, f * share.requests_level)
            st.requests.at = now
        if st.tokens is not None and share.tokens_level is not None:
            st.tokens.level = min(st.tokens.capacity, f * share.tokens_level)
            st.tokens.at = now
        st.open = share.open

    def _apply(self, st: _TenantState, name: str, now: float) -> None:
        t = self._limits.get(name)
        f = self._fractions.get(name, 1.0)
        rpm = t.requests_per_minute * f if t else 0
        tpm = t.tokens_per_minute * f if t else 0
        maxc = t.max_concurrency if t else 0
        st.max_concurrency = max(1, math.ceil(maxc * f - 1e-9)) if maxc > 0 else 0
        if rpm <= 0:
            st.requests = None
        elif st.requests is None:
            st.requests = TokenBucket(rpm, now)
        else:
            st.requests.resize(rpm, now)
        if tpm <= 0:
            st.tokens = None
        elif st.tokens is None:
            st.tokens = TokenBucket(tpm, now)
        else:
            st.tokens.resize(tpm, now)

    def _get(self, tenant: str, now: float) -> _TenantState:
        st = self._state.get(tenant)
        if st is None:
            st = self._state[tenant] = _TenantState()
            self._apply(st, tenant, now)
        return st

    def charge_for(self, tenant: str, tokens: int) -> int:
        st = self._state.get(tenant)
        if st is None:
            t = self._limits.get(tenant)
            if t is None:
                return tokens
            cap = t.tokens_per_minute * self._fractions.get(tenant, 1.0)
        else:
            cap = st.tokens.capacity if st.tokens is not None else 0.0
        return capped_charge(tokens, cap)

    def acquire(self, tenant: str, tokens: int, now: float) -> QuotaDecision:
        st = self._get(tenant, now)
        if st.max_concurrency and st.open >= st.max_concurrency:
            return QuotaDecision(False, self.concurrency_retry_s)
        wait = 0.0
        if st.requests is not None:
            st.requests.refill(now)
            wait = st.requests.wait_for(1.0)
        if st.tokens is not None:
            st.tokens.refill(now)
            wait = max(wait, st.tokens.wait_for(float(tokens)))
        if wait > 0:
            return QuotaDecision(False, wait)
        if st.requests is not None:
            st.requests.level -= 1.0
        if st.tokens is not None:
            st.tokens.level -= min(float(tokens), st.tokens.capacity)
        st.open += 1
        return ADMITTED

    def refund(self, tenant: str, tokens: int, now: float, outage: int = 0) -> None:
        st = self._get(tenant, now)
        if st.requests is not None:
            st.requests.refill(now)
            st.requests.level = min(st.requests.capacity, st.requests.level + 1.0)
        if st.tokens is not None:
            st.tokens.refill(now)
            st.tokens.level = min(st.tokens.capacity, st.tokens.level + tokens)
        self.release(tenant, now)

    def settle(self, tenant: str, delta_tokens: int, now: float, outage: int = 0) -> None:
        st = self._get(tenant, now)
        if st.tokens is not None and delta_tokens:
            bucket = st.tokens
            bucket.refill(now)
            bucket.level = max(-bucket.capacity, min(bucket.capacity, bucket.level - delta_tokens))

    def release(self, tenant: str, now: float, outage: int = 0) -> None:
        st = self._state.get(tenant)
        if st is not None and st.open > 0:
            st.open -= 1

    def levels(self, tenant: str, now: float) -> tuple[float | None, float | None]:
        """The tenant's (requests, tokens) bucket levels now; None where it has no limit.
        Not for admission (acquire decides): `sluice bench fleet-quotas` reports what each
        replica holds when it takes a quota over (bench/fleet_quotas.py)."""
        st = self._get(tenant, now)
        out: list[float | None] = []
        for bucket in (st.requests, st.tokens):
            if bucket is None:
                out.append(None)
            else:
                bucket.refill(now)
                out.append(bucket.level)
        return out[0], out[1]
