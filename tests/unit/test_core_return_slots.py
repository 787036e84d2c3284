"""Return slots (issue 17): the ledger's exact slots, and the controller's promise that a
client coming back in its slot is let in ahead of fresh arrivals of its class."""

from __future__ import annotations

import random
from typing import Any

import pytest

from sluice.config import Policy
from sluice.core.class_queue import ClassQueue
from sluice.core.clock import FakeClock
from sluice.core.controller import Controller
from sluice.core.dispatcher import low_cap, return_cap
from sluice.core.request_record import RequestRecord
from sluice.core.return_slots import ReturnLedger
from sluice.core.types import Outcome, RejectCode, RequestInfo

# -- the ledger, exact ----------------------------------------------------------------


def ledger(**kw: Any) -> ReturnLedger:
    return ReturnLedger(3, **kw)


def test_slots_of_a_class_are_one_unit_of_room_apart_after_the_queue_ahead() -> None:
    led = ledger()
    a = led.offer(1, 10.0, rate=4.0, ahead=8.0, tenant="t").booking
    b = led.offer(1, 10.0, rate=4.0, ahead=8.0, tenant="t").booking
    assert a is not None and b is not None
    assert a.slot == pytest.approx(10.0 + 8 / 4 + 1 / 4)  # 8 ahead drain, then its unit
    assert b.slot == pytest.approx(a.slot + 0.25)
    assert a.due == a.slot  # no lead asked
    assert a.window == pytest.approx(0.125)  # half a unit's span
    assert led.outstanding(1) == 2


def test_the_lead_sends_the_client_back_early_but_never_bunched() -> None:
    led = ledger()
    first = led.offer(2, 0.0, rate=10.0, ahead=0.0, tenant="t", lead_s=5.0).booking
    assert first is not None
    assert first.slot == pytest.approx(0.1)
    assert first.due == pytest.approx(0.1)  # the lead cannot send it back before now
    second = led.offer(2, 0.0, rate=10.0, ahead=0.0, tenant="t", lead_s=5.0).booking
    assert second is not None and second.due == pytest.approx(first.due + 0.1)  # one spacing


def test_the_classes_above_are_served_first_bin_by_bin() -> None:
    led = ledger()
    # P1 books 10 returns at 10/s: [0, 1 s) is taken
    for _ in range(10):
        led.offer(1, 0.0, rate=10.0, ahead=0.0, tenant="t")
    p2 = led.offer(2, 0.0, rate=10.0, ahead=0.0, tenant="t").booking
    assert p2 is not None and p2.slot == pytest.approx(1.1)  # after P1's, one unit in
    # P1 does not see P2's bookings: its next one goes on from its own
    p1 = led.offer(1, 0.0, rate=10.0, ahead=0.0, tenant="t").booking
    assert p1 is not None and p1.slot == pytest.approx(1.1)


def test_a_burst_above_pushes_the_slot_by_its_decaying_excess() -> None:
    calm = ledger().offer(2, 0.0, rate=10.0, ahead=0.0, tenant="t").booking
    busy = ledger().offer(2, 0.0, rate=10.0, excess=20.0, decay_s=5.0, ahead=0.0, tenant="t")
    assert calm is not None and busy.booking is not None
    # room(tau) = 10 - 20 exp(-tau / 5) opens after 5 ln 2 = 3.47 s; its first unit is
    # complete about a second later (the room grows from nothing)
    assert 4.3 < busy.booking.slot < 4.7
    assert calm.slot == pytest.approx(0.1)


def test_past_the_clients_deadline_nothing_is_booked() -> None:
    led = ledger()
    offer = led.offer(1, 0.0, rate=1.0, ahead=10.0, tenant="t", not_after=5.0)
    assert offer.booking is None and offer.slot == pytest.approx(11.0)
    assert led.outstanding(1) == 0
    # a quote books nothing either
    quote = led.offer(1, 0.0, rate=1.0, ahead=0.0, tenant="t", book=False)
    assert quote.slot == pytest.approx(1.0) and led.outstanding(1) == 0


def test_no_room_within_the_horizon() -> None:
    led = ledger(horizon_s=60.0)
    assert led.offer(1, 0.0, rate=1.0, ahead=100.0, tenant="t").slot is None
    assert led.offer(1, 0.0, rate=0.0, ahead=0.0, tenant="t").slot is None


def test_a_return_in_its_slot_uses_its_booking_up() -> None:
    led = ledger(early_s=0.25, late_s=2.0)
    b = led.offer(1, 0.0, rate=1.0, ahead=9.0, tenant="t").booking
    assert b is not None and b.due == pytest.approx(10.0)
    assert not led.claim(b.id, tenant="other", priority=1, now=10.0)  # not its booking
    assert not led.claim(b.id, tenant="t", priority=2, now=10.0)
    assert not led.claim(b.id, tenant="t", priority=1, now=9.0)  # early: not a return...
    assert led.outstanding(1) == 1  # ...and the booking waits for the real one
    assert led.claim(b.id, tenant="t", priority=1, now=10.3) == (0.0,)  # refused at 0
    assert not led.claim(b.id, tenant="t", priority=1, now=10.4)  # used up
    assert led.outstanding(1) == 0 and led.claimed[1] == 1
    assert not led.claim("no-such", tenant="t", priority=1, now=10.0)


def test_a_booking_made_elsewhere_is_recognised_by_the_slot_its_token_states() -> None:
    led = ledger(early_s=0.25, late_s=2.0, max_window_s=1.0)
    assert led.claim("other-replica-7", tenant="t", priority=1, now=10.0, slot=10.1) == (None,)
    assert not led.claim("other-replica-7", tenant="t", priority=1, now=14.0, slot=10.0)


def test_no_shows_make_the_next_bookings_denser() -> None:
    led = ledger(late_s=1.0, show_alpha=0.5, min_weight=0.5)
    for _ in range(4):
        led.offer(1, 0.0, rate=10.0, ahead=0.0, tenant="t")
    led.expire(100.0)  # nobody came back
    assert led.expired[1] == 4 and led.outstanding(1) == 0
    assert led.show_rate(1) == pytest.approx(0.0625)  # 1 -> 0.5 -> ... four halvings
    a = led.offer(1, 100.0, rate=10.0, ahead=0.0, tenant="t").booking
    b = led.offer(1, 100.0, rate=10.0, ahead=0.0, tenant="t").booking
    assert a is not None and b is not None
    assert b.slot - a.slot == pytest.approx(0.05)  # half a unit each (the floor weight)


def test_returns_of_different_classes_are_not_told_the_same_instant() -> None:
    led = ledger(peak_s=0.1, due_bin_s=0.02, return_share=1.0)
    dues = []
    for p in (1, 2, 1, 2, 1, 2, 1, 2):  # each class alone would be due 0.05 s apart
        b = led.offer(p, 0.0, rate=20.0, ahead=0.0, tenant="t", capacity=20.0).booking
        assert b is not None
        dues.append(b.due)
    dues.sort()
    # at most 2 (= 20/s x 100 ms) due in any 100 ms
    assert all(sum(1 for d in dues if t <= d < t + 0.1) <= 2 for t in dues)


def test_returns_spread_over_their_windows_stay_under_the_cap() -> None:
    # a client comes back anywhere in [due, due + window]: any 100 ms may catch the
    # dues of 100 ms + window, so the cap counts that span (it counted 100 ms alone, and
    # two classes' returns, each at its own pace, landed 3 in a 100 ms capped at 2)
    led = ledger(peak_s=0.1, due_bin_s=0.02, return_share=1.0)
    spans = []
    for p in (1, 2, 1, 2, 1, 2, 1, 2, 1, 2):
        b = led.offer(p, 0.0, rate=20.0, ahead=0.0, tenant="t", capacity=20.0).booking
        assert b is not None
        spans.append((b.due, b.due + b.window))
    starts = [d for d, _ in spans] + [e for _, e in spans]
    worst = max(sum(1 for d, e in spans if d < t + 0.1 and e >= t) for t in starts)
    assert worst <= 2


def test_a_due_on_a_bin_edge_counts_in_that_bin() -> None:
    # 67.6 / 0.02 is 3379.9999...: the due placed at bin 3380's start is counted there
    led = ledger(peak_s=0.1, due_bin_s=0.02, return_share=1.0)
    assert led._due_bin(3380 * 0.02) == 3380


# -- the returns lane -------------------------------------------------------------------


def rec(rid: str, seq: int, tenant: str = "t") -> RequestRecord:
    return RequestRecord(
        RequestInfo(rid, tenant, 1, "m", 10, 10),
        seq=seq,
        now=0.0,
        prompt_est=10,
        expected_output=10,
        cost=20,
    )


def test_the_returns_lane_goes_first_in_the_order_it_came_back() -> None:
    q = ClassQueue(Policy().core_settings().queue(1))
    q.push(rec("fresh-a", 1, "a"))
    q.push(rec("back-1", 2), returning=True)
    q.push(rec("fresh-b", 3, "b"))
    q.push(rec("back-2", 4), returning=True)
    assert len(q) == 4
    assert q.remove("back-2") is not None
    q.push(rec("back-3", 5), returning=True)
    assert [q.pop().request_id for _ in range(4)] == ["back-1", "back-3", "fresh-a", "fresh-b"]
    assert q.pop() is None and q.idle()


def test_a_return_too_large_to_place_can_be_parked_like_any_request() -> None:
    q = ClassQueue(Policy().core_settings().queue(1))
    big = rec("back-big", 1)
    q.push(big, returning=True)
    q.push(rec("back-2", 2), returning=True)
    q.park(big)  # what the dispatcher does with a head it has held long enough
    assert list(q.parked) == ["back-big"] and q.peek() is not None
    assert q.peek().request_id == "back-2" and len(q) == 2
    assert q.remove("back-big") is big and not q.parked and len(q) == 1


# -- the controller's promise -------------------------------------------------------------


def policy(rule: str = "booking", p2_timeout: str = "60s", **retry_after: Any) -> Policy:
    return Policy.model_validate(
        {
            "queues": [
                {
                    "priority": 0,
                    "name": "q0",
                    "maxQueueSize": 10,
                    "timeout": "8s",
                    "dropPolicy": "tail",
                },
                {
                    "priority": 1,
                    "name": "q1",
                    "maxQueueSize": 50,
                    "timeout": "15s",
                    "dropPolicy": "early-drop-on-pressure",
                },
                {
                    "priority": 2,
                    "name": "q2",
                    "maxQueueSize": 50,
                    "timeout": p2_timeout,
                    "dropPolicy": "fast-reject",
                },
            ],
            "limiter": {"algorithm": "fixed", "fixedLimit": 2},
            "dispatcher": {"reserved": {"p0": 0.0}},
            "retryAfter": {"rule": rule, **retry_after},
        }
    )


def req(rid: str, prio: int = 2, deadline: float | None = None, **kw: Any) -> RequestInfo:
    return RequestInfo(rid, "t", prio, "m", 100, 100, client_deadline=deadline, **kw)


def busy(pol: Policy) -> tuple[Controller, FakeClock, list[str]]:
    """A gateway that has dispatched P2 at 4/s (2 slots, 0.5 s each) for 3 s, now with
    both slots busy and 2 P2 requests queued: pressure 1, a fresh P2 is fast-rejected.
    Returns the controller, its clock and the ids in flight."""
    clock = FakeClock()
    c = Controller(pol.core_settings(), clock, ["b0"], rate_tau_s=1.0, return_lead=0.0)
    n = 0
    inflight: list[str] = []
    for step in range(7):
        clock.set(step * 0.5)
        for rid in inflight:
            c.on_finish(rid, Outcome.OK, 100, 10)
        for _ in range(2):
            assert c.arrive(req(f"w{n}")).admitted
            n += 1
        inflight = [a.request_id for a in c.step().assignments]
        assert len(inflight) == 2
    for k in range(2):
        assert c.arrive(req(f"q{k}")).admitted
    assert c.pressure() == 1.0
    return c, clock, inflight


def test_a_refused_client_back_in_its_slot_is_let_in_ahead_of_fresh_arrivals() -> None:
    c, clock, inflight = busy(policy())
    adm = c.arrive(req("r"))
    assert not adm.admitted and adm.code is RejectCode.FAST_REJECT
    assert adm.booking is not None and adm.retry_after_s > 0
    assert adm.retry_window_s > 0
    clock.advance(adm.retry_after_s)
    assert c.pressure() == 1.0  # nothing moved: a fresh request is still refused...
    assert not c.arrive(req("fresh")).admitted
    back = c.arrive(req("r.1", booking=adm.booking))  # ...the return is not
    assert back.admitted
    # and it goes first when a slot frees, before the two queued before it came back
    c.on_finish(inflight[0], Outcome.OK, 100, 10)
    assert [a.request_id for a in c.step().assignments] == ["r.1"]
    snap = c.snapshot().classes["P2"].returns
    assert snap.booked >= 2 and snap.returned == 1 and snap.returned_admitted == 1
    assert snap.waited == 1 and snap.waited_s == pytest.approx(adm.retry_after_s)


def test_a_client_back_too_early_is_a_fresh_arrival() -> None:
    c, clock, _ = busy(policy())
    adm = c.arrive(req("r"))
    assert adm.booking is not None
    clock.advance(adm.retry_after_s / 4)
    again = c.arrive(req("r.1", booking=adm.booking))
    assert not again.admitted  # refused like anyone fresh, with a new booking
    assert again.booking is not None and again.booking != adm.booking


def test_a_retry_after_never_points_past_the_clients_deadline() -> None:
    rng = random.Random(7)
    c, clock, _ = busy(policy())
    for k in range(200):
        now = clock.now()
        left = rng.uniform(0.05, 20.0)
        adm = c.arrive(req(f"d{k}", deadline=now + left))
        if adm.admitted:
            continue
        if adm.code is RejectCode.CANNOT_SERVE_IN_TIME:
            assert adm.booking is None
        else:
            assert adm.retry_after_s <= left, (k, adm)
        clock.advance(0.01)
    told = c.snapshot().classes["P2"].returns.unservable
    assert told > 0  # the short deadlines were told so


def test_with_less_than_a_second_left_no_whole_second_retry_after_fits() -> None:
    # Retry-After is whole seconds, at least 1: with 0.9 s left it cannot be kept
    c, clock, _ = busy(policy())
    assert c.arrive(req("first")).retry_after_s < 0.65  # slots 0.2 s apart: the next
    # one (0.81 s ahead) is within 0.9 s, but "Retry-After: 1" is not
    adm = c.arrive(req("r", deadline=clock.now() + 0.9))
    assert adm.code is RejectCode.CANNOT_SERVE_IN_TIME and adm.booking is None
    ok = c.arrive(req("r2", deadline=clock.now() + 5.0))  # ...that a 5 s deadline gets
    assert ok.code is RejectCode.FAST_REJECT and ok.booking is not None


def test_the_other_rules_book_nothing() -> None:
    c, _, _ = busy(policy("fixed", fixedSeconds=7))
    adm = c.arrive(req("r"))
    assert not adm.admitted and adm.retry_after_s == 7.0 and adm.booking is None
    c, _, _ = busy(policy("drain"))
    adm = c.arrive(req("r"))
    assert not adm.admitted and adm.booking is None
    # with no booking rule, a booking id sent back is not a pass
    assert not c.arrive(req("r.1", booking="0-1")).admitted


def test_a_request_dropped_from_its_queue_is_given_a_slot_too() -> None:
    c, clock, _ = busy(policy(p2_timeout="1s"))
    clock.advance(1.01)  # the queued P2 requests waited their whole timeout
    dropped = c.step().rejections
    assert dropped and all(r.code is RejectCode.QUEUE_TIMEOUT for r in dropped)
    assert all(r.booking is not None and r.retry_after_s > 0 for r in dropped)


def test_an_idle_gateway_quotes_a_short_retry_after() -> None:
    # the issue's dashboard showed P0's Retry-After as 60 s on an idle gateway
    c = Controller(Policy().core_settings(), FakeClock(), ["b0"])
    c.set_backend_health("b0", True)
    quotes = {k: v.retry_after_s for k, v in c.snapshot().classes.items()}
    # one unit of the room its free slots give (8 slots for P0, 6 for P1/P2: 1 s each)
    assert quotes == pytest.approx({"P0": 1 / 8, "P1": 1 / 6, "P2": 1 / 6})


def test_a_p0_request_dropped_from_its_queue_is_told_a_slot_not_the_longest_wait() -> None:
    # the P0 request that timed out in its queue was told 60 s
    clock = FakeClock()
    doc = policy().model_dump(by_alias=True)
    doc["queues"][0]["timeout"] = 0.2
    c = Controller(
        Policy.model_validate(doc).core_settings(), clock, ["b0"], rate_tau_s=1.0, return_lead=0.0
    )
    inflight: list[str] = []
    for step in range(8):  # P0 served at 4/s
        clock.set(step * 0.5)
        for rid in inflight:
            c.on_finish(rid, Outcome.OK, 100, 10)
        for k in range(2):
            c.arrive(req(f"w{step}-{k}", prio=0))
        inflight = [a.request_id for a in c.step().assignments]
    assert c.arrive(req("late", prio=0)).admitted
    clock.advance(0.25)  # it waited its class's whole timeout
    (dropped,) = c.step().rejections
    assert dropped.code is RejectCode.QUEUE_TIMEOUT
    assert dropped.booking is not None and dropped.retry_after_s < 2.0
    # and one whose own deadline passed in the queue is told so, not to come back
    assert c.arrive(req("later", prio=0, deadline=clock.now() + 0.1)).admitted
    clock.advance(0.15)
    (gone,) = c.step().rejections
    assert gone.code is RejectCode.CANNOT_SERVE_IN_TIME and gone.booking is None


def test_a_return_never_takes_a_slot_reserved_for_p0() -> None:
    # issue 17, real-mode burst: P0 lost its SLO beside the rule before. A booked return
    # is P2 traffic: it gets the lower classes' slots only, never P0's reserve, and not
    # their last one either (return_cap: 2 of 4 here).
    doc = policy().model_dump(by_alias=True)
    doc["limiter"]["fixedLimit"] = 4
    doc["dispatcher"]["reserved"]["p0"] = 0.25  # cap_low 3: one slot is P0's
    doc["queues"][2]["maxQueueSize"] = 1
    clock = FakeClock()
    c = Controller(
        Policy.model_validate(doc).core_settings(), clock, ["b0"], rate_tau_s=1.0, return_lead=0.0
    )
    inflight: list[str] = []
    for step in range(7):  # P2 served at 6/s: the ledger has a rate
        clock.set(step * 0.5)
        for rid in inflight:
            c.on_finish(rid, Outcome.OK, 100, 10)
        for k in range(3):
            c.arrive(req(f"w{step}-{k}"))
        inflight = [a.request_id for a in c.step().assignments]
        assert len(inflight) == 3  # the lower classes stop at cap_low
    assert c.arrive(req("queued")).admitted
    refused = c.arrive(req("r"))
    assert refused.code is RejectCode.QUEUE_FULL and refused.booking is not None
    clock.advance(refused.retry_after_s)
    assert c.arrive(req("r.1", booking=refused.booking)).admitted  # in its slot
    assert c.step().assignments == []  # 3 in flight: the 4th slot is not the return's
    assert c.arrive(req("p0", prio=0)).admitted
    assert [a.request_id for a in c.step().assignments] == ["p0"]  # P0 takes its reserve
    c.on_finish(inflight[0], Outcome.OK, 100, 10)
    assert c.step().assignments == []  # 3 in flight again: still nothing for P2
    c.on_finish(inflight[1], Outcome.OK, 100, 10)
    # 2 in flight, under cap_low, but a return leaves the lower classes' last slot (the
    # one a cut to 3 would take back): it waits, and the fresh request behind it too
    assert c.step().assignments == []
    c.on_finish(inflight[2], Outcome.OK, 100, 10)
    # the return first, ahead of the fresh request queued before it came back
    assert [a.request_id for a in c.step().assignments] == ["r.1", "queued"]


def test_a_return_leaves_the_lower_classes_last_slot() -> None:
    assert return_cap(10, low_cap(10, 0.2)) == 7  # cap_low 8
    assert return_cap(2, low_cap(2, 0.2)) == 1  # cap_low 1: at least one
    assert return_cap(10, low_cap(10, 0.0)) == 10  # no reserve for P0: nothing to leave
