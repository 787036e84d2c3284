"""The P0 reserve follows P0's own demand, with exact values (fake time)."""

from __future__ import annotations

import pytest

from sluice.core.p0_reserve import P0Reserve


def test_no_p0_demand_leaves_the_policy_reserve() -> None:
    r = P0Reserve(0.2)
    assert r.update(0, 9, 0.0) == 0.2
    assert r.update(1, 0, 0.0) == 0.2  # no backend: nothing to share


def test_the_reserve_covers_p0_demand_plus_the_next_arrival() -> None:
    r = P0Reserve(0.2)
    # 5 P0 requests in flight or queued on engines holding 9 at once: (5 + 1) / 9
    assert r.update(5, 9, 0.0) == pytest.approx(6 / 9)
    # never more than `most`: P1 and P2 keep a part
    assert r.update(8, 9, 1.0) == 0.75


def test_the_peak_is_held_through_a_lull_then_follows_the_demand() -> None:
    r = P0Reserve(0.2, hold_s=10.0)
    r.update(5, 9, 0.0)
    assert r.update(0, 9, 9.0) == pytest.approx(6 / 9)  # a lull between two requests
    assert r.update(1, 9, 10.5) == pytest.approx(2 / 9)  # the peak has aged out
    assert r.update(0, 9, 21.0) == 0.2
