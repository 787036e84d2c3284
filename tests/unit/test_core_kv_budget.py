"""A backend's KV budget and this replica's claim on a shared one (core/kv_budget.py), on
its own and held by a limiter other than sluice's: exact values."""

from __future__ import annotations

import math
import random

import pytest

from sluice.config import Policy
from sluice.core.clock import FakeClock
from sluice.core.controller import Controller
from sluice.core.kv_budget import KvBudget, SharedRoom
from sluice.core.limiters import LimiterBase, LimiterContext
from sluice.core.settings import LimiterSettings
from sluice.core.types import BackendMetrics, RequestInfo

KV = {"num_gpu_blocks": 100, "block_size": 16}  # 1,600 tokens: a budget of 1,280
TINY_KV = {"num_gpu_blocks": 256, "block_size": 16}  # 4,096 tokens: 3,276.8


def scrape(**fields: float) -> BackendMetrics:
    return BackendMetrics(at=0.0, **fields)  # type: ignore[arg-type]


def test_no_budget_before_a_scrape_tells_the_capacity() -> None:
    kv = KvBudget()
    kv.on_dispatch(100)
    assert (kv.tokens, kv.shared, kv.cap()) == (None, None, math.inf)
    kv.on_metrics(scrape(running=1, kv_usage=0.1), 1)  # no capacity in it
    assert (kv.capacity, kv.tokens, kv.cap()) == (None, None, math.inf)
    kv.on_metrics(scrape(**KV), 1)
    assert (kv.capacity, kv.tokens) == (1600.0, 1280.0)
    assert kv.cap() == 12  # floor(1280 / 100)


def test_no_footprint_no_cap() -> None:
    kv = KvBudget(0.5)
    kv.on_metrics(scrape(**KV), 0)
    assert kv.tokens == 800.0 and kv.cap() == math.inf


def test_the_cap_follows_the_larger_of_the_dispatched_and_the_admitted_footprints() -> None:
    admitted: list[float | None] = [None]
    kv = KvBudget(footprint_alpha=0.5, demand_footprint=lambda: admitted[0])
    kv.on_metrics(scrape(**KV), 0)
    kv.on_dispatch(100)
    kv.on_dispatch(300)  # EWMA: 100, then 200
    assert kv.footprint_dispatched == 200.0
    assert kv.cap() == 6  # floor(1280 / 200)
    admitted[0] = 400.0  # longer prompts being admitted: the mix that comes next
    assert kv.cap() == 3
    admitted[0] = 50.0  # shorter ones: the dispatched footprint still counts
    assert kv.cap() == 6


def test_a_request_like_those_in_flight_counts_at_their_projected_part() -> None:
    admitted: list[float | None] = [None]
    kv = KvBudget(footprint_alpha=1.0, demand_footprint=lambda: admitted[0])
    kv.on_metrics(scrape(**KV), 0)
    kv.on_dispatch(100)
    assert kv.on_kv_projection(0.5, 100.0) is True
    assert kv.on_kv_projection(0.5, 100.0) is False  # nothing changed: no recompute
    assert kv.cap() == 25  # floor(1280 / (100 x 0.5))
    admitted[0] = 125.0  # up to 1.25 x those in flight: still like them
    assert kv.cap() == 20  # floor(1280 / 62.5)
    admitted[0] = 126.0  # a new mix: they start together, whole footprints
    assert kv.cap() == 10  # floor(1280 / 126)
    assert kv.on_kv_projection(1.7, 100.0) is True  # clamped to 1
    admitted[0] = None
    assert kv.cap() == 12


# -- shared with other replicas ---------------------------------------------------------


def kept(share: float, footprint: float = 360.0) -> float:
    """3,276.8 less the spread of the replicas' draws: sqrt(1 / share) / 2 footprints."""
    return 3276.8 - 0.5 * math.sqrt(1.0 / share) * footprint


def shared_budget(own: int, share: float, seed: str = "b0") -> KvBudget:
    """A budget with `own` requests of 360 tokens in flight, told its part of the fleet."""
    kv = KvBudget(seed=seed)
    kv.on_metrics(scrape(**TINY_KV), 0)
    for _ in range(own):
        kv.on_dispatch(360)
    kv.on_fleet(float(own * 360), share, False)
    return kv


def test_a_lone_gateway_has_the_whole_budget_and_draws_nothing() -> None:
    kv = shared_budget(3, 1.0)
    kv.on_metrics(scrape(running=9, kv_usage=0.9, **TINY_KV), 3)
    assert kv.tokens == pytest.approx(3276.8) and kv.shared is None
    assert kv.cap() == 9  # floor(3276.8 / 360)
    kv.on_fleet(1080.0, 0.5, False)
    kv.on_metrics(scrape(running=3, kv_usage=0.3, **TINY_KV), 3)
    assert kv.shared is not None
    assert kv.shared.draw == random.Random("b0/fleet").random()  # its first draw


def test_we_claim_our_part_of_the_room_the_others_leave() -> None:
    kv = shared_budget(3, 1 / 3)
    # 9 requests there, 3 ours: the others' 6 hold 6 x 360 (more than the 2,048 - 1,080
    # of the usage not ours); our part of the room: (3 + 4 / 3) / (9 + 4) = 1/3
    kv.on_metrics(scrape(running=8, waiting=1, kv_usage=0.5, **TINY_KV), 3)
    room = kept(1 / 3) - 1080 - 2160  # negative: too many there
    claim = 1080 + room / 3
    assert kv.tokens == pytest.approx(claim)  # 988.3
    assert kv.shared == SharedRoom(
        draw=random.Random("b0/fleet").random(),
        room_tokens=pytest.approx(1080 + room),
        full_tokens=pytest.approx(kept(1 / 3)),
        floor_tokens=pytest.approx(kept(1 / 3) / 3),
        first_free=False,
        footprint_tokens=360.0,
    )
    assert kv.cap() == 3  # ceil(max(988.3, 988.3) / 360): rounded up, the draw decides


def test_p0s_floor_counts_when_the_claim_is_below_it() -> None:
    kv = shared_budget(0, 0.25)
    kv.on_dispatch(300)  # a request's footprint known, none in flight
    kv.on_fleet(0.0, 0.25, False)
    kv.on_metrics(scrape(running=12, kv_usage=0.95, **TINY_KV), 0)  # others overfill it
    assert kv.tokens == 0.0
    floor = 0.25 * kept(0.25, 300.0)  # our part of the fleet of the whole budget: 744.2
    assert kv.shared is not None and kv.shared.floor_tokens == pytest.approx(floor)
    assert kv.cap() == 3  # ceil(744.2 / 300): the floor, not the claim of 0


def test_an_idle_backend_is_claimed_by_fleet_share_and_first_free_without_evidence() -> None:
    kv = shared_budget(0, 1 / 16)
    kv.on_fleet(0.0, 1 / 16, True)  # the share is a bare prior
    kv.on_metrics(scrape(running=0, kv_usage=0.0, **TINY_KV), 0)
    assert kv.tokens == pytest.approx(3276.8 / 16)  # no footprint yet: nothing kept back
    assert kv.shared is not None
    assert (kv.shared.room_tokens, kv.shared.first_free) == (math.inf, True)
    kv.on_fleet(0.0, 1 / 16, False)  # evidence of the fleet: no free first request
    kv.on_metrics(scrape(running=0, kv_usage=0.0, **TINY_KV), 0)
    assert kv.shared is not None and kv.shared.first_free is False


def test_each_fresh_shared_scrape_draws_once_and_stale_metrics_give_the_budget_back() -> None:
    kv = shared_budget(3, 1 / 3, seed="s")
    draws = random.Random("s/fleet")
    for usage in (0.5, 0.6):
        kv.on_metrics(scrape(running=9, kv_usage=usage, **TINY_KV), 3)
        assert kv.shared is not None and kv.shared.draw == draws.random()
    kv.on_metrics_stale()
    assert (kv.tokens, kv.shared) == (pytest.approx(3276.8), None)
    assert kv.cap() == 9  # floor(3276.8 / 360): alone again until the next scrape


# -- any limiter can hold one -------------------------------------------------------------


class BudgetedFixed(LimiterBase):
    """A fixed limit, capped by a KV budget it holds (a limiter other than sluice's)."""

    def __init__(self, limit: int) -> None:
        self.fixed = limit
        self.kv = KvBudget()

    @property
    def limit(self) -> int:
        return int(min(self.fixed, self.kv.cap()))

    @property
    def kv_budget_tokens(self) -> float | None:
        return self.kv.tokens

    @property
    def kv_shared(self) -> SharedRoom | None:
        return self.kv.shared

    def on_dispatch(self, inflight: int, footprint_tokens: int, now: float) -> None:
        self.kv.on_dispatch(footprint_tokens)

    def on_fleet(self, own_kv_tokens: float, share: float, share_fresh: bool) -> None:
        self.kv.on_fleet(own_kv_tokens, share, share_fresh)

    def on_metrics(self, m: BackendMetrics, now: float) -> None:
        self.kv.on_metrics(m, 0)

    def on_metrics_stale(self, now: float) -> None:
        self.kv.on_metrics_stale()


def test_a_fixed_limiter_holding_a_budget_is_capped_by_it() -> None:
    policy = Policy.model_validate(
        {"limiter": {"algorithm": "fixed", "fixedLimit": 8}, "dispatcher": {"reserved": {"p0": 0}}}
    )
    lim = BudgetedFixed(8)

    def factory(context: LimiterContext, lp: LimiterSettings, initial: int | None) -> BudgetedFixed:
        return lim

    clock = FakeClock()
    c = Controller(policy.core_settings(), clock, ["b0"], limiter_factory=factory)
    c.expect_peers(1)  # alone: the whole budget
    c.on_metrics("b0", BackendMetrics(at=0.0, **KV))  # type: ignore[arg-type]
    started = []
    for i in range(6):
        c.arrive(RequestInfo(f"r{i}", "t", 0, "m", 250, 100))  # 300 tokens each
        clock.advance(0.01)
        started += [a.request_id for a in c.step().assignments]
    # 4 x 300 = 1,200 of 1,280: the fifth would pass the budget (and the cap, 4)
    assert started == ["r0", "r1", "r2", "r3"]
    assert c.limits() == {"b0": 4}
    assert c.snapshot().backends["b0"].kv_budget_tokens == 1280.0
