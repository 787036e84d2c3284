"""Dispatcher: strict priority, reserved P0 slots, aging, tenant fairness, backend choice."""

from __future__ import annotations

from typing import Any

from sluice.config import Policy
from sluice.core.backend_state import BackendState
from sluice.core.clock import FakeClock
from sluice.core.controller import Controller
from sluice.core.dispatcher import low_cap, low_kv_share
from sluice.core.kv_budget import SharedRoom
from sluice.core.limiters import LimiterBase, LimiterContext
from sluice.core.request_record import RequestState
from sluice.core.settings import LimiterSettings
from sluice.core.types import Outcome, RequestInfo


def policy(limit: int, reserved: float = 0.2, aging: float = 10.0) -> Policy:
    return Policy.model_validate(
        {
            "queues": [
                {
                    "priority": p,
                    "name": f"q{p}",
                    "maxQueueSize": 10_000,
                    "timeout": "1000s",
                    "dropPolicy": "tail",
                }
                for p in (0, 1, 2)
            ],
            "limiter": {"algorithm": "fixed", "fixedLimit": limit},
            "dispatcher": {"reserved": {"p0": reserved}, "agingAfter": aging},
        }
    )


def req(
    rid: str, prio: int, tenant: str = "t", weight: float = 1.0, model: str = "m", prompt: int = 100
) -> RequestInfo:
    return RequestInfo(rid, tenant, prio, model, prompt, 100, weight=weight)


def ids(assignments: list[Any]) -> list[str]:
    return [a.request_id for a in assignments]


def test_low_cap_rounds_down_but_leaves_one_slot() -> None:
    assert low_cap(10, 0.2) == 8
    assert low_cap(4, 0.2) == 3
    assert low_cap(5, 0.2) == 4
    assert low_cap(1, 0.2) == 1  # a limit of 1 cannot reserve anything
    assert low_cap(10, 0.0) == 10


def test_reserved_slots_keep_room_for_p0() -> None:
    clock = FakeClock()
    c = Controller(policy(limit=10, reserved=0.2).core_settings(), clock, ["b0"])
    for i in range(10):
        c.arrive(req(f"p1-{i}", 1))
    assert len(c.step().assignments) == 8  # P1 may use 10 * (1 - 0.2) slots
    c.arrive(req("p2", 2))
    assert c.step().assignments == []  # P2 neither
    c.arrive(req("p0-a", 0))
    c.arrive(req("p0-b", 0))
    c.arrive(req("p0-c", 0))
    assert ids(c.step().assignments) == ["p0-a", "p0-b"]  # P0 uses the whole limit
    # a P1 request finishes: the slot goes to the waiting P0 request (strict priority)
    c.on_finish("p1-0", Outcome.OK, 100, 10)
    assert ids(c.step().assignments) == ["p0-c"]
    # another: 9 in flight, P1 may not go above 8; nothing moves
    c.on_finish("p1-1", Outcome.OK, 100, 10)
    assert c.step().assignments == []
    c.on_finish("p0-a", Outcome.OK, 100, 10)
    assert c.step().assignments == []  # 8 in flight: still not below 8
    c.on_finish("p0-b", Outcome.OK, 100, 10)
    assert ids(c.step().assignments) == ["p1-8"]  # 7 -> 8 in flight
    c.on_finish("p0-c", Outcome.OK, 100, 10)
    assert ids(c.step().assignments) == ["p1-9"]  # P1 before P2
    c.on_finish("p1-2", Outcome.OK, 100, 10)
    assert ids(c.step().assignments) == ["p2"]
    assert c.snapshot().backends["b0"].inflight == 8


def test_aging_serves_p1_one_in_five_under_a_p0_flood() -> None:
    clock = FakeClock()
    c = Controller(policy(limit=5, reserved=0.2, aging=10.0).core_settings(), clock, ["b0"])
    for i in range(5):
        c.arrive(req(f"busy{i}", 0))
    assert len(c.step().assignments) == 5
    for i in range(40):
        c.arrive(req(f"p0-{i}", 0))
    for i in range(5):
        c.arrive(req(f"p1-{i}", 1))
    inflight = [f"busy{i}" for i in range(5)]
    served: list[tuple[int, str]] = []
    for t in range(1, 31):
        clock.set(float(t))
        c.on_finish(inflight.pop(0), Outcome.OK, 100, 10)
        [a] = c.step().assignments
        inflight.append(a.request_id)
        served.append((t, a.request_id))
    p1 = [(t, rid) for t, rid in served if rid.startswith("p1")]
    # not before P1's oldest has waited more than 10 s; then every fifth dispatch
    assert p1 == [(15, "p1-0"), (20, "p1-1"), (25, "p1-2"), (30, "p1-3")]
    assert c.snapshot().aged_dispatches == 4


def test_aging_does_nothing_when_p0_is_idle() -> None:
    clock = FakeClock()
    c = Controller(policy(limit=5, reserved=0.2, aging=1.0).core_settings(), clock, ["b0"])
    for i in range(6):
        c.arrive(req(f"p1-{i}", 1))
    assert len(c.step().assignments) == 4
    clock.set(5.0)
    assert c.step().assignments == []  # aged, but P0 is empty: P1 keeps to its own slots


def _run_fair(weights: dict[str, float], sends: dict[str, int], ticks: int = 200) -> dict[str, int]:
    clock = FakeClock()
    c = Controller(policy(limit=4, reserved=0.0).core_settings(), clock, ["b0"])
    served = dict.fromkeys(weights, 0)
    inflight: list[str] = []
    n = 0
    for t in range(ticks):
        clock.set(float(t))
        for tenant, k in sends.items():
            for _ in range(k):
                n += 1
                c.arrive(req(f"{tenant}{n}", 1, tenant=tenant, weight=weights[tenant]))
        for rid in inflight:
            # usage as estimated (100 + 50): every request keeps the same token cost, so
            # request shares are token shares
            c.on_finish(rid, Outcome.OK, 100, 50)
        inflight = ids(c.step().assignments)
        for rid in inflight:
            served[rid.rstrip("0123456789")] += 1
    return served


def test_a_flooding_tenant_does_not_starve_another() -> None:
    # capacity 4 per tick; A sends 30, B sends 3 (both above their fair share of 2)
    served = _run_fair({"A": 1.0, "B": 1.0}, {"A": 30, "B": 3})
    total = sum(served.values())
    for tenant in ("A", "B"):
        assert abs(served[tenant] / total - 0.5) <= 0.05  # within 10% of its weight share


def test_weighted_tenants_share_in_proportion_under_a_flood() -> None:
    served = _run_fair({"A": 1.0, "B": 2.0}, {"A": 40, "B": 4})
    total = sum(served.values())
    assert abs(served["A"] / total - 1 / 3) <= 0.1 / 3
    assert abs(served["B"] / total - 2 / 3) <= 0.1 * 2 / 3


def test_backend_choice_least_outstanding_then_tokens_then_name() -> None:
    clock = FakeClock()
    c = Controller(policy(limit=10).core_settings(), clock, ["b2", "b1", "b0"])
    c.arrive(req("big", 0, prompt=1000))
    c.arrive(req("small", 0, prompt=10))
    c.arrive(req("mid", 0, prompt=100))
    got = {a.request_id: a.backend for a in c.step().assignments}
    # all empty: ties on tokens too, so by name; then the emptiest
    assert got == {"big": "b0", "small": "b1", "mid": "b2"}
    c.arrive(req("next", 0))
    # each has 1 in flight; b1 has the fewest estimated tokens (10 + 50)
    assert c.step().assignments[0].backend == "b1"


def test_backend_choice_respects_models_and_health() -> None:
    clock = FakeClock()
    c = Controller(policy(limit=10).core_settings(), clock, ["b0", "b1"])
    c.set_backend_models("b0", ["llama"])
    c.set_backend_models("b1", ["qwen"])
    c.arrive(req("q", 0, model="qwen"))
    c.arrive(req("l", 0, model="llama"))
    assert {a.request_id: a.backend for a in c.step().assignments} == {"q": "b1", "l": "b0"}
    c.set_backend_health("b1", False)
    adm = c.arrive(req("q2", 0, model="qwen"))
    assert not adm.admitted and adm.code == "no_backend"
    assert adm.retry_after_s == 2.0
    c.set_backend_health("b1", True)
    assert c.arrive(req("q3", 0, model="qwen")).admitted
    assert c.step().assignments[0].backend == "b1"


def test_a_blocked_model_does_not_hold_back_other_models() -> None:
    clock = FakeClock()
    c = Controller(policy(limit=1).core_settings(), clock, ["b0", "b1"])
    c.set_backend_models("b0", ["llama"])
    c.set_backend_models("b1", ["qwen"])
    c.arrive(req("l0", 0, model="llama"))
    c.step()
    c.arrive(req("l1", 0, model="llama"))  # P0 waits for b0
    c.arrive(req("q1", 1, model="qwen"))  # P1 on b1 takes nothing P0 waits for
    assert ids(c.step().assignments) == ["q1"]


class BudgetLimiter(LimiterBase):
    def __init__(self, limit: int, budget: float) -> None:
        self._limit = limit
        self._budget = budget

    @property
    def limit(self) -> int:
        return self._limit

    @property
    def kv_budget_tokens(self) -> float | None:
        return self._budget


def budgeted() -> Controller:
    """One backend at a limit of 10 with a KV budget of 1,000 tokens, reserved.p0 0.2."""

    def factory(context: LimiterContext, lp: LimiterSettings, initial: int | None) -> BudgetLimiter:
        return BudgetLimiter(10, 1000.0)

    settings = policy(limit=10, reserved=0.2).core_settings()
    return Controller(settings, FakeClock(), ["b0"], limiter_factory=factory)


def test_p1_fills_nine_tenths_of_a_lone_backends_kv_budget() -> None:
    # reserved.p0 0.2: P1/P2 keep 0.8 of the slots but 0.9 of a lone backend's KV budget
    # (half the reserve in KV): 600 + 250 = 850 tokens of a budget of 1,000 go, + 60 not
    c = budgeted()
    c.arrive(req("a", 0, prompt=550))  # footprint 550 + 50 = 600
    assert ids(c.step().assignments) == ["a"]
    c.arrive(req("p1", 1, prompt=200))  # 250: 850 <= 900 (not <= 800)
    assert ids(c.step().assignments) == ["p1"]
    c.arrive(req("p1-b", 1, prompt=10))  # 60: 910 > 900
    assert c.step().assignments == []


def test_a_shared_backend_keeps_the_whole_reserve_in_kv() -> None:
    b = BackendState("b0", BudgetLimiter(10, 1000.0))
    assert low_kv_share(b, 0.2) == 0.9
    b.kv_shared = SharedRoom(draw=0.5, room_tokens=1000.0, full_tokens=1000.0)
    assert low_kv_share(b, 0.2) == 0.8


def test_kv_budget_holds_requests_that_would_overfill_a_backend() -> None:
    c = budgeted()
    c.arrive(req("a", 0, prompt=550))  # footprint 550 + 50 = 600
    c.arrive(req("b", 0, prompt=550))
    assert ids(c.step().assignments) == ["a"]  # 600 + 600 > 1000
    c.arrive(req("p1", 1, prompt=150))  # 200 tokens: 800 <= 0.9 * 1000 for P1, but
    assert c.step().assignments == []  # P0's blocked "b" comes first
    c.on_finish("a", Outcome.OK, 550, 50)
    # an empty backend takes any request whatever its budget
    c.cancel("b")
    c.arrive(req("huge", 0, prompt=5000))
    assert ids(c.step().assignments) == ["huge"]


class PrefillLimiter(LimiterBase):
    """A fixed limit and a bound on the prompt tokens awaiting their first token."""

    def __init__(self, limit: int, prefill: float) -> None:
        self._limit = limit
        self._prefill = prefill

    @property
    def limit(self) -> int:
        return self._limit

    @property
    def prefill_budget_tokens(self) -> float | None:
        return self._prefill


def test_the_prefill_bound_holds_prompts_until_first_tokens_come_back() -> None:
    clock = FakeClock()

    def factory(
        context: LimiterContext, lp: LimiterSettings, initial: int | None
    ) -> PrefillLimiter:
        return PrefillLimiter(10, 1000.0)

    c = Controller(
        policy(limit=10, reserved=0.2).core_settings(), clock, ["b0"], limiter_factory=factory
    )
    for i in range(4):
        c.arrive(req(f"p1-{i}", 1, prompt=300))
    # 1000 prompt tokens may await their first token: three prompts of 300, not four
    assert ids(c.step().assignments) == ["p1-0", "p1-1", "p1-2"]
    c.arrive(req("p0", 0, prompt=300))
    assert ids(c.step().assignments) == []  # P0 goes first, but within the bound too
    c.on_first_token("p1-0")  # its prompt is no longer waiting: 600 queued
    assert ids(c.step().assignments) == ["p0"]  # strict priority: before p1-3
    c.on_first_token("p1-1")
    assert ids(c.step().assignments) == ["p1-3"]
    # a backend with no prefill queued takes any prompt
    for rid in ("p1-2", "p0", "p1-3"):
        c.on_first_token(rid)
    c.arrive(req("long", 1, prompt=5000))
    assert ids(c.step().assignments) == ["long"]


def test_a_non_streamed_prompt_does_not_hold_the_prefill_bound() -> None:
    # its first token is never seen: counting its prompt until its end would hold the
    # bound for the whole answer
    clock = FakeClock()

    def factory(
        context: LimiterContext, lp: LimiterSettings, initial: int | None
    ) -> PrefillLimiter:
        return PrefillLimiter(10, 1000.0)

    c = Controller(
        policy(limit=10, reserved=0.2).core_settings(), clock, ["b0"], limiter_factory=factory
    )
    c.arrive(RequestInfo("whole", "t", 1, "m", 700, 100, first_token_visible=False))
    c.arrive(req("next", 1, prompt=700))
    assert ids(c.step().assignments) == ["whole", "next"]


def test_a_queued_disconnect_leaves_at_once() -> None:
    clock = FakeClock()
    c = Controller(policy(limit=1).core_settings(), clock, ["b0"])
    c.arrive(req("busy", 1, tenant="A"))
    c.step()
    c.arrive(req("gone", 1, tenant="A"))
    c.arrive(req("stay", 1, tenant="B"))
    assert c.snapshot().classes["P1"].tenants_queued == {"A": 1, "B": 1}
    c.cancel("gone")
    snap = c.snapshot().classes["P1"]
    assert snap.queued == 1
    assert snap.tenants_queued == {"B": 1}
    assert snap.cancelled_queued == 1
    assert c.state_of("gone") is RequestState.GONE
    c.on_finish("busy", Outcome.OK, 100, 10)
    assert ids(c.step().assignments) == ["stay"]
    # late calls for the gone request are no-ops
    c.cancel("gone")
    c.on_first_token("gone")
    c.on_finish("gone", Outcome.OK, 1, 1)
    assert c.snapshot().classes["P1"].finished == {"ok": 1}


def test_cancel_in_flight_frees_the_slot() -> None:
    clock = FakeClock()
    c = Controller(policy(limit=1).core_settings(), clock, ["b0"])
    c.arrive(req("a", 0))
    c.arrive(req("b", 0))
    assert ids(c.step().assignments) == ["a"]
    c.cancel("a")
    assert ids(c.step().assignments) == ["b"]
    assert c.snapshot().backends["b0"].inflight == 1


def test_another_models_request_goes_when_the_heads_model_is_full() -> None:
    """One class, two models on their own backends: while the chat backend is full, the
    embedding behind the queued chat requests takes the embedding backend's free slot
    (a model's backlog does not hold up another model's capacity)."""
    c = Controller(policy(1, reserved=0.0).core_settings(), FakeClock(), ["chat-b", "embed-b"])
    c.set_backend_models("chat-b", ["chat"])
    c.set_backend_models("embed-b", ["embed"])
    for rid, model in (("chat0", "chat"), ("chat1", "chat"), ("embed2", "embed")):
        c.arrive(req(rid, 0, model=model))
    c.arrive(req("chat3", 0, model="chat"))
    placed = [(a.request_id, a.backend) for a in c.step().assignments]
    assert placed == [("chat0", "chat-b"), ("embed2", "embed-b")]
    assert c.state_of("chat1") is RequestState.QUEUED and c.state_of("chat3") is RequestState.QUEUED
    c.on_finish("chat0", Outcome.OK, 100, 10)
    # the chat queue keeps its order
    assert [a.request_id for a in c.step().assignments] == ["chat1"]
