"""The figures of refused requests and their returns (bench/returns.py), exact."""

from __future__ import annotations

import pytest

from sluice.bench.harness import ReqState
from sluice.bench.returns import hindsight_starts, note_refusal, peak_ratio
from sluice.bench.scenario import Retry
from sluice.bench.workload import ClientRequest


def state(index: int, arrival: float, outcome: str = "ok") -> ReqState:
    spec = ClientRequest(
        index=index,
        request_id=f"r{index}",
        arrival=arrival,
        phase=0,
        priority=1,
        tenant="t",
        weight=1.0,
        prompt_tokens=10,
        max_tokens=10,
        output_tokens=10,
        cancel_after=None,
        deadline=None,
        retry=Retry(max_attempts=3),
    )
    r = ReqState(spec)
    r.outcome = outcome
    return r


def test_hindsight_is_fifo_by_first_arrival_over_the_opportunities() -> None:
    reqs = [state(0, 0.0), state(1, 0.5), state(2, 0.6), state(3, 5.0), state(4, 0.7, "rejected")]
    opps = [0.1, 0.2, 3.0, 4.0, 6.0]
    # r0 takes 0.1; r1 (arrived 0.5) cannot use 0.2, takes 3.0; r2 4.0; r3 (5.0) 6.0; r4
    # was never served: it takes no opportunity
    assert hindsight_starts(reqs, opps) == {0: 0.1, 1: 3.0, 2: 4.0, 3: 6.0}
    assert hindsight_starts(reqs, [0.1]) == {0: 0.1}  # the rest get none


def test_busiest_100ms_against_the_mean_of_the_seconds_with_returns() -> None:
    even = [10.0 + 0.05 * k for k in range(40)]  # 20/s for 2 s
    herd = even + [10.5 + 0.001 * k for k in range(10)]  # ten told the same instant
    quiet = even + [20.0 + 0.05 * k for k in range(40)]  # a gap between two streams
    assert peak_ratio(even, 0.0, 100.0)["ratio"] == pytest.approx(1.0)
    assert peak_ratio(herd, 0.0, 100.0)["busiest_100ms"] == 12
    assert peak_ratio(herd, 0.0, 100.0)["ratio"] == pytest.approx(12 / 2.5)
    got = peak_ratio(quiet, 0.0, 100.0)
    assert got["ratio"] == pytest.approx(1.0)  # the gap does not count as calm
    assert got["ratio_over_span"] == pytest.approx(2 / (80 * 0.1 / 11.95), rel=1e-3)
    assert peak_ratio(even[:5], 0.0, 100.0)["ratio"] is None  # too few to say


def test_a_refusal_records_what_the_next_attempt_sends_back() -> None:
    r = state(0, 0.0)
    note_refusal(r, 1.0, "fast_reject", 4.5, "b-1", 0.2)
    note_refusal(r, 6.0, "cannot_serve_in_time", 30.0)
    assert r.first_refused_at == 1.0
    assert r.ra_given == [4.5]  # a "cannot serve in time" carries no Retry-After
    assert r.booking is None and r.ra_window == 0.0
