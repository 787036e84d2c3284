"""`sluice bench` end to end in virtual time on a small scenario: the files a user gets and
the results.json schema docs/bench.md lists; clear errors for bad input."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from sluice.cli import main

SMALL = """
name: small
description: a small burst on two tiny engines
backends: {count: 2, profile: tiny}
clients:
  P2: {retry: {maxAttempts: 3}}
phases:
  - name: steady
    duration: 3s
    rate: 0.7
    mix: {P0: 0.2, P1: 0.4, P2: 0.4}
    prompt: {dist: lognormal, median: 100, sigma: 0.5, max: 400}
    output: {dist: lognormal, median: 30, sigma: 0.5, max: 120}
    maxTokens: 128
  - name: burst
    duration: 2s
    rate: 3
drain: 20s
"""


@pytest.fixture()
def scenario_file(tmp_path: Path) -> Path:
    path = tmp_path / "small.yaml"
    path.write_text(SMALL)
    return path


def test_bench_writes_results_plots_and_report(
    scenario_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "out"
    assert main(["bench", str(scenario_file), "--out", str(out)]) == 0
    results = json.loads((out / "results.json").read_text())
    assert results["scenario"] == "small" and results["mode"] == "virtual"
    assert results["cpu"] == {"busy_fraction_max": None, "saturated": False}
    assert list(results["arms"]) == ["direct", "static", "fifo", "sluice", "oracle"]
    for arm in results["arms"].values():
        for key in ("goodput_tokens_per_s", "backend_preemptions", "wasted_tokens"):
            assert isinstance(arm[key], int | float)
        assert set(arm["classes"]) == {"P0", "P1", "P2"}
        for c in arm["classes"].values():
            for key in ("completed", "rejected", "ttft_p50_s", "ttft_p95_s", "tpot_p95_s"):
                assert key in c
            assert 0.0 <= c["slo_attainment"] <= 1.0
            assert c["completed"] + c["rejected"] <= c["offered"]
    offered = {sum(c["offered"] for c in a["classes"].values()) for a in results["arms"].values()}
    assert len(offered) == 1  # the same workload for every arm
    assert len(results["arms"]["oracle"]["caps_per_phase"]) == 2
    for png in ("limit_inflight.png", "ttft.png", "queue_depth.png", "kv_usage.png"):
        assert (out / png).read_bytes()[:4] == b"\x89PNG"
    report = (out / "report.md").read_text()
    assert "| sluice |" in report and "![ttft.png](ttft.png)" in report
    printed = capsys.readouterr().out
    assert "sluice bench small (virtual" in printed and "Report:" in printed


def test_bench_runs_only_the_arms_asked_for(scenario_file: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    assert (
        main(
            [
                "bench",
                str(scenario_file),
                "--arms",
                "direct,sluice",
                "--out",
                str(out),
                "--no-plots",
                "--seed",
                "5",
            ]
        )
        == 0
    )
    results = json.loads((out / "results.json").read_text())
    assert list(results["arms"]) == ["direct", "sluice"] and results["seed"] == 5
    assert not list(out.glob("*.png"))


def test_real_size_runs_virtual_time_at_real_modes_size(
    scenario_file: Path, tmp_path: Path
) -> None:
    full, small = tmp_path / "full", tmp_path / "small"
    args = ["bench", str(scenario_file), "--arms", "direct", "--no-plots", "--out"]
    assert main([*args, str(full)]) == 0
    assert main([*args, str(small), "--real-size"]) == 0
    a = json.loads((full / "results.json").read_text())["plan"]
    b = json.loads((small / "results.json").read_text())["plan"]
    # the `real` defaults: prompts and outputs x 0.25, so a backend holds more of them
    assert b["phases"][0]["sweet_spot_per_backend"] > a["phases"][0]["sweet_spot_per_backend"]
    assert b["phases"][-1]["end_s"] == a["phases"][-1]["end_s"]  # durationScale 1


def test_bench_refuses_bad_input(
    scenario_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert (
        main(["bench", str(scenario_file), "--arms", "direct,nope", "--out", str(tmp_path / "x")])
        == 2
    )
    assert "unknown arm(s) nope" in capsys.readouterr().err
    assert main(["bench", "no-such-scenario", "--out", str(tmp_path / "y")]) == 2
    assert "built-in scenarios" in capsys.readouterr().err
    bad = tmp_path / "bad.yaml"
    bad.write_text(SMALL.replace("rate: 3", "rate: 3\n    rateRps: 4"))
    assert main(["bench", str(bad), "--out", str(tmp_path / "z")]) == 2
    assert "phases.1: give exactly one of" in capsys.readouterr().err


def test_bench_sweep_finds_the_sweet_spot_in_closed_loop(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "sweep"
    assert main(["bench", "flood", "--sweep", "--sweep-levels", "10,12,13", "--out", str(out)]) == 0
    doc = json.loads((out / "results.json").read_text())
    v = doc["virtual"]
    assert [r["concurrency"] for r in v["levels"]] == [10, 12, 13]
    # the flood's mix on one tiny engine: 12 in flight is the last level without preemption
    assert (v["sweet_spot"], v["preemptions_from"]) == (12, 13)
    assert doc["calibrated_sweet_spot"] == 12
    assert "virtual: sweet spot 12" in capsys.readouterr().out
    assert (out / "sweep.png").stat().st_size > 0
    assert main(["bench", "flood", "--sweep", "--sweep-levels", "x", "--out", str(out)]) == 2
