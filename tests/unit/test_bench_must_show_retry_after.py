"""Issue 17's Must show, in virtual time: a Retry-After that is a promise. On `burst` and
`retry-storm`, of the clients that come back at their Retry-After >= 90 % are admitted on
that return; the median time from first refusal to being served is within 1.5 x the
hindsight earliest for P1 and P2; the busiest 100 ms of returns holds at most 2 x the mean
return rate of the recovery; P0 keeps its SLO. The drain-time rule Sluice had before
(`ra-drain`) is run beside it: it misses the time-to-served figure, so the test can fail.
Thresholds are the issue's; a failure message gives the measured figures."""

from __future__ import annotations

from typing import Any

import pytest

from sluice.bench.arms import arm_spec
from sluice.bench.metrics import arm_results
from sluice.bench.runner import make_plan, run_plan_arm
from sluice.bench.scenario import load_scenario

SCENARIOS = ("burst", "retry-storm")


@pytest.fixture(scope="module")
def results() -> dict[tuple[str, str], dict[str, Any]]:
    out = {}
    for name in SCENARIOS:
        plan = make_plan(load_scenario(name))
        for arm in ("sluice", "ra-drain"):
            spec = arm_spec(arm, plan.scenario, max_limit=plan.max_limit, static_cap=0)
            run = run_plan_arm(plan, spec, None, arm)
            out[(name, arm)] = arm_results(run, plan.scenario)
    return out


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_clients_back_at_their_retry_after_are_admitted(
    results: dict[tuple[str, str], dict[str, Any]], scenario: str
) -> None:
    rt = results[(scenario, "sluice")]["returns"]
    assert rt["came_back_at_retry_after"] > 100, f"{scenario}: hardly anyone came back"
    assert rt["admitted_share"] >= 0.90, (
        f"{scenario}/sluice: {rt['admitted_on_return']} of {rt['came_back_at_retry_after']} "
        f"returns admitted ({100 * rt['admitted_share']:.1f}%, want >= 90%)"
    )


@pytest.mark.parametrize("scenario", SCENARIOS)
@pytest.mark.parametrize("cls", ["P1", "P2"])
def test_refused_requests_are_served_near_the_hindsight_earliest(
    results: dict[tuple[str, str], dict[str, Any]], scenario: str, cls: str
) -> None:
    c = results[(scenario, "sluice")]["returns"]["classes"][cls]
    assert c["served"] > 50, f"{scenario}/{cls}: {c['served']} refused requests served"
    assert c["vs_hindsight_p50"] <= 1.5, (
        f"{scenario}/sluice {cls}: first refusal to served p50 "
        f"{c['refusal_to_served_s']['p50']} s against a hindsight earliest of "
        f"{c['hindsight_s']['p50']} s ({c['vs_hindsight_p50']}x, want <= 1.5x)"
    )


def test_the_rule_before_misses_it(results: dict[tuple[str, str], dict[str, Any]]) -> None:
    c = results[("burst", "ra-drain")]["returns"]["classes"]["P1"]
    assert c["vs_hindsight_p50"] > 1.5, f"burst/ra-drain P1: {c}"


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_returns_do_not_come_back_together(
    results: dict[tuple[str, str], dict[str, Any]], scenario: str
) -> None:
    peak = results[(scenario, "sluice")]["returns"]["returns_peak_recovery"]
    assert peak["ratio"] is not None and peak["ratio"] <= 2.0, (
        f"{scenario}/sluice: the busiest 100 ms of the recovery held "
        f"{peak.get('busiest_100ms')} returns, mean {peak.get('mean_per_100ms')} per 100 ms "
        f"({peak['ratio']}x, want <= 2x)"
    )


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_p0_keeps_its_slo_and_nothing_is_preempted(
    results: dict[tuple[str, str], dict[str, Any]], scenario: str
) -> None:
    res = results[(scenario, "sluice")]
    p0 = res["classes"]["P0"]
    assert p0["ttft_slo_attainment"] >= 0.99, f"{scenario}/sluice P0: {p0}"
    assert res["backend_preemptions"] == 0
    assert res["refusal_order"].startswith("P2<P1"), res["refusal_order"]
