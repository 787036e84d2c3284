"""A 2-minute slice of the shipped Azure conversation trace replayed through real `sluice
serve` and `sluice sim` processes agrees with virtual time at the same size (issue 16),
within the tolerance the `burst` comparison uses (test_bench_real.py, docs/bench.md: 0.15
of SLO attainment), for the arm without a control loop and for Sluice."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from sluice.bench.runner import run_virtual
from sluice.bench.scenario import load_scenario
from sluice.cli import main

pytestmark = pytest.mark.integration

# 2 minutes of the trace (from its busiest stretch), its busiest minute at 1.5x the two
# simulators' capacity; lengths x 0.25 for the tiny profile; simulators at full speed so
# that the slice plays in about 35 s.
SLICE = """
name: azure-slice
seed: 1
backends: {count: 2, profile: tiny, speed: 1}
clients:
  P0: {deadline: 30s, retry: {maxAttempts: 3, spread: 0.5}}
  P1: {deadline: 60s, retry: {maxAttempts: 4, spread: 0.5}}
  P2: {deadline: 120s, retry: {maxAttempts: 6, spread: 0.5}}
trace:
  path: azure-conv-2023
  start: 1800s
  duration: 120s
  peak: 1.5
drain: 40s
real:
  backends: {count: 2, profile: tiny, speed: 1}
  lengthScale: 0.25
  durationScale: 1
"""

TOLERANCE = 0.15  # SLO attainment, absolute (the burst comparison's)


@pytest.mark.timeout(600)
def test_a_trace_slice_replayed_for_real_agrees_with_virtual_time(tmp_path: Path) -> None:
    path = tmp_path / "slice.yaml"
    path.write_text(SLICE)
    out = tmp_path / "out"
    code = main(
        [
            "bench",
            str(path),
            "--mode",
            "real",
            "--arms",
            "direct,sluice",
            "--out",
            str(out),
            "--no-plots",
        ]
    )
    assert code == 0
    real = json.loads((out / "results.json").read_text())
    virtual = run_virtual(load_scenario(str(path)).for_real_mode(), ["direct", "sluice"])
    assert real["plan"]["trace"]["requests"] == virtual["plan"]["trace"]["requests"] > 100
    assert real["plan"]["trace"]["time_scale"] == virtual["plan"]["trace"]["time_scale"]
    cpu = real["cpu"]
    context = f"cpu: {cpu}"
    for arm in ("direct", "sluice"):
        r, v = real["arms"][arm], virtual["arms"][arm]
        for c in ("P0", "P1", "P2"):
            got, want = r["classes"][c]["slo_attainment"], v["classes"][c]["slo_attainment"]
            if not cpu["saturated"]:
                assert abs(got - want) <= TOLERANCE, (arm, c, got, want, context)
        if not cpu["saturated"]:
            assert r["tokens_delivered"] == pytest.approx(v["tokens_delivered"], rel=TOLERANCE)
    assert real["arms"]["sluice"]["backend_preemptions"] == 0, context
