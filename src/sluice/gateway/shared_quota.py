"""Tenant quotas shared by every gateway process through Redis, failing open to local ones.

With `redis: {url: ...}` in the policy, the shell checks a tenant's quota in Redis before
`controller.arrive` (one atomic Lua script per check, 50 ms at most) and gives back what
the request did not use on every way out (refused by the core, dropped from its queue,
cancelled, finished with its usage). The core Controller then gets `FailoverQuotas`,
which charges nothing while Redis answers and delegates to an `InProcessQuotas` while it
does not, so that a tenant's quota is never counted twice and Redis being down is
neither a crash nor a stall: each process enforces the quotas on its own until Redis is
back (logged once on each change, exported as `sluice_quota_backend{mode}`).

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
import logging
import os
import socket
import uuid
from collections.abc import Callable, Iterable
from typing import Any

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError

from sluice.config import Tenant
from sluice.core.clock import Clock
from sluice.core.quota import InProcessQuotas, QuotaDecision

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
  if ttl > 0 then redis.call('PEXPIRE', KEYS[1], math.ceil(ttl * 1000) + 1000) end
end
"""

# KEYS: rate, conc, beat. ARGV: rpm, tpm, maxConcurrency, tokens, process, stale_s,
# concurrency_retry_s. Returns {1} or {0, retry_after_s as a string}.
ACQUIRE_LUA = (
    _PRELUDE
    + """
local maxc = tonumber(ARGV[3])
local tokens = tonumber(ARGV[4])
local me = ARGV[5]
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
  if open >= maxc then return {0, ARGV[7]} end
end
local wait = 0
if rpm > 0 and rl < 1 then wait = (1 - rl) * 60 / rpm end
if tpm > 0 then
  local need = math.min(tokens, tpm) - tl
  if need > 0 then wait = math.max(wait, need * 60 / tpm) end
end
if wait > 0 then return {0, string.format('%.6f', wait)} end
rl = rl - 1
tl = tl - tokens
store()
if maxc > 0 then
  redis.call('HINCRBY', KEYS[2], me, 1)
  redis.call('HSET', KEYS[3], me, string.format('%.17g', now))
  redis.call('EXPIRE', KEYS[2], 3600)
  redis.call('EXPIRE', KEYS[3], 3600)
end
return {1}
"""
)

# KEYS: rate, conc. ARGV: rpm, tpm, requests back, tokens back (negative: charge more),
# slots released, process. A refund is (1, tokens, 1); a settle + release (0, charged -
# used, 1); a release alone (0, 0, 1); the gate sends the sum of a few at once.
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
return 1
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


def tenant_keys(tenant: str, prefix: str = KEY_PREFIX) -> tuple[str, str, str]:
    """The tenant's keys (rate, conc, beat): one hash tag, so one Cluster slot."""
    tag = f"{{{prefix}:tenant:{tenant}}}"
    return f"{tag}:rate", f"{tag}:conc", f"{tag}:beat"


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


def share_of(t: Tenant, processes: int) -> Tenant:
    """One process's share of a tenant's limits when `processes` enforce them apart
    (rounded up: a tenant is never cut to nothing)."""
    if processes <= 1 or not has_quota(t):
        return t

    def part(limit: int) -> int:
        return -(-limit // processes) if limit > 0 else 0

    return t.model_copy(
        update={
            "tokens_per_minute": part(t.tokens_per_minute),
            "requests_per_minute": part(t.requests_per_minute),
            "max_concurrency": part(t.max_concurrency),
        }
    )


class FailoverQuotas:
    """`TenantQuotas` for the Controller when Redis holds the quotas: charges nothing
    while quotas are shared (the shell has charged Redis), and delegates to `local`
    while they are local. Local limits are this process's share (`share_of`) of the
    gateway processes last seen alive in Redis, so that losing Redis does not multiply
    a tenant's quota by the number of replicas. Refunds, settles and releases go to
    `local` only for tenants with requests that `local` charged, so a request admitted
    through Redis never gives back to the local buckets. (A request whose Redis check
    succeeded in the instant the circuit went local is charged locally too: a one-off,
    on the safe side.)"""

    def __init__(
        self,
        local: InProcessQuotas,
        circuit: QuotaCircuit,
        on_limits: Callable[[Iterable[Tenant]], None] | None = None,
    ) -> None:
        self.local = local
        self._circuit = circuit
        self._on_limits = on_limits
        self._local_open: dict[str, int] = {}
        self._tenants: tuple[Tenant, ...] = ()
        self.processes = 1

    def set_limits(self, tenants: Iterable[Tenant], now: float = 0.0) -> None:
        self._tenants = tuple(tenants)
        self.local.set_limits([share_of(t, self.processes) for t in self._tenants], now)
        if self._on_limits is not None:
            self._on_limits(self._tenants)

    def set_processes(self, processes: int, now: float) -> None:
        """How many gateway processes would enforce the quotas apart."""
        processes = max(1, processes)
        if processes != self.processes:
            self.processes = processes
            self.local.set_limits([share_of(t, processes) for t in self._tenants], now)

    def acquire(self, tenant: str, tokens: int, now: float) -> QuotaDecision:
        if self._circuit.shared:
            return OK
        decision = self.local.acquire(tenant, tokens, now)
        if decision.ok:
            self._local_open[tenant] = self._local_open.get(tenant, 0) + 1
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

    def settle(self, tenant: str, delta_tokens: int, now: float) -> None:
        if self._local_open.get(tenant, 0) > 0:
            self.local.settle(tenant, delta_tokens, now)

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
        self._keys: dict[str, tuple[str, str, str]] = {}
        self._open: dict[str, int] = {}  # requests charged in Redis and not yet finished
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

    @property
    def mode(self) -> str:
        return "redis" if self.circuit.shared else "local"

    def set_limits(self, tenants: Iterable[Tenant]) -> None:
        self._limits = {t.name: t for t in tenants if has_quota(t)}

    def limits(self, tenant: str) -> Tenant | None:
        """The tenant's limits if it has a quota (else no check is needed)."""
        return self._limits.get(tenant)

    def _tenant_keys(self, tenant: str) -> tuple[str, str, str]:
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
        rate, conc, beat = self._tenant_keys(tenant)
        self._open[tenant] = self._open.get(tenant, 0) + 1  # before: heartbeats see it
        self._busy[tenant] = self._busy.get(tenant, 0) + 1
        call = asyncio.ensure_future(
            self._call(
                self._acquire(
                    keys=(rate, conc, beat),
                    args=(
                        t.requests_per_minute,
                        t.tokens_per_minute,
                        t.max_concurrency,
                        tokens,
                        self.process,
                        self.stale_after_s,
                        CONCURRENCY_RETRY_S,
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
        if int(result[0]) == 1:
            return QuotaTicket(self, tenant, tokens, ok=True, shared=True)
        self._open[tenant] -= 1
        retry = min(RETRY_MAX_S, max(RETRY_MIN_S, float(result[1])))
        return QuotaTicket(None, tenant, tokens, ok=False, shared=True, retry_after_s=retry)

    def _abandoned(self, fut: asyncio.Future[Any], tenant: str, tokens: int) -> None:
        """The client left while its check was in flight: undo the charge, if any."""
        result = None if fut.cancelled() else fut.result()
        if result is not None and int(result[0]) == 1:
            self.finish(tenant, 1, tokens)
        else:
            self._open[tenant] -= 1

    def finish(self, tenant: str, requests_back: int, tokens_back: int) -> None:
        """Give back what a request charged in Redis did not use, and its slot; in the
        background, summed per tenant over FLUSH_S (one call for many requests: the
        answer is not waited for, and a slot comes back at most FLUSH_S late)."""
        self._open[tenant] -= 1
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
            rate, conc, _ = self._tenant_keys(tenant)
            self._busy[tenant] = self._busy.get(tenant, 0) + 1
            args = (rpm, tpm, requests_back, tokens_back, releases, self.process)
            task = asyncio.ensure_future(self._call(self._finish(keys=(rate, conc), args=args)))
            self._tasks.add(task)
            task.add_done_callback(lambda f, name=tenant: self._finished(f, name))

    def _finished(self, task: asyncio.Task[Any], tenant: str) -> None:
        self._tasks.discard(task)
        self._busy[tenant] -= 1

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
        log.warning(
            "Redis at %s is not answering (%s: %s): tenant quotas are enforced by each "
            "gateway process on its own, each with 1/%d of every quota, until it is back",
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
        next_beat = 0.0
        tick = min(self.circuit.reprobe_s, self.heartbeat_s) / 4
        while True:
            if self.circuit.probe_due():
                await self._probe()
            elif self.circuit.shared and self._clock.now() >= next_beat:
                next_beat = self._clock.now() + self.heartbeat_s
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

    async def _beat(self) -> None:
        """Say this process is alive and learn how many are; re-state this process's
        open requests for each capped tenant (only when no call of its own is in flight
        for that tenant, which could race with it)."""
        alive = await self._call(
            self._processes(
                keys=(processes_key(self._prefix),), args=(self.process, self.stale_after_s)
            )
        )
        if alive is None:
            return
        self.controller_quotas.set_processes(int(alive), self._clock.now())
        for name, t in list(self._limits.items()):
            if t.max_concurrency <= 0 or self._busy.get(name, 0) > 0 or name in self._owed:
                continue
            _, conc, beat = self._tenant_keys(name)
            await self._call(
                self._heartbeat(keys=(conc, beat), args=(self.process, self._open.get(name, 0)))
            )
            if not self.circuit.shared:
                return


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
