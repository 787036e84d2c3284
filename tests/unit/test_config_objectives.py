"""Per-class latency objectives in the policy (`queues[].slo`): defaults, validation with
the field path, and the bench judging by the objectives of the policy it runs."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from sluice.bench.arms import fifo_policy, sluice_policy
from sluice.bench.bench_cmd import policy_slos
from sluice.bench.metrics import meets_slo
from sluice.bench.scenario import load_scenario
from sluice.config import DEFAULT_OBJECTIVES, ConfigError, Objective, parse_policy

REPO = Path(__file__).resolve().parents[2]


def _queues(p0_slo: str | None = None, p2_slo: str | None = None) -> str:
    def slo(s: str | None) -> str:
        return "" if s is None else f", slo: {s}"

    return (
        "queues:\n"
        f"  - {{priority: 0, name: a, maxQueueSize: 9, timeout: 8s, dropPolicy: tail"
        f"{slo(p0_slo)}}}\n"
        "  - {priority: 1, name: b, maxQueueSize: 9, timeout: 15s, dropPolicy: tail}\n"
        f"  - {{priority: 2, name: c, maxQueueSize: 9, timeout: 60s, dropPolicy: tail"
        f"{slo(p2_slo)}}}\n"
    )


def test_a_policy_without_objectives_gets_the_bench_defaults() -> None:
    for text in ("", _queues()):
        got = parse_policy(text).objectives()
        assert got == {
            0: Objective(ttft=1.0, tpot=0.1),
            1: Objective(ttft=15.0),
            2: Objective(done_within=60.0),
        }
    assert DEFAULT_OBJECTIVES[0].tpot == 0.1


def test_objectives_are_read_beside_each_queue() -> None:
    policy = parse_policy(_queues("{ttft: 500ms, tpot: 80ms}", "{doneWithin: 2m}"))
    assert policy.queue(0).slo == Objective(ttft=0.5, tpot=0.08)
    assert policy.queue(1).slo == Objective(ttft=15.0)  # left out: its default
    assert policy.queue(2).slo == Objective(done_within=120.0)


@pytest.mark.parametrize(
    ("slo", "error"),
    [
        ("{ttft: 0s}", "queues.0.slo.ttft: an objective must be more than zero, got '0s'"),
        ("{tpot: 0}", "queues.0.slo.tpot: an objective must be more than zero, got 0"),
        ("{tpot: -100ms}", "queues.0.slo.tpot: an objective must be more than zero, got '-100ms'"),
        ("{ttft: -2}", "queues.0.slo.ttft: a duration cannot be negative"),
        (
            "{ttft: 1 sec}",
            "queues.0.slo.ttft: expected a duration such as 8s, 500ms or 1m, got '1 sec'",
        ),
        ("{ttft: [1]}", "queues.0.slo.ttft: expected a duration such as 8s, 500ms or 1m, got [1]"),
        ("{}", "queues.0.slo: an objective needs at least one of ttft, tpot, doneWithin"),
        ("{ttft: 1s, e2e: 5s}", "queues.0.slo.e2e: Extra inputs are not permitted"),
        ("5s", "queues.0.slo: Input should be a valid dictionary or instance of Objective"),
    ],
)
def test_a_bad_objective_is_refused_with_its_field_path(slo: str, error: str) -> None:
    with pytest.raises(ConfigError) as exc:
        parse_policy(_queues(slo))
    assert exc.value.errors == [error]


def test_check_config_refuses_a_zero_objective(tmp_path: Path) -> None:
    bad = tmp_path / "p.yaml"
    bad.write_text(_queues(p2_slo="{doneWithin: 0s}"))
    res = subprocess.run(
        [sys.executable, "-m", "sluice.cli", "check-config", str(bad)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert res.returncode == 1
    assert "queues.2.slo.doneWithin: an objective must be more than zero, got '0s'" in res.stderr


def test_the_example_policy_states_the_defaults() -> None:
    from sluice.config import load_policy

    assert load_policy(REPO / "examples" / "policy.yaml").objectives() == DEFAULT_OBJECTIVES


def test_the_bench_runs_and_judges_by_the_same_objectives() -> None:
    # output-shift's scenario gives P2 two minutes; the gateway it runs aims at that too
    s = load_scenario("output-shift")
    assert s.slos["P2"] == Objective(done_within=120.0)
    for policy in (sluice_policy(s, 64), fifo_policy(s, 64)):
        assert policy.objectives()[2].done_within == 120.0
        assert policy.objectives()[0] == s.slos["P0"]
    # --policy: the bench takes a policy's objectives as the scenario's
    policy = parse_policy(_queues("{ttft: 2s}"))
    s2 = load_scenario("burst", {"slos": policy_slos(policy)})
    assert s2.slos["P0"] == Objective(ttft=2.0)
    assert sluice_policy(s2, 64).queue(0).slo == Objective(ttft=2.0)


def test_done_within_judges_the_whole_request() -> None:
    slo = Objective(done_within=60.0)
    assert meets_slo(None, None, 59.9, slo)
    assert not meets_slo(0.1, 0.01, 60.1, slo)
    assert not meets_slo(None, None, None, slo)
