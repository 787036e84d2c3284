"""Dispatch on arrival: a request that finds every class queue empty is placed by
`arrive` itself. For a driver that steps after every event (the gateway, the bench
harness) that must change nothing: the same admissions, assignments, refusals, wake-ups
and state as when `arrive` only queues."""

from __future__ import annotations

from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_core_controller_invariants import make_policy as invariants_policy

from sluice.config import Policy
from sluice.core.clock import FakeClock
from sluice.core.controller import Controller, Step
from sluice.core.limiters import Limiter, LimiterBase, LimiterContext, make_limiter
from sluice.core.quota import InProcessQuotas
from sluice.core.request_record import RequestState
from sluice.core.settings import LimiterSettings
from sluice.core.types import Assignment, BackendMetrics, Outcome, RequestInfo, Sample

BACKENDS = ["b0", "b1"]


def make_policy(algorithm: str = "fixed", limit: int = 2, reserved: float = 0.2) -> Policy:
    return invariants_policy(
        algorithm,
        limit,
        dispatcher={"reserved": {"p0": reserved}, "agingAfter": "2s"},
        tokens_per_minute=20000,
    )


def controller(policy: Policy, clock: FakeClock, on_arrival: bool, **kw: Any) -> Controller:
    def factory(context: LimiterContext, lp: LimiterSettings, initial: int | None) -> Limiter:
        extra: dict[str, Any] = {"seed": context.backend} if lp.algorithm == "sluice" else {}
        return make_limiter(lp, initial_limit=initial, **extra)

    return Controller(
        policy.core_settings(),
        clock,
        BACKENDS,
        rate_tau_s=1.0,
        limiter_factory=factory,
        dispatch_on_arrival=on_arrival,
        **kw,
    )


arrive = st.tuples(
    st.just("arrive"),
    st.integers(0, 2),  # priority
    st.sampled_from(["A", "B", "C"]),  # C has a quota
    st.sampled_from(["m", "m", "other"]),  # model
    st.integers(1, 3000),  # prompt tokens
    st.one_of(st.none(), st.floats(0.0, 30.0)),  # client deadline, from now
    st.sampled_from([1.0, 1.0, 0.5, 3.0]),  # tenant weight
)
op = st.one_of(
    arrive,
    arrive,
    arrive,
    st.tuples(st.just("finish"), st.integers(0, 40), st.sampled_from(list(Outcome))),
    st.tuples(st.just("first_token"), st.integers(0, 40)),
    st.tuples(st.just("cancel"), st.integers(0, 40)),
    st.tuples(st.just("advance"), st.floats(0.0, 5.0)),
    st.tuples(
        st.just("metrics"), st.sampled_from(BACKENDS), st.integers(0, 3), st.floats(0.0, 1.0)
    ),
    st.tuples(st.just("health"), st.sampled_from(BACKENDS), st.booleans()),
    st.tuples(
        st.just("models"),
        st.sampled_from(BACKENDS),
        st.sampled_from([(), ("m",), ("other",), ("m", "other")]),
    ),
)


def arrival(step: tuple, ids: list[str], now: float) -> RequestInfo:
    """The request of an "arrive" op (its id is the next in `ids`)."""
    _, prio, tenant, model, prompt, dl, weight = step
    ids.append(f"r{len(ids)}")
    deadline = None if dl is None else now + dl
    return RequestInfo(ids[-1], tenant, prio, model, prompt, 200, weight, client_deadline=deadline)


def event(step: tuple, ids: list[str], now: float) -> tuple[str, tuple] | None:
    """The controller call (method, args) of any other op but "advance"; None when it
    names a request and none has arrived yet."""
    kind = step[0]
    if kind in ("finish", "first_token", "cancel"):
        if not ids:
            return None
        rid = ids[step[1] % len(ids)]
        if kind == "finish":
            return "on_finish", (rid, step[2], 100, 20)
        return ("on_first_token" if kind == "first_token" else "cancel"), (rid,)
    if kind == "metrics":
        _, name, waiting, kv = step
        m = BackendMetrics(
            at=now, waiting=waiting, kv_usage=kv, running=1, num_gpu_blocks=200, block_size=16
        )
        return "on_metrics", (name, m)
    if kind == "health":
        return "set_backend_health", (step[1], step[2])
    assert kind == "models", kind
    return "set_backend_models", (step[1], step[2])


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    algorithm=st.sampled_from(["fixed", "sluice", "gradient"]),
    limit=st.integers(1, 3),
    ops=st.lists(op, min_size=10, max_size=150),
)
def test_a_driver_that_steps_after_every_event_sees_no_difference(
    algorithm: str, limit: int, ops: list[tuple]
) -> None:
    clock = FakeClock()
    policy = make_policy(algorithm, limit)
    fast = controller(policy, clock, on_arrival=True)
    slow = controller(policy, clock, on_arrival=False)
    ids: list[str] = []

    def both(call: str, *args: Any) -> Any:
        a = getattr(fast, call)(*args)
        b = getattr(slow, call)(*args)
        assert a == b, call
        return a

    for step in ops:
        kind = step[0]
        if kind == "arrive":
            both("arrive", arrival(step, ids, clock.now()))
        elif kind == "advance":
            clock.advance(step[1])
        else:
            call = event(step, ids, clock.now())
            if call is None:
                continue
            both(call[0], *call[1])
        # The shell steps after every event (time passing is none: its timer may fire
        # after the next arrival), and starts what it is told to.
        if kind != "advance":
            both("step")
        assert fast.snapshot() == slow.snapshot()
        for rid in ids:
            assert fast.state_of(rid) is slow.state_of(rid)
            assert fast.backend_of(rid) == slow.backend_of(rid)


def test_placed_on_arrival_and_reported_by_the_next_step() -> None:
    clock = FakeClock(5.0)
    c = controller(make_policy(limit=1, reserved=0.0), clock, on_arrival=True)
    assert c.arrive(RequestInfo("a", "A", 1, "m", 100, 100)).admitted
    # in flight at once, on the backend the next pass names
    assert c.state_of("a") is RequestState.INFLIGHT and c.backend_of("a") == "b0"
    assert c.snapshot().classes["P1"].queued == 0
    assert not c.quiet()  # an assignment waits to be reported: step now
    clock.advance(0.5)
    assert c.step() == Step([Assignment("a", "b0", 0.0)], [], None)
    assert c.step() == Step([], [], None)  # reported once
    assert c.step().wake_at is None


def test_not_placed_on_arrival_while_anything_is_queued_or_no_backend_has_room() -> None:
    clock = FakeClock()
    c = controller(make_policy(limit=1, reserved=0.0), clock, on_arrival=True)
    for rid in ("a", "b"):  # one slot per backend
        c.arrive(RequestInfo(rid, "A", 0, "m", 100, 100))
    assert [(x.request_id, x.backend) for x in c.step().assignments] == [("a", "b0"), ("b", "b1")]
    c.arrive(RequestInfo("c", "A", 0, "m", 100, 100))  # no room: queued
    assert c.state_of("c") is RequestState.QUEUED
    c.on_finish("a", Outcome.OK)
    # a P2 request finds P0's queue holding "c": it waits its turn, behind it
    c.arrive(RequestInfo("d", "A", 2, "m", 100, 100))
    assert c.state_of("d") is RequestState.QUEUED
    assert c.step().assignments == [Assignment("c", "b0", 0.0)]
    assert c.state_of("d") is RequestState.QUEUED


def test_cancelled_before_its_report_gives_back_its_slot_and_quota() -> None:
    clock = FakeClock()
    policy = make_policy(limit=1, reserved=0.0)
    quotas = InProcessQuotas(policy.core_settings().tenants)
    c = controller(policy, clock, on_arrival=True, quotas=quotas)
    c.arrive(RequestInfo("a", "C", 0, "m", 100, 100))
    c.cancel("a")
    assert c.state_of("a") is RequestState.GONE
    # never ran: its slot and its tokens came back, the quota answers as a fresh one (C:
    # 3 slots, 20,000 tokens a minute; the third probe waits for 7,000 tokens)
    fresh = InProcessQuotas(policy.core_settings().tenants)
    probes = [quotas.acquire("C", 9_000, 0.0) for _ in range(3)]
    assert probes == [fresh.acquire("C", 9_000, 0.0) for _ in range(3)]
    assert [p.ok for p in probes] == [True, True, False]
    for _ in range(2):
        quotas.refund("C", 9_000, 0.0)  # the probes never ran either
    assert c.step().assignments == []  # not reported
    assert c.snapshot().backends["b0"].inflight == 0
    c.arrive(RequestInfo("b", "C", 0, "m", 100, 100))  # the slot is free again
    assert c.step().assignments == [Assignment("b", "b0", 0.0)]


# -- each condition of the short cut, against `arrive` that only queues -----------------


class CutOnOverdue(LimiterBase):
    """Limit 2, cut to 1 by an overdue-first-token sample; alarms after 1 s."""

    def __init__(self) -> None:
        self._limit = 2

    @property
    def limit(self) -> int:
        return self._limit

    def on_sample(self, sample: Sample, now: float) -> None:
        if sample.pending:
            self._limit = 1

    def ttft_alarm_after(self, prefill_tokens: float) -> float | None:
        return 1.0


def run_both(script: list[tuple], limit: int = 1, **kw: Any) -> list[str]:
    """Play `script` on a controller with the short cut and one without, stepping after
    every event but the passing of time; both must say the same at every step. Returns
    the ids dispatched, in order."""
    clock = FakeClock()
    policy = make_policy(limit=limit, reserved=0.0)
    pair = [
        Controller(
            policy.core_settings(), clock, ["b0"], rate_tau_s=1.0, dispatch_on_arrival=flag, **kw
        )
        for flag in (True, False)
    ]
    started: list[str] = []
    for kind, *args in script:
        if kind == "advance":
            clock.advance(args[0])
            continue
        if kind == "arrive":
            rid, tenant, prio, prompt, *rest = args
            deadline = clock.now() + rest[0] if rest else None
            info = RequestInfo(rid, tenant, prio, "m", prompt, 100, client_deadline=deadline)
            answers = [c.arrive(info) for c in pair]
        else:
            call = {"finish": "on_finish", "cancel": "cancel", "first": "on_first_token"}
            extra = (Outcome.OK,) if kind == "finish" else ()
            answers = [getattr(c, call[kind])(args[0], *extra) for c in pair]
        steps = [c.step() for c in pair]
        assert answers[0] == answers[1] and steps[0] == steps[1], (kind, args)
        assert pair[0].snapshot() == pair[1].snapshot()
        started += [a.request_id for a in steps[0].assignments]
    return started


def test_the_pass_raises_the_fair_queue_quantum_as_a_push_would() -> None:
    # A large request passes; later A's small ones share a turn's credit sized by it
    started = run_both(
        [("arrive", "big", "A", 1, 3000), ("finish", "big"), ("arrive", "blk", "D", 1, 100)]
        + [("arrive", f"{t}{i}", t, 1, 100) for t in "AB" for i in range(3)]
        + [("finish", r) for r in ("blk", "A0", "A1", "A2", "B0")]
    )
    assert started == ["big", "blk", "A0", "A1", "A2", "B0", "B1"]


def test_a_round_robin_turn_left_over_by_a_cancel_is_not_skipped() -> None:
    started = run_both(
        [
            ("arrive", "blk", "D", 1, 100),
            ("arrive", "x", "B", 1, 100),  # queued, then cancelled: B keeps its place
            ("cancel", "x"),
            ("finish", "blk"),
            ("arrive", "y", "A", 1, 100),  # goes through the queue, which forgets B
            ("arrive", "a1", "A", 1, 100),
            ("arrive", "b1", "B", 1, 100),
            ("finish", "y"),
        ]
    )
    assert started == ["blk", "y", "a1"]


def test_due_alarms_fire_before_an_arrival_is_placed() -> None:
    def factory(context: LimiterContext, lp: LimiterSettings, initial: int | None) -> Limiter:
        return CutOnOverdue()

    started = run_both(
        [("arrive", "r0", "A", 0, 100), ("advance", 1.5), ("arrive", "r1", "A", 0, 100)],
        limit=2,
        limiter_factory=factory,
    )
    assert started == ["r0"]  # r0's overdue first token cut the limit to 1 first


def test_a_request_its_client_will_not_wait_for_is_dropped_not_placed() -> None:
    clock_script = [
        ("arrive", "r0", "A", 1, 100),
        ("advance", 3.0),
        ("first", "r0"),  # expected TTFT 3 s: P1 (early drop) drops 3 s before deadlines
        ("finish", "r0"),
        ("arrive", "r1", "A", 1, 100, 1.0),  # its client waits 1 s
    ]
    assert run_both(clock_script, ttft_alpha=1.0) == ["r0"]


def test_a_pass_resets_the_aging_guard_as_a_dispatch_would() -> None:
    script: list[tuple] = [("arrive", "blk", "A", 0, 100), ("arrive", "old1", "A", 1, 100)]
    script += [("arrive", "p0", "A", 0, 100), ("arrive", "p1", "A", 0, 100), ("advance", 3.0)]
    script += [("finish", "blk"), ("finish", "p0")]  # two aged P0 turns empty P0's queue
    script += [("cancel", "old1"), ("finish", "p1")]  # the queues are empty, the guard at 2
    script += [("arrive", "q", "A", 0, 100), ("arrive", "old2", "A", 1, 100)]
    script += [("arrive", f"s{i}", "A", 0, 100) for i in range(5)]
    script += [("advance", 3.0)] + [("finish", r) for r in ("q", "s0", "s1", "s2", "s3")]
    started = run_both(script)
    # after the pass P0 has 4 aged turns before P1's, not 2
    assert started == ["blk", "p0", "p1", "q", "s0", "s1", "s2", "s3", "old2"]


# -- a driver that takes placements on arrival and skips quiet steps (the gateway) -----


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    algorithm=st.sampled_from(["fixed", "sluice", "gradient"]),
    limit=st.integers(1, 3),
    ops=st.lists(op, min_size=10, max_size=150),
)
def test_taking_placements_on_arrival_and_skipping_quiet_steps_changes_nothing(
    algorithm: str, limit: int, ops: list[tuple]
) -> None:
    """`arrive(take=True)` and skipping a step while `quiet()` (keeping a timer for the
    times steps return and for `next_alarm_at` after a placement) decide exactly what a
    driver that steps after every event decides: the same starts, refusals and state."""
    clock = FakeClock()
    policy = make_policy(algorithm, limit)
    taker = controller(policy, clock, on_arrival=True)
    stepper = controller(policy, clock, on_arrival=True)
    timer: list[float] = []  # the taker's armed wake-ups
    ids: list[str] = []

    def arm(at: float | None) -> None:
        if at is not None:
            timer.append(at)

    def taker_step() -> tuple[list[Assignment], list[Any]]:
        s = taker.step()
        arm(s.wake_at)
        return s.assignments, s.rejections

    for step in ops:
        kind = step[0]
        taken: list[Assignment] = []
        if kind == "advance":
            clock.advance(step[1])
            if timer and min(timer) <= clock.now():
                # the taker's timer fires: both step (the stepper's own timer would too)
                timer[:] = [t for t in timer if t > clock.now()]
                assert taker_step() == tuple(stepper.step()[:2])
            continue
        if kind == "arrive":
            info = arrival(step, ids, clock.now())
            a = taker.arrive(info, take=True)
            b = stepper.arrive(info)
            assert (a.admitted, a.code, a.retry_after_s) == (b.admitted, b.code, b.retry_after_s)
            if a.assignment is not None:
                taken = [a.assignment]
                arm(taker.next_alarm_at())
        else:
            call = event(step, ids, clock.now())
            if call is None:
                continue
            for c in (taker, stepper):
                getattr(c, call[0])(*call[1])
        expected = stepper.step()
        if taken:
            got: tuple[list[Assignment], list[Any]] = (taken, [])
        elif taker.quiet():
            got = ([], [])
            # a skipped step would have asked for no wake-up before the taker's timer
            assert expected.wake_at is None or (timer and min(timer) <= expected.wake_at)
        else:
            got = taker_step()
        assert got == (expected.assignments, expected.rejections), kind
        assert taker.snapshot() == stepper.snapshot()
        for rid in ids:
            assert taker.state_of(rid) is stepper.state_of(rid)
            assert taker.backend_of(rid) == stepper.backend_of(rid)


def test_a_placement_taken_on_arrival_is_not_reported_again() -> None:
    clock = FakeClock(5.0)
    c = controller(make_policy(limit=1, reserved=0.0), clock, on_arrival=True)
    a = c.arrive(RequestInfo("a", "A", 1, "m", 100, 100), take=True)
    assert a.admitted and a.assignment == Assignment("a", "b0", 0.0)
    assert c.quiet() and c.step() == Step([], [], None)
    b = c.arrive(RequestInfo("b", "A", 1, "m", 100, 100), take=True)
    assert b.assignment == Assignment("b", "b1", 0.0)
    q = c.arrive(RequestInfo("q", "A", 1, "m", 100, 100), take=True)  # no room: queued
    assert q.admitted and q.assignment is None and not c.quiet()
