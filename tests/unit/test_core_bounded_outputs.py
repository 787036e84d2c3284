"""Bounded outputs (core/bounded_outputs.py): past the KV budget's margin and the KV-capped
count only where every request's max_tokens, rounded up to whole blocks, fits the cache."""

from __future__ import annotations

import math

import pytest
from tests.unit.test_core_dispatcher import BudgetLimiter, policy  # tail drop, p0 0.2

from sluice.core.bounded_outputs import block_pad, low_share, outputs_bounded
from sluice.core.clock import FakeClock
from sluice.core.controller import Controller
from sluice.core.limiters import LimiterContext
from sluice.core.settings import LimiterSettings
from sluice.core.types import BackendMetrics, Outcome, RequestInfo


class KvCappedLimiter(BudgetLimiter):
    """A limit held by a KV cap (`limit`) under a looser latency limit, with a budget."""

    def __init__(
        self, limit: int, budget: float, latency_limit: float | None, cut_at: float
    ) -> None:
        super().__init__(limit, budget)
        self._latency = latency_limit
        self._cut_at = cut_at

    @property
    def latency_limit(self) -> float | None:
        return self._latency

    @property
    def last_cut_at(self) -> float:
        return self._cut_at


def gateway(
    *,
    blocks: int = 100,
    block_size: int = 16,
    limit: int = 3,
    latency: float | None = 10.0,
    cut_at: float = -math.inf,
    now: float = 0.0,
    metrics: BackendMetrics | None = None,
) -> Controller:
    """One backend of blocks x block_size KV tokens, its budget 0.8 of them, a limit of 3
    held by the KV cap under a latency limit of 10 (its last cut at `cut_at`), at `now`;
    the tenant "t" has had one answer of its whole max_tokens (100), so its requests are
    expected to run to it."""
    clock = FakeClock(now)
    budget = 0.8 * blocks * block_size

    def factory(
        context: LimiterContext, lp: LimiterSettings, initial: int | None
    ) -> KvCappedLimiter:
        return KvCappedLimiter(limit, budget, latency, cut_at)

    c = Controller(policy(10).core_settings(), clock, ["b0"], limiter_factory=factory)
    scrape = metrics or BackendMetrics(at=now, num_gpu_blocks=blocks, block_size=block_size)
    c.on_metrics("b0", scrape)
    c.arrive(RequestInfo("warm", "t", 0, "m", 100, 100))
    assert [a.request_id for a in c.step().assignments] == ["warm"]
    c.on_finish("warm", Outcome.OK, 100, 100)
    return c


def sent(c: Controller, prio: int, n: int, *, tenant: str = "t", max_tokens: int = 100) -> int:
    """n requests of a 200-token prompt arrive at once: how many go to the backend."""
    for i in range(n):
        c.arrive(RequestInfo(f"{tenant}-{prio}-{i}", tenant, prio, "m", 200, max_tokens))
    return len(c.step().assignments)


def test_p0_fills_the_cache_where_every_bound_fits_and_no_further() -> None:
    # Each request: 200 + 100 = 300 tokens, all of it expected (the tenant's answers run to
    # max_tokens). The budget (1,280 of 1,600) takes 4, the limit 3. At their bounds with a
    # 16-token block's rounding each holds at most 315: five fit the 1,600 (1,575), six not.
    c = gateway()
    assert sent(c, 0, 7) == 5


def test_p1_and_p2_fill_their_share_of_the_cache_at_their_bounds() -> None:
    # low_share(0.2) = 0.75 of 1,600 = 1,200: three requests' 945, not four's 1,260 (the
    # limit's cap_low alone would let 2 go).
    c = gateway()
    assert sent(c, 1, 5) == 3
    # and P0 still finds the room P1 left it: the whole cache (3 + 2 = 5 bounds)
    assert sent(c, 0, 3) == 2


def test_outputs_far_under_max_tokens_keep_the_budget_and_the_limit() -> None:
    # max_tokens 150 against an expected 100 (its tenant's answers): bound 350 against an
    # estimate of 300, past the slack (345); four such bounds would fit the cache (1,460)
    c = gateway()
    assert sent(c, 0, 7, max_tokens=150) == 3


def test_a_cold_tenant_keeps_the_budget_and_the_limit() -> None:
    # nothing of "new" has ended: half its max_tokens expected (250), its bound 300; five
    # such bounds would fit the cache
    c = gateway()
    assert sent(c, 0, 7, tenant="new") == 3


def test_the_engines_block_size_rounds_every_bound() -> None:
    # 128-token blocks (vLLM's CPU backend), 13 of them (1,664 tokens): a bound of 300
    # holds up to 427; three fit (1,281), four (1,708) not. 16-token blocks: five (1,575).
    assert sent(gateway(blocks=13, block_size=128), 0, 7) == 3
    assert sent(gateway(blocks=104, block_size=16), 0, 7) == 5


def test_no_latency_limit_no_count_past_the_limit() -> None:
    # a limiter without a latency control of its own (fixed, gradient): its limit holds
    c = gateway(latency=None)
    assert sent(c, 0, 7) == 3


def test_not_within_ten_seconds_of_a_cut() -> None:
    # a cut says latency holds the batch: the limit and the budget, as without bounds
    assert sent(gateway(cut_at=100.0, now=109.0), 0, 7) == 3
    assert sent(gateway(cut_at=100.0, now=110.0), 0, 7) == 5


@pytest.mark.parametrize(
    ("bounds", "estimates", "bounded"),
    [(300.0, 300.0, True), (345.0, 300.0, True), (346.0, 300.0, False), (0.0, 0.0, False)],
)
def test_outputs_bounded_within_the_slack(bounds: float, estimates: float, bounded: bool) -> None:
    assert outputs_bounded(bounds, estimates) is bounded


def test_block_pad_and_low_share() -> None:
    assert block_pad(None) == 15.0
    assert block_pad(128) == 127.0
    assert low_share(0.2) == pytest.approx(0.75)
    assert low_share(0.9) == 0.0


def test_a_cache_stated_in_tokens_fills_as_one_stated_in_blocks() -> None:
    # SGLang, TGI and llama.cpp state their cache in tokens (no block size: 16 assumed)
    tokens = BackendMetrics(at=0.0, kv_capacity_tokens=1600.0)
    assert sent(gateway(metrics=tokens), 0, 7) == 5
    # an estimate (SGLang 0.4's used / usage) keeps the budget and the limit
    estimate = BackendMetrics(at=0.0, kv_capacity_tokens=1600.0, kv_capacity_estimated=True)
    assert sent(gateway(metrics=estimate), 0, 7) == 3
