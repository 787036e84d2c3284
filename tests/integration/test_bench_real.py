"""`sluice bench --mode real`: real simulators and a real gateway on 127.0.0.1, driven by
the open-loop client; the same results.json schema as virtual time, plus the CPU figures."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from sluice.cli import main

pytestmark = pytest.mark.integration

SMALL = """
name: small-real
backends: {count: 2, profile: tiny}
clients:
  P2: {retry: {maxAttempts: 2, spread: 0.5}}
phases:
  - name: steady
    duration: 2s
    rateRps: 4
    mix: {P0: 0.3, P1: 0.3, P2: 0.4}
    prompt: {dist: uniform, low: 40, high: 80}
    output: {dist: uniform, low: 10, high: 30}
    maxTokens: 64
  - name: burst
    duration: 2s
    rateRps: 15
drain: 10s
real:
  backends: {count: 2, profile: tiny, speed: 0.5}
  lengthScale: 1.0
  durationScale: 1.0
  maxRps: 60
"""


def test_real_mode_writes_the_same_schema_with_cpu_figures(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "small.yaml"
    path.write_text(SMALL)
    out = tmp_path / "out"
    code = main(
        [
            "bench",
            str(path),
            "--mode",
            "real",
            "--arms",
            "direct,sluice,oracle",
            "--out",
            str(out),
            "--no-plots",
        ]
    )
    assert code == 0
    captured = capsys.readouterr()
    assert "oracle: virtual time only, skipped" in captured.err
    results = json.loads((out / "results.json").read_text())
    assert results["mode"] == "real"
    cpu = results["cpu"]
    assert 0.0 < cpu["busy_fraction_max"] <= 1.0 and cpu["samples"] >= 3
    assert cpu["saturated"] == (cpu["busy_fraction_max"] >= 0.9)
    assert list(results["arms"]) == ["direct", "sluice"]
    offered = results["plan"]["requests"]
    assert offered > 10
    for name, arm in results["arms"].items():
        classes = arm["classes"]
        assert sum(c["offered"] for c in classes.values()) == offered
        served = sum(c["completed"] for c in classes.values())
        # a light load with 10 s to drain: nearly everything is served or refused
        refused = sum(c["rejected"] for c in classes.values())
        assert served + refused >= 0.9 * offered, (name, classes)
        assert arm["backend_preemptions"] >= 0
        assert arm["classes"]["P0"]["ttft_p50_s"] is not None
    sluice = results["arms"]["sluice"]
    # the gateway's own state was sampled from its /metrics
    assert any(v > 0 for v in sluice["series"]["limit"][0])
    assert "CPU busy" in (out / "report.md").read_text()
