"""vegas-seed follows the seed's Go AdaptiveLimiter rule for rule (docs/limiter.md)."""

from __future__ import annotations

import pytest

from sluice.config import LimiterPolicy
from sluice.core.limiters import VegasSeedLimiter, make_limiter
from sluice.core.types import Sample

MS = 1_000_000  # nanoseconds


def test_starts_at_min_with_base_one_hour() -> None:
    lim = VegasSeedLimiter(2, 10)
    assert lim.limit == 2
    assert lim.base_rtt_ns == 3_600_000_000_000
    assert lim.sample_rtt_ns == 0


def test_the_rule_step_by_step() -> None:
    lim = VegasSeedLimiter(2, 10)
    # (rtt ms, baseRTT ns, sampleRTT ns, currentLimit, GetLimit)
    steps = [
        # first sample: sampleRTT = rtt, queueDelay 0 < threshold 10ms -> +1
        (100, 100 * MS, 100_000_000, 3.0, 3),
        (100, 100 * MS, 100_000_000, 4.0, 4),
        # EWMA 0.8*100 + 0.2*200 = 120ms; delay 20ms > 10ms * 1.2 -> *0.8
        (200, 100 * MS, 120_000_000, 3.2, 3),
        # 0.8*120 + 0.2*110 = 118ms; delay 18ms > 12ms -> *0.8
        (110, 100 * MS, 118_000_000, 2.56, 2),
        # 0.8*118 + 0.2*100 = 114.4ms; delay 14.4ms > 12ms -> *0.8
        (100, 100 * MS, 114_400_000, 2.048, 2),
        # 111.52ms: delay 11.52ms is between 10ms and 12ms -> unchanged
        (100, 100 * MS, 111_520_000, 2.048, 2),
        # 109.216ms: delay 9.216ms < 10ms -> +1
        (100, 100 * MS, 109_216_000, 3.048, 3),
        # a new minimum: base 50ms, threshold 5ms; EWMA 97.3728ms -> *0.8
        (50, 50 * MS, 97_372_800, 2.4384, 2),
    ]
    for rtt_ms, base, sample, current, limit in steps:
        lim.on_request_done(rtt_ms * MS)
        assert lim.base_rtt_ns == base
        assert lim.sample_rtt_ns == sample
        assert lim.current_limit == pytest.approx(current, rel=1e-12)
        assert lim.limit == limit


def test_ewma_truncates_toward_zero_like_go_duration() -> None:
    lim = VegasSeedLimiter(1, 10)
    lim.on_request_done(3)
    lim.on_request_done(4)  # 0.8*3 + 0.2*4 = 3.2 -> Duration(3)
    assert lim.sample_rtt_ns == 3
    lim.on_request_done(9)  # 0.8*3 + 0.2*9 = 4.2 -> 4
    assert lim.sample_rtt_ns == 4


def test_delay_equal_to_threshold_leaves_the_limit() -> None:
    lim = VegasSeedLimiter(1, 10)
    lim.on_request_done(100 * MS)  # base 100ms, limit 2
    assert lim.limit == 2
    lim.base_rtt_ns = 100 * MS
    lim.sample_rtt_ns = 112_500_000  # next EWMA: 0.8*112.5 + 0.2*100 = 110ms exactly
    lim.on_request_done(100 * MS)
    assert lim.sample_rtt_ns == 110 * MS  # delay 10ms == threshold: neither branch
    assert lim.current_limit == 2.0


def test_clamps_at_max_and_min() -> None:
    lim = VegasSeedLimiter(2, 4)
    for _ in range(5):
        lim.on_request_done(100 * MS)
    assert lim.limit == 4
    for _ in range(20):
        lim.on_request_done(1000 * MS)
    assert lim.current_limit == 2.0


def test_samples_use_the_whole_request_time() -> None:
    lim = VegasSeedLimiter(1, 10)
    # a first-token sample is not a finished request: ignored
    lim.on_sample(Sample(ttft_s=0.05), 0.0)
    assert lim.sample_rtt_ns == 0
    lim.on_sample(Sample(ttft_s=0.05, tpot_s=0.01, completion_tokens=11, e2e_s=0.15), 0.0)
    assert lim.sample_rtt_ns == 150 * MS
    # without e2e: ttft + tpot * (completion - 1) = 0.1 + 0.02 * 5 = 0.2 s
    lim2 = VegasSeedLimiter(1, 10)
    lim2.on_sample(Sample(ttft_s=0.1, tpot_s=0.02, completion_tokens=6), 0.0)
    assert lim2.sample_rtt_ns == 200 * MS


def test_dropped_samples_are_ignored() -> None:
    lim = VegasSeedLimiter(1, 10)
    lim.on_sample(Sample(e2e_s=0.001, dropped=True), 0.0)
    assert lim.base_rtt_ns == 3_600_000_000_000
    assert lim.limit == 1


def test_factory_builds_it_starting_at_min() -> None:
    lim = make_limiter(
        LimiterPolicy(algorithm="vegas-seed", min_limit=3, initial_limit=8).core_settings()
    )
    assert isinstance(lim, VegasSeedLimiter)
    assert lim.limit == 3
