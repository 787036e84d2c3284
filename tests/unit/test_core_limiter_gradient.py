"""gradient: Netflix Gradient2Limit, step by step; fixed: a constant."""

from __future__ import annotations

import pytest

from sluice.config import LimiterPolicy
from sluice.core.limiters import FixedLimiter, GradientLimiter, make_limiter
from sluice.core.types import Sample


def test_gradient2_steps() -> None:
    lim = GradientLimiter(1, 100, 10)
    # long = 1.0, short = 1.0: gradient 1; new = 10 + 4 = 14; smoothed 0.8*10 + 0.2*14
    lim.update(1.0, inflight=10)
    assert lim.estimated_limit == pytest.approx(10.8)
    assert lim.limit == 10
    # long = mean(1, 2) = 1.5, short = 2: gradient 0.75; new = 10.8*0.75 + 4 = 12.1
    lim.update(2.0, inflight=10)
    assert lim.estimated_limit == pytest.approx(10.8 * 0.8 + 12.1 * 0.2)
    assert lim.limit == 11
    # app-limited (inflight 3 < 11.06 / 2): the limit stays; long/short = 2.33 > 2 so the
    # long RTT decays by 0.9
    lim.update(0.5, inflight=3)
    assert lim.estimated_limit == pytest.approx(11.06)
    assert lim.long_rtt.value == pytest.approx(3.5 / 3 * 0.9)
    # warm-up mean again: long = (1 + 2 + 0.5 + 4) / 4 = 1.875; gradient clamps at 0.5
    lim.update(4.0, inflight=10)
    assert lim.estimated_limit == pytest.approx(11.06 * 0.8 + (11.06 * 0.5 + 4) * 0.2)
    assert lim.limit == 10


def test_long_rtt_is_an_ewma_after_warmup() -> None:
    lim = GradientLimiter(1, 100, 10, warmup=2, long_window=9)  # factor 2/10
    lim.update(1.0, inflight=10)
    lim.update(1.0, inflight=10)
    lim.update(2.0, inflight=10)
    assert lim.long_rtt.value == pytest.approx(1.0 * 0.8 + 2.0 * 0.2)


def test_gradient_clamps_to_bounds() -> None:
    lim = GradientLimiter(5, 12, 10)
    for _ in range(50):
        lim.update(1.0, inflight=12)
    assert lim.limit == 12
    for _ in range(200):
        lim.update(100.0, inflight=12)
    # gradient floor 0.5 and queue size 4 keep it at the fixed point 8, above min 5
    assert lim.limit == 8


def test_gradient_reads_samples() -> None:
    lim = GradientLimiter(1, 100, 10)
    lim.on_sample(Sample(ttft_s=0.1, inflight=10), 0.0)  # first-token sample: no RTT
    assert lim.estimated_limit == 10.0
    lim.on_sample(Sample(e2e_s=1.0, inflight=10), 0.0)
    assert lim.estimated_limit == pytest.approx(10.8)
    ttft = GradientLimiter(1, 100, 10, rtt="ttft")
    ttft.on_sample(Sample(e2e_s=1.0, ttft_s=0.1, inflight=10), 0.0)  # end sample: skipped
    assert ttft.estimated_limit == 10.0
    ttft.on_sample(Sample(ttft_s=0.1, inflight=10), 0.0)
    assert ttft.estimated_limit == pytest.approx(10.8)


def test_fixed_and_factory() -> None:
    assert FixedLimiter(7).limit == 7
    lim = make_limiter(LimiterPolicy(algorithm="fixed", fixed_limit=5).core_settings())
    lim.on_sample(Sample(e2e_s=100.0, dropped=True), 0.0)
    assert lim.limit == 5
    assert lim.kv_budget_tokens is None
    g = make_limiter(
        LimiterPolicy(algorithm="gradient", initial_limit=9, max_limit=20).core_settings()
    )
    assert isinstance(g, GradientLimiter) and g.limit == 9
    # a hot reload passes the current limit, clamped to the new bounds
    g2 = make_limiter(
        LimiterPolicy(algorithm="gradient", max_limit=20).core_settings(), initial_limit=50
    )
    assert g2.limit == 20
