"""A backend that other gateway replicas use too (core/dispatcher.py, "Shared backends"):
a replica's claim is often part of one request; a request past it goes on the scrape's
draw, never more than one at a time, and an empty backend is not a free one."""

from __future__ import annotations

from typing import Any

from sluice.config import Policy
from sluice.core.clock import FakeClock
from sluice.core.controller import Controller
from sluice.core.kv_budget import SharedRoom
from sluice.core.limiters import LimiterBase, LimiterContext
from sluice.core.settings import LimiterSettings
from sluice.core.types import Outcome, RequestInfo

COST = 300  # a request of 250 prompt tokens and at most 100 more: 250 + 50 expected


class SharedLimiter(LimiterBase):
    """A claim of `budget` tokens on a backend with `room` tokens of room for us."""

    def __init__(
        self,
        budget: float,
        draw: float,
        room: float = 3000.0,
        floor: float = 0.0,
        first_free: bool = False,
        footprint: float = 0.0,
    ) -> None:
        self.budget = budget
        self.shared: SharedRoom | None = SharedRoom(
            draw, room, 3000.0, floor, first_free, footprint
        )

    @property
    def limit(self) -> int:
        return 8

    @property
    def kv_budget_tokens(self) -> float | None:
        return self.budget

    @property
    def kv_shared(self) -> SharedRoom | None:
        return self.shared


def controller(lim: SharedLimiter, reserved: float = 0.0) -> Controller:
    policy = Policy.model_validate(
        {
            "limiter": {"algorithm": "fixed", "fixedLimit": 8},
            "dispatcher": {"reserved": {"p0": reserved}},
        }
    )

    def factory(context: LimiterContext, lp: LimiterSettings, initial: int | None) -> SharedLimiter:
        return lim

    return Controller(policy.core_settings(), FakeClock(), ["b0"], limiter_factory=factory)


def send(c: Controller, rid: str, prio: int = 0) -> list[str]:
    c.arrive(RequestInfo(rid, "t", prio, "m", COST - 50, 100))
    return [a.request_id for a in c.step().assignments]


def test_a_request_past_a_part_claim_goes_when_the_draw_is_under_the_part() -> None:
    # 100 tokens of claim left, a request of 300: it goes with probability 1/3
    assert send(controller(SharedLimiter(100.0, draw=0.3)), "a") == ["a"]  # 90 < 100
    assert send(controller(SharedLimiter(100.0, draw=0.34)), "a") == []  # 102 >= 100


def test_one_request_past_the_claim_at_most_until_ours_end() -> None:
    c = controller(SharedLimiter(100.0, draw=0.0))
    assert send(c, "a") == ["a"]
    assert send(c, "b") == []  # the claim is spent (and overdrawn): nothing left to draw on
    c.on_finish("a", Outcome.OK, COST - 50, 50)
    assert [a.request_id for a in c.step().assignments] == ["b"]


def test_an_empty_shared_backend_is_not_a_free_one() -> None:
    # nothing of ours in flight, no claim left: the others fill it (alone, it would go)
    assert send(controller(SharedLimiter(0.0, draw=0.0)), "a") == []


def test_a_fresh_gateway_sends_one_request_into_an_idle_backend_without_a_draw() -> None:
    c = controller(SharedLimiter(10.0, draw=0.99, room=float("inf"), first_free=True))
    assert send(c, "a") == ["a"]  # it starts at once
    assert send(c, "b") == []  # the next one is past the claim: the draw decides
    # one that knows the fleet (a count, or scrapes that showed requests) draws
    assert send(controller(SharedLimiter(10.0, draw=0.99, room=float("inf"))), "a") == []


def test_a_p1_request_larger_than_a_typical_one_draws_at_odds_scaled_by_its_size() -> None:
    # a typical request holds 150 tokens, this one 300: P1's half odds times 150 / 300
    # on the 100 left: 25 against 0.08 x 300 = 24, then 27
    assert send(controller(SharedLimiter(100.0, draw=0.08, footprint=150.0)), "a", 1) == ["a"]
    assert send(controller(SharedLimiter(100.0, draw=0.09, footprint=150.0)), "a", 1) == []
    # no larger than a typical one: half odds only (0.16 x 300 = 48 < 50)
    assert send(controller(SharedLimiter(100.0, draw=0.16, footprint=300.0)), "a", 1) == ["a"]
    # P0 keeps its full odds whatever its size (0.3 x 300 = 90 < 100)
    assert send(controller(SharedLimiter(100.0, draw=0.3, footprint=150.0)), "a") == ["a"]


def test_the_request_must_fit_the_room_the_scrape_showed() -> None:
    assert send(controller(SharedLimiter(100.0, draw=0.0, room=COST - 1)), "a") == []
    assert send(controller(SharedLimiter(100.0, draw=0.0, room=COST)), "a") == ["a"]


def test_p1_draws_at_half_the_odds_and_p0_has_its_floor() -> None:
    # P1: 0.2 * 300 = 60 < 100 would go at full odds; at half odds it needs 60 < 50
    assert send(controller(SharedLimiter(100.0, draw=0.2)), "a", prio=1) == []
    assert send(controller(SharedLimiter(100.0, draw=0.15)), "a", prio=1) == ["a"]
    # P0's floor (its replica's part of the whole budget) is a budget of its own
    c = controller(SharedLimiter(0.0, draw=0.99, floor=2 * COST))
    assert send(c, "p1", prio=1) == []
    assert send(c, "a") == ["a"]
    assert send(c, "b") == ["b"]
    assert send(c, "c") == []  # past the floor, on a draw of 0.99


def _limiter_on(running: float, *, share: float, own: int = 0) -> Any:
    from sluice.core.limiters import SluiceLimiter
    from sluice.core.types import BackendMetrics

    lim = SluiceLimiter(1, 64, 8, seed=1)
    lim.on_metrics(BackendMetrics(at=0.0, num_gpu_blocks=256, block_size=16), 0.0)
    lim.on_dispatch(1, COST, 0.0)  # the footprint of a request: 300
    lim.on_release(0, 0.0)
    for n in range(1, own + 1):
        lim.on_dispatch(n, COST, 0.0)
    lim.on_fleet(float(own * COST), share, False)
    m = BackendMetrics(
        at=0.0, running=running, waiting=0.0, kv_usage=0.0, num_gpu_blocks=256, block_size=16
    )
    lim.on_metrics(m, 0.0)
    return lim


def test_a_shared_limiter_keeps_back_the_spread_of_the_replicas_draws() -> None:
    # 4,096 tokens, 80 %: 3,276.8; 16 replicas' draws stray by sqrt(16) / 2 = 2 requests
    lim = _limiter_on(0.0, share=1 / 16)
    shared = lim.kv_shared
    assert shared is not None
    assert shared.full_tokens == 0.8 * 4096 - 2 * COST
    assert shared.room_tokens == float("inf")  # it looked idle
    assert lim.kv_budget_tokens == (0.8 * 4096 - 2 * COST) / 16  # our part of an idle one
    assert shared.floor_tokens == lim.kv_budget_tokens
    assert not shared.first_free  # the controller says when the share is a bare prior
    assert shared.footprint_tokens == COST  # a typical request's, for the draws' odds
    assert lim.limit == 1  # part of a request, rounded up: the budget and the draw decide
    alone = _limiter_on(0.0, share=1.0)
    assert alone.kv_shared is None and alone.kv_budget_tokens == 0.8 * 4096


def _first_choice(seed: str, shared: bool) -> str:
    """Where a replica with this seed sends one request when 8 backends tie."""
    names = [f"b{i}" for i in range(8)]

    def factory(context: LimiterContext, lp: LimiterSettings, initial: int | None) -> SharedLimiter:
        lim = SharedLimiter(1000.0, draw=0.0)
        if not shared:
            lim.shared = None  # a lone gateway
        return lim

    policy = Policy.model_validate({"limiter": {"algorithm": "fixed", "fixedLimit": 8}})
    c = Controller(policy.core_settings(), FakeClock(), names, limiter_factory=factory, seed=seed)
    placed = c.arrive(RequestInfo("a", "t", 0, "m", COST - 50, 100), take=True).assignment
    assert placed is not None
    return placed.backend


def test_replicas_break_ties_between_shared_backends_in_their_own_orders() -> None:
    """Equally loaded by their own counts (nothing of theirs anywhere), replicas would all
    pick the same backend by name; on shared backends each has its own order (a hash of
    its seed and the name), alone the name decides."""
    picks = [_first_choice(f"replica-{k}", shared=True) for k in range(8)]
    assert picks == ["b0", "b3", "b6", "b7", "b4", "b6", "b2", "b3"]  # 6 of the 8 backends
    assert {_first_choice(f"replica-{k}", shared=False) for k in range(8)} == {"b0"}


def test_with_known_peers_a_backend_takes_nothing_before_our_first_scrape_of_it() -> None:
    from sluice.core.types import BackendMetrics

    def fresh(peers: int | None) -> Controller:
        c = Controller(
            Policy.model_validate({"limiter": {"algorithm": "sluice"}}).core_settings(),
            FakeClock(),
            ["b0"],
        )
        if peers is not None:
            c.expect_peers(peers)
        return c

    c = fresh(2)
    assert send(c, "a") == []  # its room is unknown: the others may have filled it
    c.on_metrics("b0", BackendMetrics(at=0.0, running=0.0, waiting=0.0, kv_usage=0.0))
    assert [a.request_id for a in c.step().assignments] == ["a"]
    c = fresh(2)
    assert send(c, "a") == []
    c.metrics_stale("b0")  # no metrics to be had: latency-only control, as alone
    assert [a.request_id for a in c.step().assignments] == ["a"]
    assert send(fresh(1), "a") == ["a"]  # alone by the count
    assert send(fresh(None), "a") == ["a"]  # no count: as before
