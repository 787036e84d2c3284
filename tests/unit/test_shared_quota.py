"""Shared quotas without Redis: the circuit (shared or local), the core's failover quotas
and the gate's bookkeeping, with a fake clock and a fake Redis client. The Lua scripts
themselves run against a real redis-server in tests/integration/test_redis_quota.py."""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Callable
from typing import Any

import pytest
from redis.crc import key_slot
from redis.exceptions import ConnectionError as RedisConnectionError

from sluice.config import parse_policy
from sluice.core.clock import FakeClock, MonotonicClock
from sluice.core.quota import InProcessQuotas
from sluice.core.settings import TenantLimits
from sluice.core.types import Outcome
from sluice.gateway.app import Gateway
from sluice.gateway.shared_quota import (
    ACQUIRE_LUA,
    CALL_TIMEOUT_S,
    FINISH_LUA,
    FLUSH_S,
    HEARTBEAT_LUA,
    PROBE_TIMEOUT_S,
    PROCESSES_LUA,
    RESUME_LUA,
    SIGHT_LUA,
    STALL_S,
    FailoverQuotas,
    HandBack,
    HandBackDue,
    QuotaCircuit,
    QuotaSight,
    SharedQuotaGate,
    tenant_keys,
)

CAPPED = TenantLimits(
    name="capped", tokens_per_minute=1200, requests_per_minute=60, max_concurrency=2
)
FREE = TenantLimits(name="free")


NO_SIGHT = [b"-1", b"-1", b"-1"]  # levels and part of the demand: none known


def default_answer(name: str, args: tuple[Any, ...]) -> Any:
    answers = {"acquire": [1, b"0", *NO_SIGHT], "sight": NO_SIGHT, "finish": NO_SIGHT[:2]}
    return answers.get(name, 1)


class FakeRedis:
    """Records script calls; `answer` decides what each returns (or raises)."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, tuple[Any, ...], tuple[Any, ...]]] = []
        self.answer: Callable[[str, tuple[Any, ...]], Any] = default_answer
        self.pings = 0
        self.ping_fails = False
        self.ping_hangs = False

    def register_script(self, text: str) -> Callable[..., Any]:
        name = {
            ACQUIRE_LUA: "acquire",
            FINISH_LUA: "finish",
            HEARTBEAT_LUA: "heartbeat",
            PROCESSES_LUA: "processes",
            SIGHT_LUA: "sight",
            RESUME_LUA: "resume",
        }[text]

        async def call(keys: tuple[Any, ...] = (), args: tuple[Any, ...] = ()) -> Any:
            self.calls.append((name, tuple(keys), tuple(args)))
            result = self.answer(name, tuple(args))
            if isinstance(result, BaseException):
                raise result
            if inspect.isawaitable(result):
                return await result
            return result

        return call

    async def ping(self) -> bool:
        self.pings += 1
        if self.ping_hangs:
            await asyncio.Event().wait()
        if self.ping_fails:
            raise RedisConnectionError("refused")
        return True

    async def aclose(self) -> None:
        return None

    async def zrem(self, key: str, member: str) -> int:
        self.calls.append(("zrem", (key,), (member,)))
        return 1

    def named(self, name: str) -> list[tuple[Any, ...]]:
        return [args for n, _, args in self.calls if n == name]


async def settle() -> None:
    """Let background calls and their callbacks run (the fake answers at once)."""
    for _ in range(5):
        await asyncio.sleep(0)


def make_gate(
    clock: FakeClock | MonotonicClock, redis: FakeRedis
) -> tuple[SharedQuotaGate, list[str], list[str]]:
    modes: list[str] = []
    errors: list[str] = []
    gate = SharedQuotaGate(
        "redis://fake",
        [CAPPED, FREE],
        clock,
        client=redis,
        on_mode=modes.append,
        on_error=errors.append,
    )
    return gate, modes, errors


# -- keys ---------------------------------------------------------------------------------


def test_a_tenants_keys_share_one_cluster_slot() -> None:
    for name in ("chat-app", "a}b", "ü"):
        keys = tenant_keys(name)
        assert keys[0] == "{sluice:tenant:" + name + "}:rate"
        assert len(keys) == 4
        assert len({key_slot(k.encode()) for k in keys}) == 1
    assert key_slot(tenant_keys("a")[0].encode()) != key_slot(tenant_keys("b")[0].encode())


# -- the circuit ----------------------------------------------------------------------------


def test_a_refused_connection_goes_local_at_once_and_is_probed_every_second() -> None:
    clock = FakeClock()
    c = QuotaCircuit(clock, reprobe_s=1.0)
    assert c.shared and not c.probe_due()
    assert c.failure(timeout=False) is True
    assert not c.shared
    assert c.failure(timeout=False) is False  # already local: logged once
    clock.advance(0.999)
    assert not c.probe_due()
    clock.advance(0.001)
    assert c.probe_due()
    assert c.probe_failed() is False  # that probe failed: already local
    assert not c.probe_due()
    clock.advance(1.0)
    assert c.probe_due()
    assert c.success() is True
    assert c.shared and not c.probe_due()
    assert c.success() is False


def test_a_timeout_goes_local_at_once_and_a_probe_decides() -> None:
    """Before, timeouts alone never went local: three in a row called for a probe, and
    only a failed one went local; every request meanwhile waited for its own timeout."""
    clock = FakeClock()
    c = QuotaCircuit(clock, reprobe_s=1.0)
    first, second = c.sent(), c.sent()
    assert c.failed(first, timeout=True) is True
    assert not c.shared and not c.confirmed  # only suspect: requests are checked locally
    assert c.probe_due()  # at once
    assert c.failed(second, timeout=True) is False  # sent before the change: once only
    assert c.probe_failed() is True  # the probe got no answer either: an outage, logged
    assert not c.probe_due() and c.probe_failed() is False
    clock.advance(1.0)
    assert c.probe_due()
    # a starved event loop, not Redis: the probe answers and quotas are shared again
    starved = QuotaCircuit(clock)
    assert starved.failed(starved.sent(), timeout=True) is True
    assert starved.probe_due() and starved.probe_answered() is True
    assert starved.shared and not starved.probe_due()


def test_calls_out_with_none_answered_for_the_stall_time_go_local() -> None:
    clock = FakeClock()
    c = QuotaCircuit(clock, stall_s=0.25)
    assert c.stall_at() is None
    a = c.sent()
    assert c.stall_at() == 0.25
    clock.advance(0.125)
    b = c.sent()  # the stall counts from the last answer, not from each call
    assert c.stall_at() == 0.25
    clock.advance(0.125)
    c.answered(a)
    assert c.stall_at() == 0.5
    clock.advance(0.125)
    assert c.stalled() is False and c.shared
    clock.advance(0.125)
    assert c.stalled() is True  # b is out, nothing answered for 0.25 s
    assert not c.shared and not c.confirmed and c.probe_due()
    assert c.stall_at() is None and c.stalled() is False
    c.answered(b)  # an answer to a call sent before the loss does not end it
    assert not c.shared


def test_answers_and_failures_from_before_a_change_do_not_count() -> None:
    c = QuotaCircuit(FakeClock())
    before_loss = c.sent()
    assert c.failure(timeout=False) is True  # refused
    c.answered(before_loss)  # answered late: only the hand-back may end the loss
    assert not c.shared
    while_local = c.sent()  # a give-back flushed as the loss began
    assert c.probe_answered() is True
    assert c.failed(while_local, timeout=True) is False  # it timed out after the return
    assert c.shared


# -- the core's failover quotas -------------------------------------------------------------


def test_failover_quotas_charge_nothing_while_shared_and_locally_while_not() -> None:
    circuit = QuotaCircuit(FakeClock())
    local = InProcessQuotas([TenantLimits(name="t", requests_per_minute=2)])
    q = FailoverQuotas(local, circuit)
    for _ in range(5):
        assert q.acquire("t", 10, 0.0).ok  # shared: Redis decided, the core adds nothing
    circuit.failure(timeout=False)
    assert q.acquire("t", 10, 0.0).ok  # both requests of the minute are still there
    assert q.acquire("t", 10, 0.0).ok
    refused = q.acquire("t", 10, 0.0)
    assert not refused.ok and refused.retry_after_s == 30.0  # 1 request at 2/min
    circuit.success()  # Redis is back; the two local requests still give back locally
    q.refund("t", 10, 0.0)
    q.release("t", 0.0)
    q.release("t", 0.0)  # a request admitted through Redis: nothing local to give back
    q.refund("t", 10, 0.0)
    circuit.failure(timeout=False)
    assert q.acquire("t", 10, 0.0).ok  # the first refund came back (1 of 2 used)
    assert not q.acquire("t", 10, 0.0).ok


def test_failover_quotas_hold_local_slots_for_local_requests_only() -> None:
    circuit = QuotaCircuit(FakeClock())
    local = InProcessQuotas([TenantLimits(name="c", max_concurrency=2)])
    q = FailoverQuotas(local, circuit)
    for _ in range(5):
        assert q.acquire("c", 10, 0.0).ok  # shared: no local slot
    circuit.failure(timeout=False)
    assert q.acquire("c", 10, 0.0).ok and q.acquire("c", 10, 0.0).ok
    assert q.acquire("c", 10, 0.0).retry_after_s == 1.0  # both local slots held
    circuit.success()  # Redis is back; the two local requests still give back locally
    q.refund("c", 10, 0.0)
    q.release("c", 0.0)
    q.release("c", 0.0)  # a request admitted through Redis: no local slot to give back
    circuit.failure(timeout=False)
    assert q.acquire("c", 10, 0.0).ok and q.acquire("c", 10, 0.0).ok  # both free again
    assert q.acquire("c", 10, 0.0).retry_after_s == 1.0  # and no third


def test_without_a_sight_local_quotas_are_an_even_share_of_the_live_processes() -> None:
    circuit = QuotaCircuit(FakeClock())
    local = InProcessQuotas()
    q = FailoverQuotas(local, circuit)
    q.set_limits(
        [
            TenantLimits(name="t", requests_per_minute=5, max_concurrency=3),
            TenantLimits(name="r", requests_per_minute=5),
            FREE,
        ]
    )
    q.set_processes(2, 0.0)  # two gateway processes were alive in Redis
    circuit.failure(timeout=False)
    q.take_over(0.0, {})
    answers = [q.acquire("t", 1, 0.0) for _ in range(5)]
    assert sum(a.ok for a in answers) == 2
    assert answers[2].retry_after_s == 1.0  # ceil(3 / 2) slots: maxConcurrency binds
    # half of 5 requests a minute, full: 2 go, the third waits for half a request
    assert q.acquire("r", 1, 0.0).ok and q.acquire("r", 1, 0.0).ok
    assert q.acquire("r", 1, 0.0).retry_after_s == pytest.approx(12.0)  # 0.5 at 2.5/min
    q.set_processes(1, 0.0)  # the other one is gone: the whole quota at the next loss
    q.take_over(60.0, {})
    assert q.acquire("t", 1, 60.0).ok
    assert not q.acquire("t", 1, 60.0).ok  # 3 slots in use


METERED = TenantLimits(name="m", tokens_per_minute=1200)  # 20 tokens/s


def _lost(part: float, tokens_level: float, *, processes: int = 2) -> FailoverQuotas:
    """A process that saw the tenant at 0 s (its part of the demand, the level), then
    lost Redis at 3 s."""
    circuit = QuotaCircuit(FakeClock())
    q = FailoverQuotas(InProcessQuotas(), circuit, floor=0.1)
    q.set_limits([METERED])
    q.set_processes(processes, 0.0)
    q.observe("m", QuotaSight(None, tokens_level, part, 0.0))
    circuit.failure(timeout=False)
    q.take_over(3.0, {})
    return q


def _drain(q: FailoverQuotas, now: float) -> int:
    """Tokens admitted one at a time until refused."""
    n = 0
    while q.acquire("m", 1, now).ok:
        n += 1
    return n


def test_going_local_keeps_this_processs_part_of_what_was_left() -> None:
    q = _lost(0.25, 600.0)
    # 600 + 3 s x 20 = 660 left; the part: 0.9 x 0.25 + 0.1 / 2 = 0.275 -> 181.5 tokens,
    # refilled at 5.5/s up to 330
    assert _drain(q, 3.0) == 181
    refused = q.acquire("m", 1, 3.0)
    assert refused.retry_after_s == pytest.approx(0.5 / 5.5)  # 0.5 was left
    assert _drain(q, 3.0 + 600.0) == 330


def test_processes_going_local_together_hold_the_quota_once_however_long() -> None:
    parts = (0.7, 0.2, 0.1)  # of the demand, as Redis showed each of three processes
    apart = [_lost(p, 300.0, processes=3) for p in parts]
    # what was left (300 + 3 s x 20), once, not once per process
    assert sum(_drain(q, 3.0) for q in apart) == pytest.approx(360, abs=3)
    # then the quota's rate, and after any number of minutes one quota, not one each
    assert sum(_drain(q, 33.0) for q in apart) == pytest.approx(600, abs=3)
    assert sum(_drain(q, 33.0 + 600.0) for q in apart) == pytest.approx(1200, abs=3)


def test_a_process_that_never_saw_the_count_holds_its_estimated_part_of_the_fleet() -> None:
    """Started while Redis was lost (no count, no sight): before, it held every quota
    whole (`sluice bench fleet-quotas-hang`: 4 replacements, shares summing to
    5.0, batch-etl admitted 512,143 tokens a minute against 100,000)."""
    circuit = QuotaCircuit(FakeClock())
    fleet = [0.25]  # what its scrapes estimate (Controller.fleet_share)
    q = FailoverQuotas(InProcessQuotas(), circuit, fleet_share=lambda: fleet[0])
    q.set_limits([METERED])
    circuit.failure(timeout=False)
    q.take_over(0.0, {})
    assert _drain(q, 0.0) == 300  # a quarter of 1,200 tokens, full: not all of them
    assert q.shares["m"].fraction == 0.25
    fleet[0] = 0.26
    q.reshare(0.0)  # within 5 %: kept
    assert q.shares["m"].fraction == 0.25
    fleet[0] = 0.5  # its scrapes now show half the fleet's requests are its own
    q.reshare(0.0)
    assert q.shares["m"].fraction == 0.5
    assert _drain(q, 0.0) == 0  # the level kept (used up), the capacity and rate doubled
    # what it used, not what the larger share would hold on top (its unused twin grew too)
    assert q.hand_back(0.0)["m"].tokens_charge == 300.0
    assert _drain(q, 30.0) == 300  # 30 s at 10 tokens/s
    assert q.hand_back(30.0)["m"].tokens_charge == 600.0  # none refilled past its capacity
    q.set_processes(4, 30.0)  # once counted (Redis back), a count is better evidence
    fleet[0] = 1.0
    q.reshare(30.0)
    assert q.shares["m"].fraction == 0.5  # (the next take-over takes 1/4)


def test_with_no_count_nor_estimate_a_process_holds_the_fleet_prior() -> None:
    circuit = QuotaCircuit(FakeClock())
    q = FailoverQuotas(InProcessQuotas(), circuit)
    q.set_limits([METERED])
    circuit.failure(timeout=False)
    q.take_over(0.0, {})
    assert _drain(q, 0.0) == 75  # 1/16 of 1,200 (core/fleet_share.py PRIOR)


async def test_the_gateway_gives_its_quotas_the_controllers_fleet_share() -> None:
    policy = parse_policy(
        "tenants: [{name: m, apiKeys: [sk-m], priority: 1, tokensPerMinute: 1200}]\n"
        "admin: {apiKeys: [sk-admin]}\n"
        "redis: {url: 'redis://127.0.0.1:1/0'}\n"
    )
    gateway = Gateway(policy)
    assert gateway.quota_gate is not None
    gateway.controller.expect_peers(4)  # `--workers 4`, say
    assert gateway.quota_gate.controller_quotas.fleet_share is not None
    assert gateway.quota_gate.controller_quotas.fleet_share() == 0.25


def test_hand_back_says_what_was_used_locally_and_the_levels_last_seen() -> None:
    q = _lost(0.5, 600.0)
    assert q.hand_back(3.0)["m"] == HandBack(0.0, 0.0, -1.0, 660.0)  # below full: restore
    assert q.acquire("m", 100, 3.0).ok
    assert q.acquire("m", 100, 3.0).ok
    q.refund("m", 100, 4.0)  # one never ran
    q.settle("m", -40, 5.0)  # the other used 60
    # (a tenant without a request quota is charged no requests)
    assert q.hand_back(6.0)["m"] == HandBack(0.0, 60.0, -1.0, 720.0)
    q.handed_back()
    q._circuit.success()  # shared again: nothing more is counted for Redis
    q.release("m", 7.0)
    assert q.hand_back(60.0) == {}  # used nothing since, and the levels are full again


def test_a_hand_back_resent_says_the_losss_whole_charge_under_a_newer_number() -> None:
    """Its answer lost, a hand-back is sent again: the same charge (the loss's whole, not
    what is left to send), numbered anew, for the same loss, so that Redis, which records
    the last one applied per process and loss, charges it once (lua/resume.lua)."""
    q = _lost(0.5, 600.0)
    assert q.acquire("m", 100, 3.0).ok
    first = q.due(4.0)
    assert first == [HandBackDue(1, 1, {"m": HandBack(0.0, 100.0, -1.0, 680.0)})]
    # no answer: still local, and a request more meanwhile
    assert q.acquire("m", 50, 4.5).ok
    again = q.due(5.0)
    assert again == [HandBackDue(1, 2, {"m": HandBack(0.0, 150.0, -1.0, 700.0)})]
    q.acked(again[0])
    q.acked(first[0])  # an older answer late: changes nothing
    q.handed_back(5.0)
    assert not q.owes() and q.due(6.0) == []


def test_what_a_losss_requests_use_after_its_hand_back_is_handed_back_once() -> None:
    """Requests admitted during a loss end after its hand-back: what they used more or
    less than charged goes to Redis with the loss's next hand-back (before: dropped, as
    Redis 'had been charged these already'); one admitted through Redis while the share
    holds is Redis's own (its ticket gives back what it did not use), not counted."""
    q = _lost(0.5, 600.0)
    ran_on = q.acquire("m", 100, 3.0)
    failed = q.acquire("m", 100, 3.0)
    assert ran_on.outage == failed.outage == 1
    [due] = q.due(4.0)
    assert due.owed["m"].tokens_charge == 200.0
    q.acked(due)
    q.handed_back(4.0, hold_s=1.75)
    q._circuit.success()
    held = q.acquire("m", 30, 4.5)
    assert held.ok and held.outage == 0
    q.settle("m", -20, 4.6, held.outage)  # Redis's: not the loss's
    q.release("m", 4.6, held.outage)
    assert not q.owes()
    # 60 s on (nothing refilled is credited past the hand-back): 1,000 tokens more used,
    # and the backend failed the other (nothing billed: its 100 back)
    q.settle("m", 1000, 64.0, ran_on.outage)
    q.release("m", 64.0, ran_on.outage)
    q.settle("m", -100, 64.0, failed.outage)
    q.release("m", 64.0, failed.outage)
    assert q.owes()
    [late] = q.due(64.5)
    assert (late.outage, late.seq) == (1, 2)
    assert late.owed["m"].tokens_charge == 1100.0  # the loss's whole: Redis adds 900
    q.acked(late)
    assert not q.owes() and q.due(65.0) == []  # once, and the loss is forgotten


def test_a_late_settle_while_redis_is_lost_again_waits_for_the_next_probe() -> None:
    """The first loss's request ends during a second loss: its hand-back is sent again
    with the second's, each numbered within its own loss."""
    q = _lost(0.5, 600.0)
    first = q.acquire("m", 100, 3.0)
    [due] = q.due(4.0)
    q.acked(due)
    q.handed_back(4.0)
    q._circuit.success()
    q._circuit.failure(timeout=False)
    q.take_over(10.0, {})
    second = q.acquire("m", 10, 10.0)
    assert second.outage == 2
    q.settle("m", 40, 11.0, first.outage)
    dues = {d.outage: d for d in q.due(12.0)}
    assert dues[1].seq == 2 and dues[1].owed["m"].tokens_charge == 140.0
    assert dues[2].seq == 1 and dues[2].owed["m"].tokens_charge == 10.0


def test_the_hand_back_charges_what_the_share_had_not_refilled() -> None:
    """One process holding the whole quota (1,200 tokens a minute, 20 a second), full
    when Redis was lost: 1,000 tokens used at once, 600 half a minute later. Before, the
    hand-back charged the 1,600 whatever the outage's length: back after 90 s, Redis
    (refilled to 1,200 meanwhile) went to -400 and refused the tenant for 20 s, though
    it never went past its quota."""
    circuit = QuotaCircuit(FakeClock())
    q = FailoverQuotas(InProcessQuotas(), circuit)
    q.set_limits([METERED, TenantLimits(name="r", requests_per_minute=60)])
    q.set_processes(1, 0.0)
    q.observe("m", QuotaSight(None, 1200.0, 1.0, 0.0))
    q.observe("r", QuotaSight(60.0, None, 1.0, 0.0))
    circuit.failure(timeout=False)
    q.take_over(0.0, {})
    assert q.acquire("m", 1000, 0.0).ok
    assert q.acquire("m", 600, 30.0).ok  # 200 + 30 s x 20 = 800 there
    assert sum(q.acquire("r", 1, 0.0).ok for _ in range(61)) == 60  # a minute's worth
    # a bucket that saw it holds 200 + 15 s x 20 = 500 of the 1,200 it would hold unused;
    # of a minute's requests, 45 refilled
    assert q.hand_back(45.0) == {
        "m": HandBack(0.0, 700.0, -1.0, 1200.0),
        "r": HandBack(15.0, 0.0, 60.0, -1.0),
    }
    assert q.hand_back(60.0) == {"m": HandBack(0.0, 400.0, -1.0, 1200.0)}
    assert q.hand_back(90.0) == {}  # all refilled: nothing to charge (before: 1,600, 60)


def test_processes_back_after_a_long_loss_charge_what_one_bucket_would_not_hold() -> None:
    """Two processes, half of the quota each, full when Redis was lost at 3 s: one uses
    its 600 tokens at once, the other 300 at 33 s. One exact bucket would hold 600 at
    3 s, 900 at 33 s, 1,200 from 48 s: back at 63 s, nothing to charge (before: 900, and
    Redis, full again, went to 300). Back at 23 s, the use less what the shares refilled
    (the first: 600 - 20 s x 10; the second's share, full, banks no refill: 400 in all
    where one bucket would be 200 down)."""

    def lost() -> list[FailoverQuotas]:
        apart = [_lost(0.5, 1200.0) for _ in range(2)]
        assert _drain(apart[0], 3.0) == 600
        return apart

    early = lost()
    assert [q.hand_back(23.0).get("m") for q in early] == [HandBack(0.0, 400.0, -1.0, 1200.0), None]
    late = lost()
    assert late[1].acquire("m", 300, 33.0).ok
    assert [q.hand_back(63.0) for q in late] == [{}, {}]


def test_with_no_sight_the_hand_back_credits_no_refill_within_a_minute() -> None:
    """A process that never heard from Redis does not know what the tenant had used: its
    share starts full (all of it here, alone by its estimate), but the hand-back credits
    no refill before the share would have filled from nothing."""
    circuit = QuotaCircuit(FakeClock())
    q = FailoverQuotas(InProcessQuotas(), circuit, fleet_share=lambda: 1.0)
    q.set_limits([METERED])
    circuit.failure(timeout=False)
    q.take_over(0.0, {})
    assert _drain(q, 0.0) == 1200
    assert q.hand_back(30.0)["m"].tokens_charge == 1200.0  # all of it: 600 refilled since
    assert _drain(q, 30.0) == 600
    assert q.hand_back(60.0)["m"].tokens_charge == 1800.0
    assert q.hand_back(90.0)["m"].tokens_charge == 1200.0  # a minute on: 600 refilled


def test_back_from_a_loss_the_share_checks_too_while_others_may_still_be_local() -> None:
    q = _lost(0.5, 600.0)  # half the quota: 330 of the 660 left at 3 s, 10 tokens/s
    assert q.acquire("m", 300, 3.0).ok
    assert q.hand_back(4.0)["m"].tokens_charge == 300
    q.handed_back(4.0, hold_s=1.75)
    q._circuit.success()  # Redis has been told: shared again
    # held: what Redis admits is checked against the share too, 30 + 10 tokens left now
    assert not q.acquire("m", 41, 4.0).ok
    assert q.acquire("m", 40, 4.0).ok
    q.settle("m", -20, 4.5)  # it used 20: the share gets them back, Redis had it charged
    assert q.hand_back(5.0).get("m", HandBack(0, 0, 0, 0)).tokens_charge == 0
    assert not q.acquire("m", 100, 5.7).ok
    assert q.acquire("m", 100, 5.75).ok  # the hold is over: Redis's answer alone


def test_requests_running_at_the_loss_hold_their_slots_until_they_end() -> None:
    circuit = QuotaCircuit(FakeClock())
    q = FailoverQuotas(InProcessQuotas(), circuit)
    q.set_limits([TenantLimits(name="c", max_concurrency=4)])
    q.set_processes(1, 0.0)
    circuit.failure(timeout=False)
    q.take_over(0.0, {"c": 3})  # three admitted through Redis, still running here
    assert q.acquire("c", 1, 0.0).ok
    assert not q.acquire("c", 1, 0.0).ok
    q.release("c", 1.0)  # one of them ends
    assert q.acquire("c", 1, 1.0).ok


def test_a_tenant_added_while_local_gets_its_share_too() -> None:
    circuit = QuotaCircuit(FakeClock())
    q = FailoverQuotas(InProcessQuotas(), circuit)
    q.set_limits([FREE])
    q.set_processes(4, 0.0)
    circuit.failure(timeout=False)
    q.take_over(0.0, {})
    q.set_limits([FREE, METERED], 1.0)  # a reload while Redis is lost
    assert _drain(q, 1.0) == 300  # a quarter of 1,200 tokens, full


def test_failover_quotas_pass_new_limits_to_the_gate() -> None:
    redis = FakeRedis()
    gate, _, _ = make_gate(FakeClock(), redis)
    assert gate.limits("capped") is CAPPED and gate.limits("free") is None
    new = TenantLimits(name="free", requests_per_minute=5)
    gate.controller_quotas.set_limits([new])  # what Controller.apply_policy calls
    assert gate.limits("free") is new and gate.limits("capped") is None


# -- the gate -------------------------------------------------------------------------------


async def test_acquire_charges_redis_and_close_gives_back_what_was_not_used() -> None:
    redis = FakeRedis()
    gate, _, _ = make_gate(FakeClock(), redis)
    refunded = await gate.acquire("capped", 300)  # never ran: refused by the core, say
    used = await gate.acquire("capped", 300)
    cancelled = await gate.acquire("capped", 300)
    assert all(t.ok and t.shared for t in (refunded, used, cancelled))
    (args,) = {a[:4] for a in redis.named("acquire")}
    assert args == (60, 1200, 2, 300)
    refunded.close()
    used.finished(Outcome.OK, 40, 60)
    used.close()
    cancelled.finished(Outcome.CANCELLED, None, None)  # in flight, no usage: the estimate
    cancelled.close()
    cancelled.close()  # once only
    await settle()
    await asyncio.sleep(FLUSH_S)
    await settle()
    # one call for the three: 1 request and 300 + 200 tokens back, 3 slots released
    assert [a[:5] for a in redis.named("finish")] == [(60, 1200, 1, 500, 3)]
    assert gate._open["capped"] == 0


async def test_a_refusal_carries_the_windows_retry_after_clamped() -> None:
    redis = FakeRedis()
    gate, _, _ = make_gate(FakeClock(), redis)
    redis.answer = lambda name, args: [0, b"2.5", *NO_SIGHT]
    t = await gate.acquire("capped", 100)
    assert (t.ok, t.retry_after_s) == (False, 2.5)
    redis.answer = lambda name, args: [0, b"0.001", *NO_SIGHT]
    assert (await gate.acquire("capped", 100)).retry_after_s == 0.1
    redis.answer = lambda name, args: [0, b"600", *NO_SIGHT]
    assert (await gate.acquire("capped", 100)).retry_after_s == 60.0
    t.close()  # a refused ticket gives nothing back
    assert redis.named("finish") == [] and gate._open["capped"] == 0


async def test_tenants_without_a_quota_never_reach_redis() -> None:
    redis = FakeRedis()
    gate, _, _ = make_gate(FakeClock(), redis)
    t = await gate.acquire("free", 100)
    assert t.ok and not t.shared
    t.close()
    assert redis.calls == []


async def test_redis_down_goes_local_once_and_requests_stop_trying_it() -> None:
    clock = FakeClock()
    redis = FakeRedis()
    gate, modes, errors = make_gate(clock, redis)
    await gate.start()
    await settle()  # its first heartbeat
    redis.answer = lambda name, args: RedisConnectionError("Connection refused")
    t = await gate.acquire("capped", 100)
    assert t.ok and not t.shared  # fail open: the core's local quotas take over
    assert gate.mode == "local" and modes == ["redis", "local"] and errors == ["connection"]
    before = len(redis.calls)
    for _ in range(10):
        assert (await gate.acquire("capped", 100)).ok
    assert len(redis.calls) == before  # no Redis call per request while local
    q = gate.controller_quotas
    assert q.acquire("capped", 100, clock.now()).ok  # charged locally now: a slot held
    assert q.acquire("capped", 100, clock.now()).ok
    assert q.acquire("capped", 100, clock.now()).retry_after_s == 1.0  # 2 slots held
    await gate.stop()


async def test_a_hanging_redis_costs_the_first_requests_a_stall_then_none() -> None:
    """Before: each request waited the call's timeout (1 s) and went on unchecked, until
    three timeouts and a failed probe made the process local."""
    redis = FakeRedis()
    gate, modes, _ = make_gate(MonotonicClock(), redis)
    await gate.start()
    await settle()  # its first heartbeat: 1 process, no sight
    hang = asyncio.Event()

    async def hung() -> Any:
        await hang.wait()
        return [1, b"0", *NO_SIGHT]

    redis.answer = lambda name, args: hung()
    redis.ping_hangs = True
    loop = asyncio.get_running_loop()
    started = loop.time()
    tickets = await asyncio.gather(*(gate.acquire("capped", 100) for _ in range(5)))
    waited = loop.time() - started
    assert all(t.ok and not t.shared for t in tickets)
    assert STALL_S <= waited < CALL_TIMEOUT_S  # together, the stall time: not a timeout each
    assert gate.mode == "local" and modes == ["redis", "local"]
    # checked against this process's share, not let through: its 2 slots (of 1 process)
    q = gate.controller_quotas
    now = gate._clock.now()
    assert q.acquire("capped", 100, now).ok and q.acquire("capped", 100, now).ok
    assert q.acquire("capped", 100, now).retry_after_s == 1.0
    calls = len(redis.calls)
    started = loop.time()
    assert not (await gate.acquire("capped", 100)).shared
    assert loop.time() - started < STALL_S and len(redis.calls) == calls  # no wait, no call
    hang.set()  # Redis answers at last: the 5 late charges come off the hand-back
    await settle()
    assert gate._open["capped"] == 0
    charge = q.hand_back(gate._clock.now())["capped"].tokens_charge
    assert charge == pytest.approx(2 * 100 - 5 * 100, abs=1)  # (less a few ms' refill)
    await gate.stop()


async def test_a_check_answered_after_its_request_went_on_locally_is_handed_back() -> None:
    clock = FakeClock()
    redis = FakeRedis()
    gate, _, _ = make_gate(clock, redis)
    answer = asyncio.get_running_loop().create_future()
    redis.answer = lambda name, args: answer if name == "acquire" else default_answer(name, args)
    waiting = [asyncio.ensure_future(gate.acquire("capped", 100)) for _ in range(2)]
    await settle()
    clock.advance(STALL_S)  # no answer for that long: the next request finds a stall
    assert not (await gate.acquire("capped", 100)).shared
    assert gate.mode == "local"
    assert [t.shared for t in await asyncio.gather(*waiting)] == [False, False]  # at once
    q = gate.controller_quotas
    assert q.acquire("capped", 100, clock.now()).ok  # one of them admitted locally
    answer.set_result([1, b"0", *NO_SIGHT])  # and Redis charged both after all
    await settle()
    # 1 request and 100 tokens admitted here, 2 and 200 charged in Redis: 1 and 100 back
    assert q.hand_back(clock.now()) == {"capped": HandBack(-1.0, -100.0, -1.0, -1.0)}
    assert gate._open["capped"] == 0 and gate._charged["capped"] == 0
    await gate.stop()


async def test_a_client_gone_during_the_check_leaves_no_charge() -> None:
    redis = FakeRedis()
    gate, _, _ = make_gate(FakeClock(), redis)
    answer = asyncio.get_running_loop().create_future()
    redis.answer = lambda name, args: answer if name == "acquire" else default_answer(name, args)
    task = asyncio.ensure_future(gate.acquire("capped", 100))
    await asyncio.sleep(0)
    await asyncio.sleep(0)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    answer.set_result([1, b"0", *NO_SIGHT])  # Redis charged it after all
    await settle()
    await asyncio.sleep(FLUSH_S)
    await settle()
    assert [a[2:5] for a in redis.named("finish")] == [(1, 100, 1)]
    assert gate._open["capped"] == 0


async def test_the_heartbeat_restates_open_requests_of_capped_tenants() -> None:
    clock = FakeClock()
    redis = FakeRedis()
    gate, _, _ = make_gate(clock, redis)
    a = await gate.acquire("capped", 10)
    await gate.acquire("capped", 10)
    a.close()
    await asyncio.sleep(FLUSH_S)  # a release still on its way would race with the beat
    await settle()
    await gate._beat()
    assert redis.named("processes") == [(gate.process, 10.0)]
    assert redis.named("heartbeat") == [(gate.process, 1)]  # "free" has no cap: no beat


async def test_going_local_starts_from_what_redis_last_showed() -> None:
    clock = FakeClock()
    redis = FakeRedis()
    gate, _, _ = make_gate(clock, redis)
    # capped: 60 requests and 1200 tokens a minute, 2 slots; Redis showed 30 requests and
    # 400 tokens left and this process's part of the demand: 0.5 (of 2 processes)
    redis.answer = lambda name, args: [1, b"0", b"30", b"400", b"0.5"]
    running = await gate.acquire("capped", 100)
    assert running.ok and running.shared
    gate.controller_quotas.set_processes(2, clock.now())
    clock.advance(1.5)
    redis.answer = lambda name, args: RedisConnectionError("Connection refused")
    assert (await gate.acquire("capped", 100)).ok
    assert gate.mode == "local"
    # 400 + 1.5 s x 20 = 430 tokens and 31.5 requests left; half of each here (15.75
    # requests and 215 tokens, refilled at 30 and 600 a minute)
    q = gate.controller_quotas
    now = clock.now()
    # the request admitted through Redis, still running, holds this process's one slot
    # (ceil(2 / 2)) until it ends
    assert q.acquire("capped", 100, now).retry_after_s == 1.0
    q.release("capped", now)
    assert q.acquire("capped", 100, now).ok
    q.release("capped", now)
    # 14.75 requests and 115 tokens left: a 116th token waits 0.1 s at 10/s
    d = q.acquire("capped", 116, now)
    assert not d.ok and d.retry_after_s == pytest.approx(0.1)
    for _ in range(14):
        assert q.acquire("capped", 1, now).ok
        q.release("capped", now)
    d = q.acquire("capped", 1, now)
    assert not d.ok and d.retry_after_s == pytest.approx(0.5)  # 0.25 request at 0.5/s
    await gate.stop()


async def test_back_from_a_loss_redis_is_charged_what_was_used_before_anything_else() -> None:
    clock = FakeClock()
    redis = FakeRedis()
    gate, modes, _ = make_gate(clock, redis)
    redis.answer = lambda name, args: (
        [1, b"0", b"60", b"900", b"1"] if name == "acquire" else [b"60", b"1000"]
    )
    ticket = await gate.acquire("capped", 100)
    ticket.finished(Outcome.OK, 10, 20)
    ticket.close()
    await asyncio.sleep(FLUSH_S)
    await settle()
    # the finish's answer showed the levels after the tokens came back
    assert gate.controller_quotas.sight("capped") == QuotaSight(60.0, 1000.0, 1.0, 0.0)
    redis.answer = lambda name, args: RedisConnectionError("Connection refused")
    assert (await gate.acquire("capped", 100)).ok
    q = gate.controller_quotas
    assert q.acquire("capped", 300, clock.now()).ok
    q.settle("capped", -50, clock.now())
    q.release("capped", clock.now())
    mode_at_resume: list[str] = []

    def answer(name: str, args: tuple[Any, ...]) -> Any:
        if name == "resume":
            mode_at_resume.append(gate.mode)
        return default_answer(name, args)

    redis.answer = answer
    await gate.start()
    clock.advance(1.0)
    await settle()
    gate._wake.set()
    for _ in range(20):
        if gate.mode == "redis":
            break
        await asyncio.sleep(0.01)
    assert modes[-2:] == ["local", "redis"]
    # 1 request and 250 tokens used locally, its share 0.9 x 1 + 0.1 / 16 (no count: the
    # fleet prior) = 0.90625 of each quota refilled 0.90625 requests in the second since;
    # levels last seen 1000 + 1 s x 20 tokens
    # (the loss's first hand-back, remembered by Redis for an hour)
    assert redis.named("resume") == [(60, 1200, 0.09375, 250.0, 60.0, 1020.0, 1, 3600)]
    assert mode_at_resume == ["local"]  # requests go to Redis only once it knows
    # and for as long as another process may take to hand back, the share checks too
    assert gate.hold_after_return_s == 1.0 + 0.25 + PROBE_TIMEOUT_S
    assert q.hold_until == clock.now() + gate.hold_after_return_s
    await gate.stop()


async def test_leaving_while_local_hands_back_what_it_admitted_within_its_grace() -> None:
    """Before, a process that exited while Redis was lost took what it had admitted on
    its own with it (`sluice bench fleet-quotas-hang`: 12,170 of batch-etl's
    tokens, from the replicas replaced during the outage)."""
    clock = FakeClock()
    redis = FakeRedis()
    gate = SharedQuotaGate("redis://fake", [CAPPED, FREE], clock, client=redis, reprobe_s=0.01)
    gate.controller_quotas.set_processes(1, 0.0)
    redis.answer = lambda name, args: RedisConnectionError("Connection refused")
    assert not (await gate.acquire("capped", 100)).shared and gate.mode == "local"
    assert gate.controller_quotas.acquire("capped", 100, clock.now()).ok  # admitted here
    pings: list[bool] = []

    async def ping() -> bool:  # Redis answers the third probe
        pings.append(len(pings) >= 2)
        if not pings[-1]:
            raise RedisConnectionError("Connection refused")
        return True

    redis.ping = ping  # type: ignore[method-assign]
    redis.answer = default_answer
    gate.draining(clock.now() + 30.0)  # SIGTERM, with the policy's shutdown grace
    await gate.stop()
    assert pings == [False, False, True]
    # the level unknown (-1): the request and its 100 tokens, nothing refilled yet
    assert redis.named("resume") == [(60, 1200, 1.0, 100.0, -1.0, -1.0, 1, 3600)]
    assert redis.named("zrem") == [(gate.process,)]  # and it left the count of processes


async def test_leaving_while_redis_stays_lost_says_what_is_not_handed_back(
    caplog: pytest.LogCaptureFixture,
) -> None:
    clock = FakeClock()
    redis = FakeRedis()
    gate, _, _ = make_gate(clock, redis)
    gate.controller_quotas.set_processes(1, 0.0)
    redis.answer = lambda name, args: RedisConnectionError("Connection refused")
    redis.ping_fails = True
    assert not (await gate.acquire("capped", 100)).shared
    assert gate.controller_quotas.acquire("capped", 250, clock.now()).ok
    with caplog.at_level("WARNING", logger="sluice.quota"):
        await gate.stop()  # no grace given: one try
    assert redis.pings == 1 and redis.named("resume") == []
    assert "(250 tokens and 1 requests of 1 tenants) is not handed back" in caplog.text


async def test_the_gateway_draining_gives_its_quotas_the_shutdown_grace() -> None:
    policy = parse_policy(
        "tenants: [{name: m, apiKeys: [sk-m], priority: 1, tokensPerMinute: 1200}]\n"
        "admin: {apiKeys: [sk-admin]}\n"
        "redis: {url: 'redis://127.0.0.1:1/0'}\n"
        "server: {shutdownGrace: 12s}\n"
    )
    gateway = Gateway(policy)
    assert gateway.quota_gate is not None and gateway.quota_gate.exit_by is None
    before = gateway.clock.now()
    gateway.draining = True
    assert before + 12.0 <= gateway.quota_gate.exit_by <= gateway.clock.now() + 12.0


async def test_the_heartbeat_refreshes_sights_of_tenants_not_asked_about_lately() -> None:
    clock = FakeClock()
    redis = FakeRedis()
    gate, _, _ = make_gate(clock, redis)
    redis.answer = lambda name, args: (
        [b"-1", b"700", b"0.25"] if name == "sight" else default_answer(name, args)
    )
    await gate._beat()
    assert redis.named("sight") == [(60, 1200, gate.process, 30.0)]  # "free" has no quota
    sight = gate.controller_quotas.sight("capped")
    assert sight == QuotaSight(None, 700.0, 0.25, clock.now())
    await gate._beat()
    assert len(redis.named("sight")) == 1  # fresh: not again
    clock.advance(gate.heartbeat_s / 4 + 0.1)
    await gate._beat()
    assert len(redis.named("sight")) == 2
