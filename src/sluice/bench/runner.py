"""A benchmark in virtual time: calibrate capacity, draw the workload once, sweep caps for
the oracle when it is wanted, run every arm on fresh engines, and gather results.json."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from sluice.bench.arms import ARMS, arm_spec, fixed_cap_arm
from sluice.bench.capacity import Capacity, calibrate
from sluice.bench.engine_view import engine_profile
from sluice.bench.harness import ArmRun, ArmSpec, run_arm
from sluice.bench.metrics import arm_results
from sluice.bench.scenario import Scenario
from sluice.bench.workload import ClientRequest, generate
from sluice.sim.profiles import Profile

# The oracle sweeps caps at these multiples of each phase's sweet spot, then refines.
ORACLE_FACTORS = (0.5, 0.7, 0.85, 1.0, 1.15, 1.3, 1.6)
ORACLE_EXTEND = 2

Progress = Callable[[str, float], None]  # (what, fraction done 0..1)


@dataclass
class Plan:
    scenario: Scenario
    profile: Profile
    seed: int
    capacities: list[Capacity]  # per phase, per backend
    rates_rps: list[float]  # per phase, all backends
    workload: list[ClientRequest]
    engine: str | None = None  # the engine surface every backend presents

    @property
    def sweet_spots(self) -> list[int]:
        return [c.sweet_spot for c in self.capacities]

    @property
    def max_limit(self) -> int:
        return self.profile.max_num_seqs

    def describe(self) -> dict[str, Any]:
        n = self.scenario.spec.backends.count
        return {
            "backends": n,
            "profile": self.profile.name,
            "engine": self.engine or "vllm",
            "requests": len(self.workload),
            "phases": [
                {
                    "name": p.name,
                    "start_s": p.start,
                    "end_s": p.end,
                    "rate_x_capacity": p.rate,
                    "offered_rps": round(rps, 2),
                    "capacity_rps": round(c.rps * n, 2),
                    "sweet_spot_per_backend": c.sweet_spot,
                }
                for p, c, rps in zip(
                    self.scenario.phases, self.capacities, self.rates_rps, strict=True
                )
            ],
        }


def make_plan(scenario: Scenario, *, seed: int | None = None, engine: str | None = None) -> Plan:
    seed = scenario.spec.seed if seed is None else seed
    profile = scenario.spec.backends.build_profile()
    if engine is not None:
        profile = engine_profile(engine, profile)  # calibrated as that engine admits
    n = scenario.spec.backends.count
    tpot_slo = scenario.slos["P0"].tpot
    routes = scenario.spec.routes
    capacities = [calibrate(profile, p, tpot_slo, routes=routes) for p in scenario.phases]
    rates = [
        p.rate_rps if p.rate_rps is not None else (p.rate or 0.0) * c.rps * n
        for p, c in zip(scenario.phases, capacities, strict=True)
    ]
    workload = generate(scenario, rates, seed=seed, max_model_len=profile.max_model_len)
    return Plan(scenario, profile, seed, capacities, rates, workload, engine)


def run_plan_arm(
    plan: Plan, arm: ArmSpec, progress: Progress | None = None, label: str = ""
) -> ArmRun:
    """One arm on the plan's workload (fresh engines)."""
    horizon = plan.scenario.duration + plan.scenario.spec.drain

    def tick(t: float) -> None:
        if progress is not None:
            progress(label, min(1.0, t / horizon))

    series_interval = max(0.25, plan.scenario.duration / 800)
    return run_arm(
        plan.scenario,
        plan.workload,
        arm,
        plan.profile,
        seed=plan.seed,
        series_interval=series_interval,
        progress=tick,
        engine=plan.engine,
    )


def oracle_sweep(
    plan: Plan,
    progress: Progress | None = None,
    *,
    factors: tuple[float, ...] = ORACLE_FACTORS,
    phases: list[int] | None = None,
    extend: int = ORACLE_EXTEND,
) -> tuple[list[int], list[dict[str, Any]]]:
    """The best fixed cap of each phase: run the whole scenario with Sluice's dispatcher at
    each candidate cap (multiples of the phases' sweet spots), and for each phase keep the
    cap whose requests arriving in that phase got the most goodput (ties: fewer
    preemptions, then the smaller cap). When a phase's best cap has no candidate within
    25 % above (or below) it, the sweep tries 1.25 x (or 0.8 x) that cap too, up to
    `extend` more rounds: the optimum is not left at the edge of the grid."""
    wanted = [i for i in range(len(plan.scenario.phases)) if phases is None or i in phases]

    def clamp(c: float) -> int:
        return max(1, min(plan.max_limit, round(c)))

    todo = sorted({clamp(plan.sweet_spots[i] * f) for i in wanted for f in factors})
    table: list[dict[str, Any]] = []
    done: set[int] = set()
    caps: list[int] = []
    for _round in range(extend + 1):
        for cap in todo:
            label = f"oracle sweep {len(done) + 1} (cap {cap})"
            arm = fixed_cap_arm(plan.scenario, cap, plan.max_limit)
            res = arm_results(run_plan_arm(plan, arm, progress, label), plan.scenario)
            done.add(cap)
            table.append(
                {
                    "cap": cap,
                    "phases": [
                        {
                            "goodput_tokens_per_s": p["goodput_tokens_per_s"],
                            "backend_preemptions": p["backend_preemptions"],
                        }
                        for p in res["phases"]
                    ],
                    "wall_s": res["wall_s"],
                }
            )
        caps = [_best_cap(table, i) for i in range(len(plan.scenario.phases))]
        more: set[int] = set()
        for i in wanted:
            c = caps[i]
            if not any(c < d <= 1.3 * c for d in done):
                more.add(clamp(1.25 * c))
            if not any(0.77 * c <= d < c for d in done):
                more.add(clamp(0.8 * c))
        todo = sorted(more - done)
        if not todo:
            break
    table.sort(key=lambda row: row["cap"])
    return caps, table


def _best_cap(table: list[dict[str, Any]], phase: int) -> int:
    best = max(
        table,
        key=lambda row: (
            row["phases"][phase]["goodput_tokens_per_s"],
            -row["phases"][phase]["backend_preemptions"],
            -row["cap"],
        ),
    )
    return int(best["cap"])


def run_virtual(
    scenario: Scenario,
    arms: list[str] | None = None,
    *,
    seed: int | None = None,
    progress: Progress | None = None,
    engine: str | None = None,
) -> dict[str, Any]:
    """Run the arms of a scenario in virtual time; the results.json document. `engine`:
    the engine surface every backend presents (sluice.sim.surfaces)."""
    started = time.perf_counter()
    arms = list(arms or scenario.spec.arms)
    for a in arms:
        if a not in ARMS:
            raise ValueError(f"unknown arm {a!r}; arms: {', '.join(ARMS)}")
    if progress is not None:
        progress("calibrating capacity", 0.0)
    plan = make_plan(scenario, seed=seed, engine=engine)
    calibrated = time.perf_counter()
    oracle_caps: list[int] | None = None
    sweep: list[dict[str, Any]] | None = None
    if "oracle" in arms:
        oracle_caps, sweep = oracle_sweep(plan, progress)
    results: dict[str, Any] = {}
    runs: dict[str, ArmRun] = {}
    for a in arms:
        spec = arm_spec(
            a,
            scenario,
            max_limit=plan.max_limit,
            static_cap=plan.sweet_spots[0],
            oracle_caps=oracle_caps,
        )
        run = run_plan_arm(plan, spec, progress, a)
        runs[a] = run
        res = arm_results(run, scenario, sweet_spots=plan.sweet_spots, settle_targets=oracle_caps)
        res["series"] = _series_for_json(run)
        if a == "static":
            res["cap"] = plan.sweet_spots[0]
        if a == "oracle":
            res["caps_per_phase"] = oracle_caps
        results[a] = res
    return {
        "scenario": scenario.name,
        "description": scenario.spec.description,
        "mode": "virtual",
        "seed": plan.seed,
        "cpu": {"busy_fraction_max": None, "saturated": False},
        "plan": plan.describe(),
        "slos": {c: s.model_dump(exclude_none=True) for c, s in scenario.slos.items()},
        "oracle_sweep": sweep,
        "arms": results,
        "timing": {
            "calibration_s": round(calibrated - started, 2),
            "total_s": round(time.perf_counter() - started, 2),
        },
    }


MAX_TTFT_POINTS = 4000  # per class, in results.json and the plot


def _thin(points: list[Any], limit: int) -> list[Any]:
    """Every k-th point so that at most `limit` remain (evenly over time)."""
    if len(points) <= limit:
        return points
    step = len(points) / limit
    return [points[int(i * step)] for i in range(limit)]


def _series_for_json(run: ArmRun) -> dict[str, Any]:
    s = dict(run.series)
    # TTFT per class over time: (time of the first token, TTFT from the first attempt)
    ttft: dict[str, list[tuple[float, float]]] = {"P0": [], "P1": [], "P2": []}
    for r in run.requests:
        if r.first_token_at is not None and r.outcome in ("ok", "cancelled"):
            ttft[r.spec.class_name].append(
                (round(r.first_token_at, 3), round(r.first_token_at - r.spec.arrival, 4))
            )
    s["ttft"] = {c: _thin(pts, MAX_TTFT_POINTS) for c, pts in ttft.items()}
    s["backends"] = run.backend_names
    return s
