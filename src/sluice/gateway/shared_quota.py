"""Tenant quotas shared by every gateway process through Redis, failing open to local ones.

With `redis: {url: ...}` in the policy, the shell checks a tenant's quota in Redis before
`controller.arrive` (one atomic Lua script per check; a check still out when Redis is found
hanging, STALL_S without an answer, is made against the local share) and gives back what
the request did not use on every way out (refused by the core, dropped from its queue,
cancelled, finished with its usage). The core Controller then gets `FailoverQuotas`,
which charges nothing while Redis answers and delegates to an `InProcessQuotas` while it
does not, so that a tenant's quota is never counted twice and Redis being down is
neither a crash nor a stall: each process enforces the quotas on its own until Redis is
back (logged once on each change, exported as `sluice_quota_backend{mode}`).

The pure part (the circuit, `FailoverQuotas`, what going local and coming back hand over)
is in core/quota_failover.py; the scripts are lua/*.lua, loaded as package resources.
This module is the I/O: the calls, their timeouts, the background probe and heartbeat,
and the per-request `QuotaTicket`.

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
from collections.abc import Callable, Iterable
from importlib import resources
from typing import Any

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError

from sluice.core.clock import Clock
from sluice.core.quota import InProcessQuotas, capped_charge, settlement
from sluice.core.quota_failover import (
    REPROBE_S,
    SHARE_FLOOR,
    STALL_S,
    FailoverQuotas,
    HandBack,
    HandBackDue,
    QuotaCircuit,
    QuotaSight,
    has_quota,
)
from sluice.core.settings import TenantLimits
from sluice.core.types import Outcome

log = logging.getLogger("sluice.quota")

# Constants until the policy has keys for them (redis.keyPrefix, redis.timeout...).
KEY_PREFIX = "sluice"
CALL_TIMEOUT_S = 1.0  # every call on the request path; a slower answer counts as failing
PROBE_TIMEOUT_S = 0.5  # the background PING (while local, or after timeouts)
HEARTBEAT_S = 2.0  # each process re-states its open requests per capped tenant this often
STALE_AFTER_S = 10.0  # a process silent this long (crashed) no longer counts
CONCURRENCY_RETRY_S = 1.0  # Retry-After for maxConcurrency, which has no window
MAX_CONNECTIONS = 32  # per process; callers wait for a free one within their timeout
RETRY_MIN_S, RETRY_MAX_S = 0.1, 60.0  # Retry-After clamp, as the core's
FLUSH_S = 0.02  # what finished requests give back goes to Redis in one call per tenant
DEMAND_TAU_S = 30.0  # "recent" demand: each process's decays with this time constant
SIGHTS_PER_BEAT = 32  # tenants whose last sight is older than a heartbeat, refreshed per beat
# Redis remembers each process's hand-back of a loss this long (a resent one is then not
# charged again): longer than any request admitted during the loss may still run
HAND_BACK_TTL_S = 3600

__all__ = [
    "SHARE_FLOOR",
    "STALL_S",
    "FailoverQuotas",
    "HandBack",
    "HandBackDue",
    "QuotaCircuit",
    "QuotaSight",
    "QuotaTicket",
    "SharedQuotaGate",
    "tenant_keys",
]


def _script(*names: str) -> str:
    """A Lua script from this package's lua/ folder, its parts joined in order."""
    folder = resources.files("sluice.gateway").joinpath("lua")
    return "\n".join(folder.joinpath(n).read_text(encoding="utf-8") for n in names)


# The scripts (lua/*.lua; each file says its KEYS, ARGV and answer).
ACQUIRE_LUA = _script("prelude.lua", "demand.lua", "acquire.lua")
SIGHT_LUA = _script("prelude.lua", "demand.lua", "sight.lua")
RESUME_LUA = _script("prelude.lua", "resume.lua")
FINISH_LUA = _script("prelude.lua", "finish.lua")
HEARTBEAT_LUA = _script("heartbeat.lua")
PROCESSES_LUA = _script("processes.lua")


def processes_key(prefix: str = KEY_PREFIX) -> str:
    return f"{{{prefix}}}:processes"


def tenant_keys(tenant: str, prefix: str = KEY_PREFIX) -> tuple[str, str, str, str]:
    """The tenant's keys (rate, conc, beat, share): one hash tag, so one Cluster slot."""
    tag = f"{{{prefix}:tenant:{tenant}}}"
    return f"{tag}:rate", f"{tag}:conc", f"{tag}:beat", f"{tag}:share"


def hand_back_key(tenant: str, process: str, outage: int, prefix: str = KEY_PREFIX) -> str:
    """Where Redis records one process's hand-back of one loss for the tenant (its slot)."""
    return f"{{{prefix}:tenant:{tenant}}}:handback:{process}:{outage}"


# -- the shell's side ---------------------------------------------------------------------


class QuotaTicket:
    """One client request's charge in Redis. The shell says how the request ended
    (`ran`, `finished`) and calls `close()` once on every way out; `close` settles the
    charge in the background by the rule the local quotas follow (core/quota.py,
    `settlement`): a request that never ran gives everything back; one that ran is
    charged its reported usage, or without usage its estimate if it completed or was
    cancelled, nothing if the backend refused or failed it."""

    __slots__ = (
        "_gate",
        "closed",
        "completion_tokens",
        "ok",
        "outcome",
        "prompt_tokens",
        "ran",
        "retry_after_s",
        "shared",
        "tenant",
        "tokens",
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
        self.tokens = tokens  # what was charged (at most a full bucket)
        self.ok = ok
        self.shared = shared  # charged in Redis (else the core charged the local quotas)
        self.retry_after_s = retry_after_s
        self.ran = False  # it reached a backend
        self.outcome = Outcome.CANCELLED  # until `finished` says otherwise
        self.prompt_tokens: int | None = None
        self.completion_tokens: int | None = None
        self.closed = not (ok and shared)

    def finished(
        self, outcome: Outcome, prompt_tokens: int | None, completion_tokens: int | None
    ) -> None:
        """How an attempt at a backend ended (the last one counts)."""
        self.ran = True
        self.outcome = outcome
        self.prompt_tokens = prompt_tokens
        self.completion_tokens = completion_tokens

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        assert self._gate is not None
        if not self.ran:  # refused by the core, dropped from the queue, cancelled there
            self._gate.finish(self.tenant, 1, self.tokens)
            return
        delta = settlement(self.tokens, self.outcome, self.prompt_tokens, self.completion_tokens)
        self._gate.finish(self.tenant, 0, -delta)


def _failure_kind(exc: BaseException) -> str:
    if isinstance(exc, (TimeoutError, RedisTimeoutError)):
        return "timeout"
    if isinstance(exc, (RedisConnectionError, OSError)):
        return "connection"
    return "error"


class SharedQuotaGate:
    """Checks quotas in Redis for the tenants that have one; owns the circuit, the
    background probe and heartbeat, and the `FailoverQuotas` for the Controller.

        settings = policy.core_settings()
        gate = SharedQuotaGate(url, settings.tenants, clock, on_mode=..., on_error=...)
        controller = Controller(settings, clock, quotas=gate.controller_quotas)
        await gate.start()
        ticket = await gate.acquire(tenant, controller.cost_of(info))  # if gate.limits(tenant)
        ... ticket.ok / ticket.retry_after_s; ticket.finished(outcome, p, c); ticket.close()
        await gate.stop()
    """

    def __init__(
        self,
        url: str,
        tenants: Iterable[TenantLimits],
        clock: Clock,
        *,
        on_mode: Callable[[str], None] | None = None,
        on_error: Callable[[str], None] | None = None,
        on_processes: Callable[[int], None] | None = None,
        client: Any = None,
        prefix: str = KEY_PREFIX,
        call_timeout_s: float = CALL_TIMEOUT_S,
        reprobe_s: float = REPROBE_S,
        heartbeat_s: float = HEARTBEAT_S,
        stale_after_s: float = STALE_AFTER_S,
        stall_s: float = STALL_S,
    ) -> None:
        self.url = url
        self._clock = clock
        self._on_mode = on_mode
        self._on_error = on_error
        self._on_processes = on_processes  # the live count, at every heartbeat
        self._prefix = prefix
        self.call_timeout_s = call_timeout_s
        self.heartbeat_s = heartbeat_s
        self.stale_after_s = stale_after_s
        # back from a loss, how long another process may still be local: its next probe
        # is due within reprobe_s, seen within a turn of its loop, done within its timeout
        self.hold_after_return_s = reprobe_s + min(reprobe_s, heartbeat_s) / 4 + PROBE_TIMEOUT_S
        self.process = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self.circuit = QuotaCircuit(clock, reprobe_s=reprobe_s, stall_s=stall_s)
        self._limits: dict[str, TenantLimits] = {}
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
        # requests waiting for their check's answer (going local answers them at once)
        self._waiters: set[asyncio.Future[Any]] = set()
        self._stall_timer: asyncio.TimerHandle | None = None
        self._tasks: set[asyncio.Task[Any]] = set()
        self._owed: dict[str, list[int]] = {}  # per tenant: requests, tokens, slots back
        self._flush_timer: asyncio.TimerHandle | None = None
        self._loop_task: asyncio.Task[None] | None = None
        self._probing: asyncio.Future[None] | None = None  # a probe and its hand-back
        self._beating: asyncio.Future[None] | None = None  # a heartbeat
        self.exit_by: float | None = None  # draining: try to hand back until then
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

    def set_limits(self, tenants: Iterable[TenantLimits]) -> None:
        self._limits = {t.name: t for t in tenants if has_quota(t)}

    def limits(self, tenant: str) -> TenantLimits | None:
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

    def draining(self, until: float) -> None:
        """The process drains (SIGTERM): if it leaves while quotas are local, it may try
        to hand back what it admitted on its own until `until` (its shutdown grace)."""
        self.exit_by = until

    async def stop(self) -> None:
        if self._loop_task is not None:
            self._loop_task.cancel()
        if self._beating is not None:
            self._beating.cancel()
        if self._stall_timer is not None:
            self._stall_timer.cancel()
            self._stall_timer = None
        if self._probing is not None and not self._probing.done():
            # a hand-back cut short would be charged again below (bounded by its timeout)
            await asyncio.wait({self._probing}, timeout=2 * PROBE_TIMEOUT_S)
        await self._hand_back_before_exit()
        if self.circuit.shared:  # leave the count of live processes at once
            await self._call(self._client.zrem(processes_key(self._prefix), self.process))
        await self.flush(wait_s=max(0.2, 4 * self.call_timeout_s))
        with contextlib.suppress(RedisError, OSError, TimeoutError):
            await asyncio.wait_for(self._client.aclose(), 1.0)

    async def _hand_back_before_exit(self) -> None:
        """Leaving while quotas are local: what this process admitted on its own would
        leave with it, counted nowhere. Probe (and hand back) as the background loop
        does, until `exit_by` (one try without it); say what is lost if Redis never
        answers (a SIGKILLed process loses it all the same)."""
        quotas = self.controller_quotas
        deadline = self._clock.now() if self.exit_by is None else self.exit_by
        while not self.circuit.shared and quotas.owes():
            await self._probe()
            wait = min(self.circuit.reprobe_s, deadline - self._clock.now())
            if self.circuit.shared or wait <= 0:
                break
            await asyncio.sleep(wait)
        if self.circuit.shared and quotas.owes():
            await self._send_owed()  # what the losses' requests used after their hand-back
        if not self.circuit.shared and quotas.owes():
            dues = quotas.due(self._clock.now())
            owed = [hb for due in dues for hb in due.owed.values()]
            log.warning(
                "leaving while Redis at %s is lost: what this process admitted meanwhile "
                "(%.0f tokens and %.0f requests of %d tenants) is not handed back",
                self.url,
                sum(max(0.0, hb.tokens_charge) for hb in owed),
                sum(max(0.0, hb.requests_charge) for hb in owed),
                len({name for due in dues for name in due.owed}),
            )

    # -- the request path -----------------------------------------------------------------

    async def acquire(self, tenant: str, tokens: int) -> QuotaTicket:
        """Charge one request of `tokens` to the tenant's quota in Redis. While quotas
        are local this returns at once (the core charges the local quotas), and so does a
        request whose check fails or is still out when they go local: it is checked
        against this process's share, never let through unchecked."""
        t = self._limits.get(tenant)
        if t is None or not self.circuit.shared:
            return QuotaTicket(None, tenant, tokens, ok=True, shared=False)
        if self.circuit.stalled():  # the calls out went unanswered (the timer is late)
            self._went_local("stall", None)
            return QuotaTicket(None, tenant, tokens, ok=True, shared=False)
        tokens = capped_charge(tokens, t.tokens_per_minute)
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
        # The request waits on its own future, not the call: a client that hangs up, or
        # the circuit going local, ends the wait and leaves the call to finish (its
        # charge, if any, is undone then).
        waiter: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._waiters.add(waiter)
        call.add_done_callback(
            functools.partial(self._checked, waiter=waiter, tenant=tenant, tokens=tokens)
        )
        try:
            result = await waiter
        finally:
            self._waiters.discard(waiter)
        if result is None:  # Redis failed, or quotas went local: the core checks locally
            return QuotaTicket(None, tenant, tokens, ok=True, shared=False)
        self._observe(tenant, result[2:])
        if int(result[0]) == 1:
            return QuotaTicket(self, tenant, tokens, ok=True, shared=True)
        retry = min(RETRY_MAX_S, max(RETRY_MIN_S, float(result[1])))
        return QuotaTicket(None, tenant, tokens, ok=False, shared=True, retry_after_s=retry)

    def _checked(
        self, call: asyncio.Future[Any], *, waiter: asyncio.Future[Any], tenant: str, tokens: int
    ) -> None:
        """A check's call is back: its answer for the request, if it still waits."""
        self._busy[tenant] -= 1
        result = None if call.cancelled() else call.result()
        charged = result is not None and int(result[0]) == 1
        if charged:
            self._charged[tenant] = self._charged.get(tenant, 0) + 1
        if not waiter.done():
            if not charged:
                self._open[tenant] -= 1
            waiter.set_result(result)
        elif not charged:
            self._open[tenant] -= 1
        elif self.circuit.shared:  # the client left: give the charge back
            self.finish(tenant, 1, tokens)
        else:  # checked locally meanwhile: the hand-back takes this charge off
            self._open[tenant] -= 1
            self._charged[tenant] -= 1
            self.controller_quotas.charged_late(tenant, tokens)

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
        epoch = self.circuit.sent()
        self._watch_stall()
        try:
            async with asyncio.timeout(self.call_timeout_s):
                result = await awaitable
        except asyncio.CancelledError:
            self.circuit.gone(epoch)
            raise
        except Exception as exc:  # any failure of Redis means: go local
            self._failed(exc, epoch)
            return None
        self.circuit.answered(epoch)
        return result

    def _watch_stall(self) -> None:
        """One timer for the calls out: when they would be stalled, look."""
        at = self.circuit.stall_at()
        if at is None or self._stall_timer is not None:
            return
        loop = asyncio.get_running_loop()
        self._stall_timer = loop.call_later(max(0.0, at - self._clock.now()), self._stall_due)

    def _stall_due(self) -> None:
        self._stall_timer = None
        # An answer read in this turn of the loop wakes its task after the timers: look
        # once those tasks have run, or a busy loop would pass for a hanging Redis.
        asyncio.get_running_loop().call_soon(self._look_for_stall)

    def _look_for_stall(self) -> None:
        if self.circuit.stalled():
            self._went_local("stall", None)
        else:
            self._watch_stall()

    def _failed(self, exc: BaseException, epoch: int) -> None:
        kind = _failure_kind(exc)
        if self._on_error is not None:
            self._on_error(kind)
        if self.circuit.failed(epoch, timeout=kind == "timeout"):
            self._went_local(kind, exc)

    def _went_local(self, kind: str, exc: BaseException | None) -> None:
        """Quotas go local: this process holds its share of each from now on; the
        requests waiting for a check are checked against it at once. A refusal confirms
        the outage; a timeout or a stall only makes Redis suspect, and the probe, due at
        once, decides."""
        self.controller_quotas.take_over(self._clock.now(), self._charged)
        for waiter in self._waiters:
            if not waiter.done():
                waiter.set_result(None)
        if self._beating is not None:
            self._beating.cancel()
        if self.circuit.confirmed:
            self._log_lost(kind, exc)
        else:
            log.info(
                "Redis at %s is slow (%s): tenant quotas are checked by this process's "
                "share while a probe decides",
                self.url,
                f"no answer within {self.circuit.stall_s:g}s" if kind == "stall" else kind,
            )
            self._wake.set()
        self._mode_changed()

    def _log_lost(self, kind: str, exc: BaseException | None) -> None:
        log.warning(
            "Redis at %s is not answering (%s: %s): tenant quotas are enforced by each "
            "gateway process on its own, each with its share of every quota and of what "
            "was left of it, until it is back",
            self.url,
            kind,
            str(exc) or type(exc).__name__,
        )

    def _mode_changed(self) -> None:
        if self._on_mode is not None:
            self._on_mode(self.mode)

    # -- background: probe while local, heartbeat while shared ----------------------------

    async def _background(self) -> None:
        started = next_beat = self._clock.now()
        tick = min(self.circuit.reprobe_s, self.heartbeat_s) / 4
        while True:
            now = self._clock.now()
            self._wake.clear()  # (a wake during this turn brings the next one at once)
            if self.circuit.probe_due():
                # shielded: stopping the loop must not cut a hand-back short (stop waits)
                self._probing = asyncio.ensure_future(self._probe())
                await asyncio.shield(self._probing)
            elif self.circuit.shared and now >= next_beat:
                # beat faster at first: replicas starting together learn of each other
                early = now - started < 2 * self.heartbeat_s
                next_beat = now + (self.heartbeat_s / 4 if early else self.heartbeat_s)
                # its own task: going local cuts it short (its calls may hang a second
                # each), so that the probe is not kept waiting
                self._beating = asyncio.ensure_future(self._beat())
                await asyncio.wait({self._beating})
            elif not self.circuit.shared:  # (never counted: follow the fleet share)
                self.controller_quotas.reshare(now)
            if self.circuit.shared and self.controller_quotas.owes():
                await self._send_owed()
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
            if self.circuit.probe_failed():  # it was only suspect: now it is lost
                self._log_lost(kind, exc)
            return
        confirmed = self.circuit.confirmed
        if self.circuit.probe_answered():
            if confirmed:
                log.warning("Redis at %s answers again: tenant quotas are shared again", self.url)
            else:
                log.info("Redis at %s answered the probe: tenant quotas are shared again", self.url)
            self._mode_changed()

    async def _hand_back(self) -> None:
        """Redis answers again: charge it, before any request goes to it, what this
        process admitted on its own meanwhile (restoring first the levels last seen, for
        a Redis that lost them), so that the loss does not hand out a quota twice; then
        hold this process's share as a second check while the other processes may still
        be local (FailoverQuotas.handed_back). Each hand-back is the loss's whole charge,
        numbered: one resent after its answer was lost is not charged again."""
        quotas = self.controller_quotas
        dues = quotas.due(self._clock.now())
        await asyncio.gather(*(call for due in dues for call in self._resumes(due)))
        for due in dues:
            quotas.acked(due)
        quotas.handed_back(self._clock.now(), self.hold_after_return_s)

    def _resumes(self, due: HandBackDue) -> list[Any]:
        """The calls (resume.lua) of one hand-back, one per tenant."""
        calls = []
        for name, hb in due.owed.items():
            t = self._limits.get(name)
            if t is None:  # its quota removed since: nothing to charge it against
                continue
            keys = (self._tenant_keys(name)[0], hand_back_key(name, self.process, due.outage))
            args = (
                t.requests_per_minute,
                t.tokens_per_minute,
                hb.requests_charge,
                hb.tokens_charge,
                hb.requests_level,
                hb.tokens_level,
                due.seq,
                HAND_BACK_TTL_S,
            )
            calls.append(self._resume(keys=keys, args=args))
        return calls

    async def _send_owed(self) -> None:
        """Back from a loss, its requests that ran on ended: hand the loss back again, so
        that Redis is charged what they used (less what they were charged), once. A call
        that fails goes local as any other; the next probe sends it again."""
        quotas = self.controller_quotas
        for due in quotas.due(self._clock.now()):
            answers = await asyncio.gather(*(self._call(c) for c in self._resumes(due)))
            if all(answer is not None for answer in answers):
                quotas.acked(due)
            if not self.circuit.shared:
                return

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
        if self._on_processes is not None:
            self._on_processes(int(alive))
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
