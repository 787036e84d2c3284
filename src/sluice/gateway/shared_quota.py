"""Tenant quotas shared by every gateway process through Redis, failing open to local ones.

With `redis: {url: ...}` in the policy, the shell checks a tenant's quota in Redis before
`controller.arrive` (one atomic Lua script per check, 50 ms at most) and gives back what
the request did not use on every way out (refused by the core, dropped from its queue,
cancelled, finished with its usage). The core Controller then gets `FailoverQuotas`,
which charges nothing while Redis answers and delegates to an `InProcessQuotas` while it
does not, so that a tenant's quota is never counted twice and Redis being down is
neither a crash nor a stall: each process enforces the quotas on its own until Redis is
back (logged once on each change, exported as `sluice_quota_backend{mode}`).

Going local must not hand a tenant its quota again: each Redis answer shows the process
the tenant's bucket levels and this process's part of the tenant's recent demand (every
process's demand decays alike, so the parts add up to 1), refreshed by the heartbeat for
tenants the process has not asked about lately. When Redis is lost, each process enforces
that part of the quota (with `SHARE_FLOOR` of it spread evenly over the live processes),
starting from that part of the levels last seen: what the tenant used in the current
minute still counts. When Redis is back, each process charges it what it admitted on its
own meanwhile, restoring first the levels it last saw if Redis lost them (a restart).

Redis side (semantics of `InProcessQuotas`, see core/quota.py): per tenant one hash of
token buckets (`rl`/`rt` request level/time, `tl`/`tt` tokens), capacity = the
per-minute amount, refilled at amount/60 per second, the key expiring when the buckets
would be full again; maxConcurrency as one count per gateway process (`conc`) with the
time each process last showed signs of life (`beat`): a process that has not done so for
`STALE_AFTER_S` (it crashed) no longer counts. Time is Redis's own (TIME), so the
processes' clocks do not matter. All keys of a tenant share the hash tag
`{sluice:tenant:NAME}`, so each script touches one slot of a Redis Cluster.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import socket
import uuid
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError

from sluice.config import Tenant
from sluice.core.clock import Clock
from sluice.core.quota import (
    InProcessQuotas,
    QuotaDecision,
    QuotaShare,
    local_fraction,
    refilled,
)

log = logging.getLogger("sluice.quota")

# Constants until the policy has keys for them (redis.keyPrefix, redis.timeout...).
KEY_PREFIX = "sluice"
CALL_TIMEOUT_S = 1.0  # every call on the request path; a slower answer counts as failing
PROBE_TIMEOUT_S = 0.5  # the background PING (while local, or after timeouts)
REPROBE_S = 1.0  # while local, try Redis again this often (not on every request)
TIMEOUTS_TO_SUSPECT = 3  # timeouts in a row that call for a probe (a refused connection
# goes local at once; timeouts only when the probe fails too)
HEARTBEAT_S = 2.0  # each process re-states its open requests per capped tenant this often
STALE_AFTER_S = 10.0  # a process silent this long (crashed) no longer counts
CONCURRENCY_RETRY_S = 1.0  # Retry-After for maxConcurrency, which has no window
MAX_CONNECTIONS = 32  # per process; callers wait for a free one within their timeout
RETRY_MIN_S, RETRY_MAX_S = 0.1, 60.0  # Retry-After clamp, as the core's
FLUSH_S = 0.02  # what finished requests give back goes to Redis in one call per tenant
SHARE_FLOOR = 0.1  # of a quota spread evenly over the processes when they go local
DEMAND_TAU_S = 30.0  # "recent" demand: each process's decays with this time constant
SIGHTS_PER_BEAT = 32  # tenants whose last sight is older than a heartbeat, refreshed per beat

OK = QuotaDecision(True)

# -- Lua ----------------------------------------------------------------------------------

# Shared by both scripts: the time, the limits and both buckets after refill.
_PRELUDE = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local rpm = tonumber(ARGV[1])
local tpm = tonumber(ARGV[2])
local function level(cap, lf, tf)
  local v = redis.call('HMGET', KEYS[1], lf, tf)
  local l, at = tonumber(v[1]), tonumber(v[2])
  if l == nil or at == nil then return cap end
  if now > at then l = l + (now - at) * cap / 60 end
  if l > cap then l = cap end
  return l
end
local rl, tl = 0, 0
if rpm > 0 then rl = level(rpm, 'rl', 'rt') end
if tpm > 0 then tl = level(tpm, 'tl', 'tt') end
local function store()
  local ttl = 0
  local f = '%.17g'
  if rpm > 0 then
    redis.call('HSET', KEYS[1], 'rl', string.format(f, rl), 'rt', string.format(f, now))
    ttl = math.max(ttl, (rpm - rl) * 60 / rpm)
  end
  if tpm > 0 then
    redis.call('HSET', KEYS[1], 'tl', string.format(f, tl), 'tt', string.format(f, now))
    ttl = math.max(ttl, (tpm - tl) * 60 / tpm)
  end
  -- a bucket that would be full again is the same as no key
  if ttl > 0 then
    redis.call('PEXPIRE', KEYS[1], math.ceil(ttl * 1000) + 1000)
  else
    redis.call('DEL', KEYS[1])
  end
end
local function lvl(cap, l)
  if cap > 0 then return string.format('%.17g', l) end
  return '-1'
end
"""

# This process's part of the tenant's recent demand (tokens asked; requests when the
# tenant has no token quota): exponentially decayed sums, one per process and their total,
# all decayed alike so that the parts add up to the total at any time. Returns the part
# as a string ('-1': no demand recorded).
_DEMAND = """
local function demand(key, me, add, tau)
  local f = '%.17g'
  local v = redis.call('HMGET', key, 'T', 'Tt', 'd:' .. me, 't:' .. me, 'S')
  local total, mine = tonumber(v[1]) or 0, tonumber(v[3]) or 0
  if v[2] then total = total * math.exp(-math.max(0, now - tonumber(v[2])) / tau) end
  if v[4] then mine = mine * math.exp(-math.max(0, now - tonumber(v[4])) / tau) end
  if add > 0 then
    total, mine = total + add, mine + add
    redis.call('HSET', key, 'T', string.format(f, total), 'Tt', string.format(f, now),
      'd:' .. me, string.format(f, mine), 't:' .. me, string.format(f, now))
    -- once per tau: forget processes silent for 10 tau (gone; their part is ~0 by then)
    if now >= (tonumber(v[5]) or 0) then
      local all = redis.call('HGETALL', key)
      for i = 1, #all, 2 do
        local name = all[i]
        if string.sub(name, 1, 2) == 't:' and now - tonumber(all[i + 1]) > 10 * tau then
          redis.call('HDEL', key, name, 'd:' .. string.sub(name, 3))
        end
      end
      redis.call('HSET', key, 'S', string.format(f, now + tau))
    end
    redis.call('PEXPIRE', key, math.ceil(10 * tau * 1000))
  end
  if total <= 0 then return '-1' end
  return string.format(f, math.min(1, mine / total))
end
"""

# KEYS: rate, conc, beat, share. ARGV: rpm, tpm, maxConcurrency, tokens, process, stale_s,
# concurrency_retry_s, demand_tau_s. Returns {ok (1|0), retry_after_s, then the sight:
# requests level, tokens level ('-1': no such limit), this process's part of the demand},
# all but ok as strings.
ACQUIRE_LUA = (
    _PRELUDE
    + _DEMAND
    + """
local maxc = tonumber(ARGV[3])
local tokens = tonumber(ARGV[4])
local me = ARGV[5]
local weight = 1
if tpm > 0 then weight = math.max(1, tokens) end
local part = demand(KEYS[4], me, weight, tonumber(ARGV[8]))
local function answer(ok, retry)
  return {ok, retry, lvl(rpm, rl), lvl(tpm, tl), part}
end
if maxc > 0 then
  local stale = tonumber(ARGV[6])
  local conc = redis.call('HGETALL', KEYS[2])
  local open = 0
  for i = 1, #conc, 2 do
    local beat = tonumber(redis.call('HGET', KEYS[3], conc[i]) or '0')
    if conc[i] ~= me and now - beat > stale then
      redis.call('HDEL', KEYS[2], conc[i])
      redis.call('HDEL', KEYS[3], conc[i])
    else
      open = open + tonumber(conc[i + 1])
    end
  end
  if open >= maxc then return answer(0, ARGV[7]) end
end
local wait = 0
if rpm > 0 and rl < 1 then wait = (1 - rl) * 60 / rpm end
if tpm > 0 then
  local need = math.min(tokens, tpm) - tl
  if need > 0 then wait = math.max(wait, need * 60 / tpm) end
end
if wait > 0 then return answer(0, string.format('%.6f', wait)) end
rl = rl - 1
tl = tl - tokens
store()
if maxc > 0 then
  redis.call('HINCRBY', KEYS[2], me, 1)
  redis.call('HSET', KEYS[3], me, string.format('%.17g', now))
  redis.call('EXPIRE', KEYS[2], 3600)
  redis.call('EXPIRE', KEYS[3], 3600)
end
return answer(1, '0')
"""
)

# KEYS: rate, share. ARGV: rpm, tpm, process, demand_tau_s. The sight alone (levels and
# part of the demand, as in ACQUIRE_LUA's answer), charging nothing.
SIGHT_LUA = (
    _PRELUDE
    + _DEMAND
    + """
return {lvl(rpm, rl), lvl(tpm, tl), demand(KEYS[2], ARGV[3], 0, tonumber(ARGV[4]))}
"""
)

# KEYS: rate. ARGV: rpm, tpm, requests and tokens one process admitted on its own while
# Redis was lost, and its estimate of the levels had nothing been used ('-1': unknown),
# which stand in for buckets Redis lost (a restart).
RESUME_LUA = (
    _PRELUDE
    + """
local rest, test = tonumber(ARGV[5]), tonumber(ARGV[6])
if rpm > 0 and rest >= 0 and redis.call('HEXISTS', KEYS[1], 'rt') == 0 then
  rl = math.min(rpm, rest)
end
if tpm > 0 and test >= 0 and redis.call('HEXISTS', KEYS[1], 'tt') == 0 then
  tl = math.min(tpm, test)
end
rl = rl - tonumber(ARGV[3])
tl = tl - tonumber(ARGV[4])
store()
return 1
"""
)

# KEYS: rate, conc. ARGV: rpm, tpm, requests back, tokens back (negative: charge more),
# slots released, process. A refund is (1, tokens, 1); a settle + release (0, charged -
# used, 1); a release alone (0, 0, 1); the gate sends the sum of a few at once. Returns
# the levels after it (as in ACQUIRE_LUA's sight): the freshest sight once traffic stops.
FINISH_LUA = (
    _PRELUDE
    + """
local rback = tonumber(ARGV[3])
local tback = tonumber(ARGV[4])
if (rpm > 0 and rback ~= 0) or (tpm > 0 and tback ~= 0) then
  rl = math.min(rpm, rl + rback)
  tl = math.min(tpm, tl + tback)
  store()
end
local releases = tonumber(ARGV[5])
if releases > 0 and redis.call('HEXISTS', KEYS[2], ARGV[6]) == 1 then
  if redis.call('HINCRBY', KEYS[2], ARGV[6], -releases) <= 0 then
    redis.call('HDEL', KEYS[2], ARGV[6])
  end
end
return {lvl(rpm, rl), lvl(tpm, tl)}
"""
)

# KEYS: conc, beat. ARGV: process, its open requests. The absolute count repairs what a
# lost call left wrong; a process with none leaves no trace.
HEARTBEAT_LUA = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local n = tonumber(ARGV[2])
if n > 0 then
  redis.call('HSET', KEYS[1], ARGV[1], n)
  redis.call('HSET', KEYS[2], ARGV[1], string.format('%.17g', now))
  redis.call('EXPIRE', KEYS[1], 3600)
  redis.call('EXPIRE', KEYS[2], 3600)
else
  redis.call('HDEL', KEYS[1], ARGV[1])
  redis.call('HDEL', KEYS[2], ARGV[1])
end
return 1
"""


# KEYS: the set of live gateway processes. ARGV: process, stale_s. Returns how many
# processes showed signs of life within stale_s (this one included).
PROCESSES_LUA = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
redis.call('ZADD', KEYS[1], now, ARGV[1])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now - tonumber(ARGV[2]))
redis.call('EXPIRE', KEYS[1], 3600)
return redis.call('ZCARD', KEYS[1])
"""


def processes_key(prefix: str = KEY_PREFIX) -> str:
    return f"{{{prefix}}}:processes"


def tenant_keys(tenant: str, prefix: str = KEY_PREFIX) -> tuple[str, str, str, str]:
    """The tenant's keys (rate, conc, beat, share): one hash tag, so one Cluster slot."""
    tag = f"{{{prefix}:tenant:{tenant}}}"
    return f"{tag}:rate", f"{tag}:conc", f"{tag}:beat", f"{tag}:share"


def has_quota(t: Tenant) -> bool:
    return bool(t.tokens_per_minute or t.requests_per_minute or t.max_concurrency)


# -- the circuit: shared or local ---------------------------------------------------------


class QuotaCircuit:
    """Whether quotas are shared (Redis answers) or local (it does not).

    A refused or broken connection goes local at once. Timeouts do not, by themselves:
    a gateway whose own event loop is starved sees every call time out while Redis is
    fine. `timeouts_to_suspect` in a row make a probe due at once (a PING with a longer
    timeout); only a failed probe goes local. While local, Redis is probed every
    `reprobe_s`, by the background task only, never by requests."""

    def __init__(
        self,
        clock: Clock,
        *,
        timeouts_to_suspect: int = TIMEOUTS_TO_SUSPECT,
        reprobe_s: float = REPROBE_S,
    ) -> None:
        self._clock = clock
        self.timeouts_to_suspect = timeouts_to_suspect
        self.reprobe_s = reprobe_s
        self.shared = True
        self._timeouts = 0
        self._suspect = False
        self._next_probe = 0.0

    def success(self) -> bool:
        """Redis answered; True if that brings quotas back to shared."""
        self._timeouts = 0
        self._suspect = False
        if self.shared:
            return False
        self.shared = True
        return True

    def failure(self, timeout: bool) -> bool:
        """A call failed; True if quotas go local now."""
        if not self.shared:
            return False
        if timeout:
            self._timeouts += 1
            if self._timeouts >= self.timeouts_to_suspect:
                self._suspect = True
            return False
        return self._open()

    def _open(self) -> bool:
        self._timeouts = 0
        self._suspect = False
        self.shared = False
        self._next_probe = self._clock.now() + self.reprobe_s
        return True

    def probe_due(self) -> bool:
        if self.shared:
            return self._suspect
        return self._clock.now() >= self._next_probe

    def probe_failed(self) -> bool:
        """The probe got no answer; True if quotas go local now (else the next probe
        waits another `reprobe_s`)."""
        if self.shared:
            return self._open()
        self._next_probe = self._clock.now() + self.reprobe_s
        return False


# -- the core's side ----------------------------------------------------------------------


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
    """What this process admitted of a tenant's quota on its own while Redis was lost,
    for Redis once it is back, with its estimate of the tenant's levels had nothing been
    used (-1: unknown), which stands in for buckets Redis lost."""

    requests_used: float
    tokens_used: float
    requests_level: float
    tokens_level: float


class FailoverQuotas:
    """`TenantQuotas` for the Controller when Redis holds the quotas: charges nothing
    while quotas are shared (the shell has charged Redis), and delegates to `local`
    while they are local.

    `take_over` (the circuit just went local) gives `local` this process's share of each
    tenant's quota (`local_fraction` of its part of the demand last seen, over the live
    processes), starting from that share of the levels last seen, refilled since: so the
    processes together hold each quota once, what was used in the current minute included.
    Refunds, settles and releases go to `local` only for tenants with requests it holds
    (charged locally, or still running from before), so a request admitted through Redis
    after it is back never gives back to the local buckets. `hand_back` says what was
    admitted locally meanwhile, for Redis. (A request whose Redis check succeeded in the
    instant the circuit went local is charged locally too: a one-off, on the safe side.)"""

    def __init__(
        self,
        local: InProcessQuotas,
        circuit: QuotaCircuit,
        on_limits: Callable[[Iterable[Tenant]], None] | None = None,
        *,
        floor: float = SHARE_FLOOR,
    ) -> None:
        self.local = local
        self._circuit = circuit
        self._on_limits = on_limits
        self.floor = floor
        self._local_open: dict[str, int] = {}
        self._tenants: dict[str, Tenant] = {}
        self._sights: dict[str, QuotaSight] = {}
        self._taken: set[str] = set()  # tenants given a local share since the last loss
        self._used: dict[str, list[float]] = {}  # per tenant while local: requests, tokens
        self.processes = 1

    def set_limits(self, tenants: Iterable[Tenant], now: float = 0.0) -> None:
        self._tenants = {t.name: t for t in tenants}
        self.local.set_limits(self._tenants.values(), now)
        if not self._circuit.shared:  # a tenant new while local gets its share too
            for t in self._tenants.values():
                if has_quota(t) and t.name not in self._taken:
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
        self._used = {}
        self._taken = set()
        for t in self._tenants.values():
            if has_quota(t):
                self._take(t, now, running.get(t.name, 0))

    def _take(self, t: Tenant, now: float, running: int) -> None:
        sight = self._sights.get(t.name)
        fraction = local_fraction(sight.part if sight else None, self.processes, self.floor)
        requests_level, tokens_level = self._estimate(t, now)
        held = self._local_open.get(t.name, 0) + max(0, running)
        if held:
            self._local_open[t.name] = held
        share = QuotaShare(fraction, requests_level, tokens_level, held)
        self.local.set_share(t.name, share, now)
        self._taken.add(t.name)

    def _estimate(self, t: Tenant, now: float) -> tuple[float | None, float | None]:
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
        """Per tenant, what Redis should be told now that it is back (call `handed_back`
        once it has been). Tenants whose levels were below full are included even with
        nothing used: a Redis that lost them must not start them full."""
        out: dict[str, HandBack] = {}
        for name, t in self._tenants.items():
            if not has_quota(t):
                continue
            requests_used, tokens_used = self._used.get(name, (0.0, 0.0))
            rl, tl = self._estimate(t, now)
            below = (rl is not None and rl < t.requests_per_minute) or (
                tl is not None and tl < t.tokens_per_minute
            )
            if requests_used or tokens_used or below:
                out[name] = HandBack(
                    requests_used,
                    tokens_used,
                    -1.0 if rl is None else rl,
                    -1.0 if tl is None else tl,
                )
        return out

    def handed_back(self) -> None:
        self._used = {}

    def _use(self, tenant: str, requests: float, tokens: float) -> None:
        if self._circuit.shared:
            return  # after the hand-back: Redis was charged these already
        used = self._used.get(tenant)
        if used is None:
            used = self._used[tenant] = [0.0, 0.0]
        used[0] += requests
        used[1] += tokens

    def acquire(self, tenant: str, tokens: int, now: float) -> QuotaDecision:
        if self._circuit.shared:
            return OK
        decision = self.local.acquire(tenant, tokens, now)
        if decision.ok:
            self._local_open[tenant] = self._local_open.get(tenant, 0) + 1
            self._use(tenant, 1, tokens)
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

    def refund(self, tenant: str, tokens: int, now: float) -> None:
        if self._leave(tenant):
            self.local.refund(tenant, tokens, now)
            self._use(tenant, -1, -tokens)

    def settle(self, tenant: str, delta_tokens: int, now: float) -> None:
        if self._local_open.get(tenant, 0) > 0:
            self.local.settle(tenant, delta_tokens, now)
            self._use(tenant, 0, delta_tokens)

    def release(self, tenant: str, now: float) -> None:
        if self._leave(tenant):
            self.local.release(tenant, now)


# -- the shell's side ---------------------------------------------------------------------


class QuotaTicket:
    """One client request's charge in Redis. The shell marks what happened to it
    (`ran`, `used`) and calls `close()` once on every way out; `close` gives back what
    the request did not use, in the background."""

    __slots__ = (
        "_gate",
        "closed",
        "ok",
        "ran",
        "retry_after_s",
        "shared",
        "tenant",
        "tokens",
        "used_tokens",
    )

    def __init__(
        self,
        gate: SharedQuotaGate | None,
        tenant: str,
        tokens: int,
        *,
        ok: bool,
        shared: bool,
        retry_after_s: float = 0.0,
    ) -> None:
        self._gate = gate
        self.tenant = tenant
        self.tokens = tokens
        self.ok = ok
        self.shared = shared  # charged in Redis (else the core charged the local quotas)
        self.retry_after_s = retry_after_s
        self.ran = False  # it reached a backend
        self.used_tokens: int | None = None
        self.closed = not (ok and shared)

    def used(self, prompt_tokens: int | None, completion_tokens: int | None) -> None:
        self.ran = True
        if prompt_tokens is not None or completion_tokens is not None:
            self.used_tokens = (prompt_tokens or 0) + (completion_tokens or 0)

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        assert self._gate is not None
        if not self.ran:  # refused by the core, dropped from the queue, cancelled there
            self._gate.finish(self.tenant, 1, self.tokens)
        elif self.used_tokens is not None:
            self._gate.finish(self.tenant, 0, self.tokens - self.used_tokens)
        else:  # cancelled in flight, or no usage reported: the estimate stands
            self._gate.finish(self.tenant, 0, 0)


def _failure_kind(exc: BaseException) -> str:
    if isinstance(exc, (TimeoutError, RedisTimeoutError)):
        return "timeout"
    if isinstance(exc, (RedisConnectionError, OSError)):
        return "connection"
    return "error"


class SharedQuotaGate:
    """Checks quotas in Redis for the tenants that have one; owns the circuit, the
    background probe and heartbeat, and the `FailoverQuotas` for the Controller.

        gate = SharedQuotaGate(url, policy.tenants, clock, on_mode=..., on_error=...)
        controller = Controller(policy, clock, quotas=gate.controller_quotas)
        await gate.start()
        ticket = await gate.acquire(tenant, tokens)     # when gate.limits(tenant)
        ... ticket.ok / ticket.retry_after_s; ticket.used(p, c); ticket.close()
        await gate.stop()
    """

    def __init__(
        self,
        url: str,
        tenants: Iterable[Tenant],
        clock: Clock,
        *,
        on_mode: Callable[[str], None] | None = None,
        on_error: Callable[[str], None] | None = None,
        client: Any = None,
        prefix: str = KEY_PREFIX,
        call_timeout_s: float = CALL_TIMEOUT_S,
        reprobe_s: float = REPROBE_S,
        heartbeat_s: float = HEARTBEAT_S,
        stale_after_s: float = STALE_AFTER_S,
    ) -> None:
        self.url = url
        self._clock = clock
        self._on_mode = on_mode
        self._on_error = on_error
        self._prefix = prefix
        self.call_timeout_s = call_timeout_s
        self.heartbeat_s = heartbeat_s
        self.stale_after_s = stale_after_s
        self.process = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self.circuit = QuotaCircuit(clock, reprobe_s=reprobe_s)
        self._limits: dict[str, Tenant] = {}
        self.controller_quotas = FailoverQuotas(
            InProcessQuotas(concurrency_retry_s=CONCURRENCY_RETRY_S),
            self.circuit,
            on_limits=self.set_limits,
        )
        self.controller_quotas.set_limits(tenants)
        self._wake = asyncio.Event()
        self._keys: dict[str, tuple[str, str, str, str]] = {}
        self._open: dict[str, int] = {}  # requests charged in Redis and not yet finished
        self._charged: dict[str, int] = {}  # of those, the ones Redis has said yes to
        self._busy: dict[str, int] = {}  # calls in flight per tenant (heartbeat waits)
        self._tasks: set[asyncio.Task[Any]] = set()
        self._owed: dict[str, list[int]] = {}  # per tenant: requests, tokens, slots back
        self._flush_timer: asyncio.TimerHandle | None = None
        self._loop_task: asyncio.Task[None] | None = None
        self._client = client if client is not None else _connect(url)
        self._acquire = self._client.register_script(ACQUIRE_LUA)
        self._finish = self._client.register_script(FINISH_LUA)
        self._heartbeat = self._client.register_script(HEARTBEAT_LUA)
        self._processes = self._client.register_script(PROCESSES_LUA)
        self._sight = self._client.register_script(SIGHT_LUA)
        self._resume = self._client.register_script(RESUME_LUA)

    @property
    def mode(self) -> str:
        return "redis" if self.circuit.shared else "local"

    def set_limits(self, tenants: Iterable[Tenant]) -> None:
        self._limits = {t.name: t for t in tenants if has_quota(t)}

    def limits(self, tenant: str) -> Tenant | None:
        """The tenant's limits if it has a quota (else no check is needed)."""
        return self._limits.get(tenant)

    def _tenant_keys(self, tenant: str) -> tuple[str, str, str, str]:
        keys = self._keys.get(tenant)
        if keys is None:
            keys = self._keys[tenant] = tenant_keys(tenant, self._prefix)
        return keys

    # -- lifecycle ------------------------------------------------------------------------

    async def start(self) -> None:
        if self._on_mode is not None:
            self._on_mode(self.mode)
        self._loop_task = asyncio.create_task(self._background(), name="quota-redis")

    async def stop(self) -> None:
        if self._loop_task is not None:
            self._loop_task.cancel()
        if self.circuit.shared:  # leave the count of live processes at once
            await self._call(self._client.zrem(processes_key(self._prefix), self.process))
        await self.flush(wait_s=max(0.2, 4 * self.call_timeout_s))
        with contextlib.suppress(RedisError, OSError, TimeoutError):
            await asyncio.wait_for(self._client.aclose(), 1.0)

    # -- the request path -----------------------------------------------------------------

    async def acquire(self, tenant: str, tokens: int) -> QuotaTicket:
        """Charge one request of `tokens` to the tenant's quota in Redis. While quotas
        are local this returns at once (the core charges the local quotas)."""
        t = self._limits.get(tenant)
        if t is None or not self.circuit.shared:
            return QuotaTicket(None, tenant, tokens, ok=True, shared=False)
        self._open[tenant] = self._open.get(tenant, 0) + 1  # before: heartbeats see it
        self._busy[tenant] = self._busy.get(tenant, 0) + 1
        call = asyncio.ensure_future(
            self._call(
                self._acquire(
                    keys=self._tenant_keys(tenant),
                    args=(
                        t.requests_per_minute,
                        t.tokens_per_minute,
                        t.max_concurrency,
                        tokens,
                        self.process,
                        self.stale_after_s,
                        CONCURRENCY_RETRY_S,
                        DEMAND_TAU_S,
                    ),
                )
            )
        )
        try:
            # shield: a client that hangs up mid-call must not leave a charge behind
            result = await asyncio.shield(call)
        except asyncio.CancelledError:
            call.add_done_callback(lambda f: self._abandoned(f, tenant, tokens))
            raise
        finally:
            self._busy[tenant] -= 1
        if result is None:  # Redis failed: fail open (local quotas once the circuit opens)
            self._open[tenant] -= 1
            return QuotaTicket(None, tenant, tokens, ok=True, shared=False)
        self._observe(tenant, result[2:])
        if int(result[0]) == 1:
            self._charged[tenant] = self._charged.get(tenant, 0) + 1
            return QuotaTicket(self, tenant, tokens, ok=True, shared=True)
        self._open[tenant] -= 1
        retry = min(RETRY_MAX_S, max(RETRY_MIN_S, float(result[1])))
        return QuotaTicket(None, tenant, tokens, ok=False, shared=True, retry_after_s=retry)

    def _abandoned(self, fut: asyncio.Future[Any], tenant: str, tokens: int) -> None:
        """The client left while its check was in flight: undo the charge, if any."""
        result = None if fut.cancelled() else fut.result()
        if result is not None and int(result[0]) == 1:
            self._charged[tenant] = self._charged.get(tenant, 0) + 1
            self.finish(tenant, 1, tokens)
        else:
            self._open[tenant] -= 1

    def _observe(self, tenant: str, sight: Any) -> None:
        """Keep what Redis showed of the tenant's quota: levels, then part of the demand
        (strings; '-1': none)."""
        values = [float(v) for v in sight[:3]]
        self.controller_quotas.observe(
            tenant,
            QuotaSight(
                None if values[0] < 0 else values[0],
                None if values[1] < 0 else values[1],
                None if values[2] < 0 else values[2],
                self._clock.now(),
            ),
        )

    def finish(self, tenant: str, requests_back: int, tokens_back: int) -> None:
        """Give back what a request charged in Redis did not use, and its slot; in the
        background, summed per tenant over FLUSH_S (one call for many requests: the
        answer is not waited for, and a slot comes back at most FLUSH_S late)."""
        self._open[tenant] -= 1
        self._charged[tenant] -= 1
        if not self.circuit.shared:
            return  # lost: the heartbeat re-states the slots once Redis is back
        owed = self._owed.get(tenant)
        if owed is None:
            owed = self._owed[tenant] = [0, 0, 0]
        owed[0] += requests_back
        owed[1] += tokens_back
        owed[2] += 1
        if self._flush_timer is None:
            self._flush_timer = asyncio.get_running_loop().call_later(FLUSH_S, self._flush)

    async def flush(self, wait_s: float | None = None) -> None:
        """Send what finished requests owe now, and wait (up to `wait_s`) for the calls
        in flight."""
        if self._flush_timer is not None:
            self._flush_timer.cancel()
            self._flush()
        if self._tasks:
            await asyncio.wait(self._tasks, timeout=wait_s)

    def _flush(self) -> None:
        self._flush_timer = None
        owed, self._owed = self._owed, {}
        for tenant, (requests_back, tokens_back, releases) in owed.items():
            t = self._limits.get(tenant)
            rpm = t.requests_per_minute if t else 0
            tpm = t.tokens_per_minute if t else 0
            rate, conc, _, _ = self._tenant_keys(tenant)
            self._busy[tenant] = self._busy.get(tenant, 0) + 1
            args = (rpm, tpm, requests_back, tokens_back, releases, self.process)
            task = asyncio.ensure_future(self._call(self._finish(keys=(rate, conc), args=args)))
            self._tasks.add(task)
            task.add_done_callback(functools.partial(self._finished, tenant=tenant))

    def _finished(self, task: asyncio.Task[Any], tenant: str) -> None:
        self._tasks.discard(task)
        self._busy[tenant] -= 1
        result = None if task.cancelled() else task.result()
        last = self.controller_quotas.sight(tenant)
        if result is not None and tenant in self._limits:
            part = b"-1" if last is None or last.part is None else str(last.part)
            self._observe(tenant, [*result[:2], part])

    async def _call(self, awaitable: Any) -> Any:
        """One Redis call with a timeout; None when it failed (the circuit learns)."""
        try:
            async with asyncio.timeout(self.call_timeout_s):
                result = await awaitable
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # any failure of Redis means: go local
            self._failed(exc)
            return None
        if self.circuit.success():
            self._mode_changed()
        return result

    def _failed(self, exc: BaseException) -> None:
        kind = _failure_kind(exc)
        if self._on_error is not None:
            self._on_error(kind)
        if self.circuit.failure(timeout=kind == "timeout"):
            self._went_local(kind, exc)
        elif self.circuit.probe_due():
            self._wake.set()

    def _went_local(self, kind: str, exc: BaseException | None) -> None:
        self.controller_quotas.take_over(self._clock.now(), self._charged)
        log.warning(
            "Redis at %s is not answering (%s: %s): tenant quotas are enforced by each of "
            "the %d gateway processes on its own, each with its share of every quota and "
            "of what was left of it, until it is back",
            self.url,
            kind,
            exc or type(exc).__name__,
            self.controller_quotas.processes,
        )
        self._mode_changed()

    def _mode_changed(self) -> None:
        if self.circuit.shared:
            log.warning("Redis at %s answers again: tenant quotas are shared again", self.url)
        if self._on_mode is not None:
            self._on_mode(self.mode)

    # -- background: probe while local, heartbeat while shared ----------------------------

    async def _background(self) -> None:
        started = next_beat = self._clock.now()
        tick = min(self.circuit.reprobe_s, self.heartbeat_s) / 4
        while True:
            now = self._clock.now()
            if self.circuit.probe_due():
                await self._probe()
            elif self.circuit.shared and now >= next_beat:
                # beat faster at first: replicas starting together learn of each other
                early = now - started < 2 * self.heartbeat_s
                next_beat = now + (self.heartbeat_s / 4 if early else self.heartbeat_s)
                await self._beat()
            self._wake.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), tick)

    async def _probe(self) -> None:
        try:
            async with asyncio.timeout(PROBE_TIMEOUT_S):
                # A restarted Redis broke every pooled connection: start afresh, so the
                # first requests after it is back do not fail one stale connection each.
                pool = getattr(self._client, "connection_pool", None)
                if pool is not None:
                    await pool.disconnect()
                await self._client.ping()
                if not self.circuit.shared:
                    await self._hand_back()
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # the probe failed, whatever the reason
            kind = _failure_kind(exc)
            if self._on_error is not None:
                self._on_error(kind)
            if self.circuit.probe_failed():
                self._went_local(kind, exc)
            return
        if self.circuit.success():
            self._mode_changed()

    async def _hand_back(self) -> None:
        """Redis answers again: charge it, before any request goes to it, what this
        process admitted on its own meanwhile (restoring first the levels last seen, for
        a Redis that lost them), so that the loss does not hand out a quota twice."""
        quotas = self.controller_quotas
        owed = quotas.hand_back(self._clock.now())
        calls = []
        for name, hb in owed.items():
            t = self._limits.get(name)
            if t is None:
                continue
            args = (
                t.requests_per_minute,
                t.tokens_per_minute,
                hb.requests_used,
                hb.tokens_used,
                hb.requests_level,
                hb.tokens_level,
            )
            calls.append(self._resume(keys=self._tenant_keys(name)[:1], args=args))
        await asyncio.gather(*calls)
        quotas.handed_back()

    async def _beat(self) -> None:
        """Say this process is alive and learn how many are; refresh the sights of the
        tenants this process has not asked Redis about lately; re-state this process's
        open requests for each capped tenant (only when no call of its own is in flight
        for that tenant, which could race with it)."""
        alive = await self._call(
            self._processes(
                keys=(processes_key(self._prefix),), args=(self.process, self.stale_after_s)
            )
        )
        if alive is None:
            return
        quotas = self.controller_quotas
        quotas.set_processes(int(alive), self._clock.now())
        # (older than a quarter beat: a sight taken just before another process's last
        # requests would miss them)
        stale = quotas.stale_sights(self._clock.now(), self.heartbeat_s / 4, SIGHTS_PER_BEAT)
        await asyncio.gather(*(self._refresh_sight(name) for name in stale))
        if not self.circuit.shared:
            return
        for name, t in list(self._limits.items()):
            if t.max_concurrency <= 0 or self._busy.get(name, 0) > 0 or name in self._owed:
                continue
            _, conc, beat, _ = self._tenant_keys(name)
            await self._call(
                self._heartbeat(keys=(conc, beat), args=(self.process, self._open.get(name, 0)))
            )
            if not self.circuit.shared:
                return

    async def _refresh_sight(self, tenant: str) -> None:
        t = self._limits.get(tenant)
        if t is None:
            return
        rate, _, _, share = self._tenant_keys(tenant)
        args = (t.requests_per_minute, t.tokens_per_minute, self.process, DEMAND_TAU_S)
        sight = await self._call(self._sight(keys=(rate, share), args=args))
        if sight is not None:
            self._observe(tenant, sight)


def _connect(url: str) -> Any:
    """A client whose calls never retry nor wait on their own: the gate bounds each call
    and decides what a failure means."""
    pool = aioredis.BlockingConnectionPool.from_url(
        url,
        max_connections=MAX_CONNECTIONS,
        timeout=None,
        socket_connect_timeout=PROBE_TIMEOUT_S,
        socket_timeout=1.0,
        retry=Retry(NoBackoff(), 0),
        driver_info=None,  # no CLIENT SETINFO on each new connection
    )
    return aioredis.Redis(connection_pool=pool)
