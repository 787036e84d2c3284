"""Issue 8 in virtual time: several gateway replicas, each with its own Controller and
limiters, in front of the same simulated engines (`ArmSpec.replicas`), keep the engines
free of preemptions under a burst, as one replica does.

The case mirrors tests/integration/test_replicas.py: two `tiny` engines (4,096 tokens of
KV each; 11 requests of 300 + 60 tokens fill one), requests evenly spaced and spread round
robin over the replicas, each client gone after 5 s. The harness is deterministic, so the
assertion is exact: zero preemptions. Replicas scrape out of step (replica k a k/n of the
interval behind replica 0) and each scrape shows the engine as of its last step, so a
replica can see only its own requests on an engine the others have started to fill.
Up to 8 replicas (each replica may always send one request to an engine with none of
its own, and 11 fill one: 16 replicas can overfill it by that rule alone); with the rule
before the fleet share (an idle engine's floor share of 1/4), 8 replicas had 1 and 2
preemptions."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from sluice.bench.arms import arm_spec
from sluice.bench.harness import ArmRun, ArmSpec
from sluice.bench.metrics import arm_results
from sluice.bench.runner import Plan, make_plan, run_plan_arm
from sluice.bench.scenario import parse_scenario

CASE = """
name: replicas-burst
backends: {{count: 2, profile: tiny}}
tenants: [{{name: agents, priority: 1}}]
clients:
  P1: {{deadline: 5s, retry: {{maxAttempts: 1}}}}
phases:
  - name: burst
    duration: 3s
    rate: {rate}
    process: uniform
    mix: {{P1: 1}}
    prompt: 300
    output: 60
    maxTokens: 60
drain: 10s
"""


def _plan(rate: float) -> Plan:
    return make_plan(parse_scenario(CASE.format(rate=rate)))


def _run(plan: Plan, arm: ArmSpec) -> tuple[ArmRun, dict[str, Any]]:
    run = run_plan_arm(plan, arm, None, arm.name)
    return run, arm_results(run, plan.scenario)


def _sluice(plan: Plan, replicas: int) -> ArmSpec:
    arm = arm_spec("sluice", plan.scenario, max_limit=plan.max_limit, static_cap=0)
    return dataclasses.replace(arm, replicas=replicas)


def test_the_burst_preempts_without_a_gateway() -> None:
    plan = _plan(3.0)
    direct = arm_spec("direct", plan.scenario, max_limit=plan.max_limit, static_cap=0)
    _, res = _run(plan, direct)
    assert res["backend_preemptions"] > 0, "not an overload: the tests below prove nothing"


@pytest.mark.parametrize("rate", [3.0, 4.0])
@pytest.mark.parametrize("replicas", [1, 2, 3, 4, 8])
def test_replicas_keep_the_engines_free_of_preemptions(rate: float, replicas: int) -> None:
    plan = _plan(rate)
    _, res = _run(plan, _sluice(plan, replicas))
    p1 = res["classes"]["P1"]
    assert res["backend_preemptions"] == 0, (
        f"{replicas} replicas, {rate}x burst: {res['backend_preemptions']} preemptions; "
        f"P1 completed {p1['completed']}/{p1['offered']}"
    )
    # protected by serving, not by refusing: at least half of what the engines sustain at
    # their sweet spot over the burst
    sustained = plan.capacities[0].rps * plan.scenario.spec.backends.count
    assert p1["completed"] >= 0.5 * sustained * plan.scenario.duration, p1


def test_each_replica_gets_its_round_robin_share_of_the_attempts() -> None:
    plan = _plan(3.0)
    run, _ = _run(plan, _sluice(plan, 3))
    snapshot = run.controller_snapshot  # replica 0's
    assert snapshot is not None
    n = len(plan.workload)  # no retries: one attempt per request
    assert snapshot.classes["P1"].arrived == (n + 2) // 3


def test_replicas_must_be_at_least_one() -> None:
    with pytest.raises(ValueError, match="replicas"):
        ArmSpec("sluice", replicas=0)
