"""The SLO-constrained oracle: per phase, the most goodput among the caps that kept P0's
SLO attainment at 99 % or more."""

from __future__ import annotations

from typing import Any

import pytest

from sluice.bench.runner import _best_cap, oracle_constraint
from sluice.bench.scenario import ScenarioError, load_scenario, parse_scenario


def row(cap: int, *phases: tuple[float, float | None, int]) -> dict[str, Any]:
    return {
        "cap": cap,
        "phases": [
            {"goodput_tokens_per_s": g, "p0_slo_attainment": p0, "backend_preemptions": pre}
            for g, p0, pre in phases
        ],
    }


TABLE = [
    row(100, (900.0, 1.0, 0), (500.0, 0.95, 0)),
    row(200, (1000.0, 0.995, 0), (600.0, 0.97, 0)),
    row(300, (1200.0, 0.98, 0), (700.0, None, 0)),  # the phase had no P0 request
]


def test_the_oracle_does_not_buy_goodput_with_p0() -> None:
    # phase 0: 300 has the most goodput but keeps P0 at 98 %: 200 wins
    assert _best_cap(TABLE, 0, 0.99) == 200
    assert _best_cap(TABLE, 0, None) == 300  # goodput alone (the old oracle)
    # phase 1: no P0 there for cap 300: nothing to keep, its goodput wins
    assert _best_cap(TABLE, 1, 0.99) == 300


def test_with_no_cap_keeping_p0_the_closest_wins_and_results_say_so() -> None:
    table = [row(100, (900.0, 0.9, 0)), row(200, (1000.0, 0.97, 0)), row(300, (1100.0, 0.96, 0))]
    assert _best_cap(table, 0, 0.99) == 200
    assert oracle_constraint(table, [200]) == {
        "min_p0_slo_attainment": 0.99,
        "met_per_phase": [False],
    }
    assert oracle_constraint(TABLE, [200, 300])["met_per_phase"] == [True, True]


def test_scale_sweeps_a_coarser_grid() -> None:
    assert load_scenario("scale").spec.oracle.factors == (0.5, 1.0, 1.5, 2.0)
    assert load_scenario("scale").spec.oracle.extend == 0
    assert load_scenario("burst").spec.oracle.factors == (0.5, 0.7, 0.85, 1.0, 1.15, 1.3, 1.6)


def test_a_bad_oracle_grid_is_refused() -> None:
    base = (
        "name: x\nphases: [{name: a, duration: 1s, rate: 1, mix: {P0: 1},"
        " prompt: 10, output: 10, maxTokens: 10}]\n"
    )
    with pytest.raises(ScenarioError) as exc:
        parse_scenario(base + "oracle: {factors: [1, 0]}\n")
    assert exc.value.errors == ["oracle: factors must be more than zero"]
