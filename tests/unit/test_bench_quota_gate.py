"""One replica's shared-quota gate in virtual time (bench/quota_gate.py) against the store
model: the round trip of a check, the give-backs in one call per flush, going local when
the store is lost (at once when refused, after timeouts and a failed probe when it hangs),
the hand-back and the hold after the return, the heartbeat's count of the processes."""

from __future__ import annotations

import heapq
import random
from collections.abc import Callable

import pytest

from sluice.bench.quota_gate import Ticket, VirtualQuotaGate
from sluice.bench.quota_store import Outage, QuotaStore
from sluice.core.clock import FakeClock
from sluice.core.settings import TenantLimits
from sluice.core.types import Outcome
from sluice.gateway.shared_quota import FLUSH_S, PROBE_TIMEOUT_S, STALL_S

RTT = 0.002
TENANT = TenantLimits(name="t", tokens_per_minute=600, requests_per_minute=60)


class Loop:
    """The harness's event heap, small: `schedule(t, fn)`, then `run(until)`."""

    def __init__(self) -> None:
        self.clock = FakeClock()
        self._heap: list[tuple[float, int, Callable[[float], None]]] = []
        self._seq = 0

    def schedule(self, t: float, fn: Callable[[float], None]) -> None:
        self._seq += 1
        heapq.heappush(self._heap, (t, self._seq, fn))

    def run(self, until: float) -> None:
        while self._heap and self._heap[0][0] <= until:
            t, _, fn = heapq.heappop(self._heap)
            self.clock.set(max(t, self.clock.now()))
            fn(t)
        self.clock.set(max(until, self.clock.now()))


def _gate(loop: Loop, store: QuotaStore, name: str = "a") -> VirtualQuotaGate:
    return VirtualQuotaGate(
        store, [TENANT], loop.clock, loop.schedule, process=name, rng=random.Random(1)
    )


def _check(loop: Loop, gate: VirtualQuotaGate, tokens: int) -> list[tuple[float, Ticket]]:
    answers: list[tuple[float, Ticket]] = []
    assert gate.acquire(loop.clock.now(), "t", tokens, lambda t, k: answers.append((t, k))) is None
    return answers


def test_a_check_takes_a_round_trip_and_give_backs_go_in_one_call_per_flush() -> None:
    loop, store = Loop(), QuotaStore(round_trip_s=RTT)
    gate = _gate(loop, store)
    answers = _check(loop, gate, 100)
    loop.run(RTT * 0.99)
    assert answers == []
    loop.run(RTT)
    ((at, ticket),) = answers
    assert at == RTT and ticket.ok and ticket.shared and ticket.charged_at == RTT / 2
    assert store.levels(RTT / 2, "t", 60, 600) == (59.0, 500.0)
    other = _check(loop, gate, 100)
    loop.run(1.0)
    gate.close(1.0, ticket, ran=True, outcome=Outcome.OK, prompt_tokens=10, completion_tokens=20)
    gate.close(1.0, other[0][1], ran=False)  # never ran: all of it back
    loop.run(1.0 + FLUSH_S + RTT)
    # one call for both, sent at the flush, at the store half a round trip later
    assert ticket.settled_at == pytest.approx(1.0 + FLUSH_S + RTT / 2)
    calls = store.calls
    loop.run(2.0)
    assert store.calls == calls
    # 600 - 100 - 100, 70 and 100 back, 2 s of refill at 10/s (less the first millisecond's,
    # lost to a full bucket); the requests' bucket is full again
    assert store.levels(2.0, "t", 60, 600) == (60.0, pytest.approx(589.99))


def test_a_refused_store_goes_local_at_once_and_is_handed_back_then_held() -> None:
    loop = Loop()
    store = QuotaStore(round_trip_s=RTT, outages=[Outage(5.0, 10.0)])
    gate = _gate(loop, store)
    gate.start(0.0)  # its first heartbeat: one process
    _check(loop, gate, 100)
    loop.run(5.5)
    assert gate.mode == "redis" and gate.controller_quotas.processes == 1
    answers = _check(loop, gate, 100)
    loop.run(5.5 + 1.01 * RTT)
    ((_, ticket),) = answers
    assert ticket.ok and not ticket.shared and gate.mode == "local"  # fail open, local now
    quotas = gate.controller_quotas
    # its part of the demand is all of it: the whole quota, from the level last seen
    # (500 at 0.001 s, refilled 10/s, full at 10 s)
    assert quotas.local.levels("t", loop.clock.now()) == (60.0, pytest.approx(555.0, abs=0.1))
    assert quotas.acquire("t", 300, loop.clock.now()).ok
    loop.run(10.0)  # probes every second fail
    assert gate.mode == "local"
    while gate.mode == "local":
        loop.run(loop.clock.now() + 0.001)
    back = loop.clock.now()
    assert back < 10.0 + 1.0 + 0.25 + 0.002  # the next probe, seen within a turn of the loop
    # the store, full again, was charged what was admitted locally less what the share
    # refilled meanwhile (core/quota_failover.py Ledger) before anything else: the
    # request's bucket was full again; 555 - 300 tokens + 10 a second since 5.5 s
    assert store.levels(back, "t", 60, 600) == (
        60.0,
        pytest.approx(255.0 + 10 * (back - 5.5), abs=0.1),
    )
    hold = gate.hold_after_return_s
    assert hold == 1.0 + 0.25 + PROBE_TIMEOUT_S
    # for that long, the local share checks too: 300 left of its 600 (and the refill)
    assert not quotas.acquire("t", 400, loop.clock.now()).ok
    loop.run(quotas.hold_until)
    assert quotas.acquire("t", 400, loop.clock.now()).ok  # Redis alone again


def test_a_hanging_store_stalls_the_checks_out_then_they_are_checked_locally() -> None:
    loop = Loop()
    store = QuotaStore(round_trip_s=RTT, outages=[Outage(5.0, 60.0, failure="timeout")])
    gate = _gate(loop, store)
    gate.start(0.0)
    loop.run(5.0)
    answers = [_check(loop, gate, 10) for _ in range(3)]
    loop.run(5.0 + STALL_S - 0.001)
    assert all(a == [] for a in answers) and gate.mode == "redis"
    loop.run(5.0 + STALL_S)  # none answered for STALL_S: local, every check goes on
    checks = [(t, k.ok, k.shared) for a in answers for t, k in a]
    assert checks == [(5.0 + STALL_S, True, False)] * 3
    assert gate.mode == "local" and not gate.circuit.confirmed
    assert gate.controller_quotas.acquire("t", 10, loop.clock.now()).ok  # charged locally
    loop.run(5.0 + STALL_S + PROBE_TIMEOUT_S)  # the probe, at once, got no answer either
    assert gate.circuit.confirmed


def test_the_heartbeat_counts_the_live_processes_and_a_stopped_one_leaves() -> None:
    loop = Loop()
    store = QuotaStore(round_trip_s=RTT)
    a, b = _gate(loop, store, "a"), _gate(loop, store, "b")
    a.start(0.0)
    b.start(0.0)
    loop.run(1.0)
    assert a.controller_quotas.processes == b.controller_quotas.processes == 2
    b.stop(1.0)
    loop.run(3.0)
    assert a.controller_quotas.processes == 1


def test_a_replica_leaving_while_local_hands_back_within_its_grace_unless_killed() -> None:
    results = []
    for until, killed in ((12.0, False), (None, False), (12.0, True)):
        loop = Loop()
        store = QuotaStore(round_trip_s=RTT, outages=[Outage(5.0, 10.0)])
        gate = _gate(loop, store)
        gate.start(0.0)
        loop.run(5.5)
        _check(loop, gate, 100)  # refused: local
        loop.run(5.6)
        assert gate.controller_quotas.acquire("t", 300, loop.clock.now()).ok
        gate.stop(6.0, until, killed=killed)  # drained, SIGTERM at 6 s
        loop.run(20.0)
        assert gate.stopped
        results.append(store.levels(20.0, "t", 60, 600)[1])
    # within its grace: Redis back at 10 s, probed then, the 300 tokens charged (less
    # the 4.4 s its share refilled meanwhile); with no grace (one try) or killed, lost
    assert results[0] == pytest.approx(600 - 300 + 10 * (10.25 - 5.6) + 10 * (20 - 10.25), abs=3)
    assert results[1] == results[2] == 600.0


def test_a_local_request_ending_after_the_hand_back_is_charged_to_the_store() -> None:
    """`SharedQuotaGate._send_owed`: a request admitted locally during the loss (by the
    Controller, against its share) that runs on past the hand-back charges Redis what it
    used beyond its charge once it ends (without it the bench's store never learned it:
    `fleet-quotas`'s batch tenant got 110 tokens past one exact bucket after the return)."""
    loop = Loop()
    store = QuotaStore(round_trip_s=RTT, outages=[Outage(5.0, 10.0)])
    gate = _gate(loop, store)
    gate.start(0.0)
    loop.run(5.5)
    _check(loop, gate, 10)  # finds Redis refused: local from now
    loop.run(5.5 + 1.01 * RTT)
    quotas = gate.controller_quotas
    decision = quotas.acquire("t", 100, loop.clock.now())  # the Controller's local check
    assert decision.ok and decision.outage
    while gate.mode == "local":
        loop.run(loop.clock.now() + 0.001)
    loop.run(quotas.hold_until + 0.5)  # handed back, held, Redis alone: the request runs on
    now = loop.clock.now()
    before = store.levels(now, "t", 60, 600)[1]
    calls = store.calls
    # it ends having used 300 tokens: 200 more than its charge (the Controller's end)
    quotas.settle("t", 200, now, decision.outage)
    quotas.release("t", now, decision.outage)
    loop.run(now + 0.3)  # a turn of the loop (0.25 s) and a round trip
    assert store.calls > calls  # the loss handed back once more
    assert not quotas.owes()
    refilled = min(600.0, before + 10 * (loop.clock.now() - now))
    assert store.levels(loop.clock.now(), "t", 60, 600)[1] == pytest.approx(refilled - 200, abs=1)
