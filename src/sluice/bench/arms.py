"""The arms every benchmark compares (docs/bench.md), as gateway policies.

* `direct`: no gateway; round robin straight to the backends.
* `static`: the fixed limiter at the first phase's sweet spot (what an operator who
  measured the first phase would configure); one FIFO class (every request priority 0,
  one tenant, tail drop, a queue as large as the three default queues together with the
  longest default timeout); no reservation.
* `fifo`: the same single FIFO class, with the adaptive `sluice` limiter.
* `sluice`: everything on, the policy's defaults (classes, reservation, drop policies).
* `slo`: `sluice` with the `slo` limiter (steered by the classes' objectives).
* `oracle`: Sluice's classes and dispatcher with a fixed cap per phase, the best one a
  sweep over caps found for that phase (`bench.runner.oracle_sweep`).
* `one-gateway`: `sluice` as one gateway where the scenario runs a fleet of replicas
  (`fleet:`): the same engines, scrapes and clients, one controller (`bench.fleet`).
* `gie`, `gie-flow`, `litellm`, `envoy`: the peers' own decisions (`bench.peers`); LiteLLM's
  `max_parallel_requests` is the first phase's sweet spot, as `static`'s cap.
* `ra-drain`, `ra-60s`, `ra-1s`: `sluice` with another Retry-After rule, to compare with
  its return slots: the drain-time rule Sluice had before them, always 60 s, always 1 s
  (`retryAfter.rule: drain | fixed`; no booking, so no returns lane).

Adaptive arms get `limiter.maxLimit` = the engine's `max_num_seqs`: the policy's default of
256 would hold an H100 below its sweet spot, and a limit above max_num_seqs means nothing.
"""

from __future__ import annotations

from typing import Any

from sluice.bench.fleet import ONE_GATEWAY
from sluice.bench.harness import ArmSpec
from sluice.bench.peers import PEER_ARMS, peer_arm
from sluice.bench.scenario import Scenario
from sluice.config import CLASS_NAMES, DEFAULT_QUEUES, Policy

# the Retry-After rules `sluice` is compared with (docs/bench.md, "Refusals and returns")
RETRY_AFTER_ARMS: dict[str, dict[str, Any]] = {
    "ra-drain": {"rule": "drain"},
    "ra-60s": {"rule": "fixed", "fixedSeconds": 60},
    "ra-1s": {"rule": "fixed", "fixedSeconds": 1},
}
# the limiter that was the default before issue 19 (a fixed TPOT target), to compare with
TPOT_TARGET = "tpot-target"
ARMS = (
    "direct",
    "static",
    "fifo",
    "sluice",
    "slo",
    TPOT_TARGET,
    "oracle",
    ONE_GATEWAY,
    *PEER_ARMS,
    *RETRY_AFTER_ARMS,
)
VIRTUAL_ONLY = frozenset({"oracle"})

FIFO_QUEUE_SIZE = sum(q.max_queue_size for q in DEFAULT_QUEUES)
FIFO_TIMEOUT_S = max(q.timeout for q in DEFAULT_QUEUES)


def _tenants(scenario: Scenario) -> list[dict[str, Any]]:
    out = []
    for t in scenario.spec.tenants:
        tenant: dict[str, Any] = {
            "name": t.name,
            "apiKeys": [f"sk-bench-{t.name}"],
            "priority": t.priority,
            "weight": t.weight,
        }
        for key, value in (
            ("tokensPerMinute", t.tokens_per_minute),
            ("requestsPerMinute", t.requests_per_minute),
            ("maxConcurrency", t.max_concurrency),
        ):
            if value:
                tenant[key] = value
        out.append(tenant)
    return out


def _queues(scenario: Scenario) -> list[dict[str, Any]]:
    """The default queues, each with the objective the scenario judges its class by: the
    gateway aims at what the bench measures (one source of truth)."""
    out = []
    scale = scenario.spec.queue_scale
    for q in DEFAULT_QUEUES:
        d = q.model_dump(by_alias=True, exclude_none=True)
        d["maxQueueSize"] = round(q.max_queue_size * scale)
        d["slo"] = scenario.slos[CLASS_NAMES[q.priority]].model_dump(
            by_alias=True, exclude_none=True
        )
        out.append(d)
    return out


def sluice_policy(
    scenario: Scenario,
    max_limit: int,
    retry_after: dict[str, Any] | None = None,
    *,
    reserved_p0: float | None = None,
    **limiter: Any,
) -> Policy:
    """The `sluice` arm's policy: the defaults, with the scenario's objectives;
    `retry_after` replaces the Retry-After rule (the `ra-*` arms); `reserved_p0` the
    dispatcher's P0 reservation (experiments: bench/limiter_ablation.py)."""
    initial = min(8, max_limit)
    doc: dict[str, Any] = {
        "queues": _queues(scenario),
        "tenants": _tenants(scenario),
        "limiter": {"maxLimit": max_limit, "initialLimit": initial, **limiter},
    }
    if reserved_p0 is not None:
        doc["dispatcher"] = {"reserved": {"p0": reserved_p0}}
    if retry_after is not None:
        doc["retryAfter"] = retry_after
    return Policy.model_validate(doc)


def fifo_policy(scenario: Scenario, max_limit: int, **limiter: Any) -> Policy:
    queues = _queues(scenario)
    queues[0] = {
        "priority": 0,
        "name": "fifo",
        "maxQueueSize": round(FIFO_QUEUE_SIZE * scenario.spec.queue_scale),
        "timeout": FIFO_TIMEOUT_S,
        "dropPolicy": "tail",
        "slo": queues[0]["slo"],  # one class: held to the tightest objective
    }
    initial = min(8, max_limit)
    return Policy.model_validate(
        {
            "queues": queues,
            "tenants": [{"name": "all", "priority": 0, "apiKeys": ["sk-bench-all"]}],
            "dispatcher": {"reserved": {"p0": 0.0}},
            "limiter": {"maxLimit": max_limit, "initialLimit": initial, **limiter},
        }
    )


def fixed(cap: int, max_limit: int) -> dict[str, Any]:
    return {"algorithm": "fixed", "fixedLimit": cap, "maxLimit": max(max_limit, cap)}


def arm_spec(
    name: str,
    scenario: Scenario,
    *,
    max_limit: int,
    static_cap: int,
    oracle_caps: list[int] | None = None,
) -> ArmSpec:
    if name == "direct":
        return ArmSpec("direct")
    if name == "static":
        return ArmSpec(
            "static", fifo_policy(scenario, max_limit, **fixed(static_cap, max_limit)), True
        )
    if name == "fifo":
        return ArmSpec("fifo", fifo_policy(scenario, max_limit), True)
    if name in ("sluice", ONE_GATEWAY):
        return ArmSpec(name, sluice_policy(scenario, max_limit))
    if name == "slo":
        return ArmSpec("slo", sluice_policy(scenario, max_limit, algorithm="slo"))
    if name == TPOT_TARGET:
        return ArmSpec(name, sluice_policy(scenario, max_limit, algorithm="sluice"))
    if name in RETRY_AFTER_ARMS:
        return ArmSpec(name, sluice_policy(scenario, max_limit, RETRY_AFTER_ARMS[name]))
    if name == "oracle":
        if oracle_caps is None:
            raise ValueError("the oracle arm needs its caps (run the sweep first)")
        policies = tuple(
            sluice_policy(scenario, max_limit, **fixed(c, max_limit)) for c in oracle_caps
        )
        return ArmSpec("oracle", policies[0], phase_policies=policies)
    if name in PEER_ARMS:
        return peer_arm(name, cap=static_cap, seed=scenario.spec.seed)
    raise ValueError(f"unknown arm {name!r}; arms: {', '.join(ARMS)}")


def fixed_cap_arm(scenario: Scenario, cap: int, max_limit: int) -> ArmSpec:
    """Sluice's classes and dispatcher with one fixed cap (a point of the oracle sweep)."""
    return ArmSpec(f"cap-{cap}", sluice_policy(scenario, max_limit, **fixed(cap, max_limit)))
