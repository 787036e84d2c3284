"""The burst must-show (issue 4) in virtual time with every backend presenting each
engine's surface (`sluice bench burst --engine NAME`): the controller reads each engine
through that engine's own adapter, with what it lacks (llama.cpp: no latency histograms,
no preemption counter; TGI: no TTFT), under each engine's admission (TensorRT-LLM and TGI
reserve whole requests, llama.cpp has fixed slots, SGLang retracts like vLLM preempts)."""

from __future__ import annotations

from typing import Any

import pytest

from sluice.bench.arms import arm_spec
from sluice.bench.metrics import arm_results
from sluice.bench.runner import make_plan, run_plan_arm
from sluice.bench.scenario import load_scenario
from sluice.core.snapshot import ControllerSnapshot
from sluice.core.types import SIGNALS

ENGINES = ("vllm", "sglang", "trtllm", "llamacpp", "tgi")
Burst = tuple[str, dict[str, Any], ControllerSnapshot]
LACKS = {"llamacpp": {"preemptions", "ttft_p95", "tpot_p95"}, "tgi": {"preemptions", "ttft_p95"}}


@pytest.fixture(scope="module", params=ENGINES)
def burst(request: pytest.FixtureRequest) -> Burst:
    engine = request.param
    plan = make_plan(load_scenario("burst"), engine=engine)
    arm = arm_spec("sluice", plan.scenario, max_limit=plan.max_limit, static_cap=0)
    run = run_plan_arm(plan, arm, None, "sluice")
    assert run.controller_snapshot is not None
    return engine, arm_results(run, plan.scenario), run.controller_snapshot


def test_the_controller_read_each_engine_through_its_adapter(burst: Burst) -> None:
    engine, _, snapshot = burst
    for b in snapshot.backends.values():
        assert b.engine == engine and b.signals is not None
        lacks = {s for s in SIGNALS if not b.signals[s]}
        assert lacks == LACKS.get(engine, set())


def test_p0_keeps_its_slo(burst: Burst) -> None:
    engine, res, _ = burst
    p0 = res["classes"]["P0"]
    assert p0["ttft_slo_attainment"] >= 0.99, (
        f"burst --engine {engine}: {100 * p0['ttft_slo_attainment']:.1f}% of P0 within TTFT "
        f"1 s (want >= 99%); P0 TTFT p95 {p0['ttft_p95_s']} s"
    )


def test_no_preemption(burst: Burst) -> None:
    engine, res, _ = burst
    assert res["backend_preemptions"] == 0, f"burst --engine {engine}: {res['backend_preemptions']}"


def test_p2_refused_before_p1_before_p0(burst: Burst) -> None:
    engine, res, _ = burst
    first = {c: res["classes"][c]["first_rejection_at_s"] for c in ("P0", "P1", "P2")}
    t = {c: float("inf") if v is None else v for c, v in first.items()}
    assert t["P2"] < float("inf"), f"burst --engine {engine}: P2 never refused"
    assert t["P2"] <= t["P1"] <= t["P0"], f"burst --engine {engine}: first refusals {first}"
