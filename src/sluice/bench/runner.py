"""A benchmark in virtual time: calibrate capacity, draw the workload once, sweep caps for
the oracle when it is wanted, run every arm on fresh engines, and gather results.json."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from sluice.bench.arms import ARMS, arm_spec, fixed_cap_arm
from sluice.bench.capacity import Capacity, calibrate
from sluice.bench.engine_view import engine_profile
from sluice.bench.fleet import fleet_arm, fleet_results
from sluice.bench.harness import ArmRun, ArmSpec, run_arm
from sluice.bench.metrics import arm_results
from sluice.bench.noise import Jitter
from sluice.bench.objectives import objective_series
from sluice.bench.quota_figures import quota_results
from sluice.bench.replay import plan_trace
from sluice.bench.scenario import Scenario
from sluice.bench.workload import ClientRequest, generate
from sluice.sim.profiles import Profile

# The oracle sweeps caps at multiples of each phase's sweet spot, then refines: the
# scenario's `oracle:` section (scenario.OracleSpec; `scale` has a coarser grid).
# The oracle's cap of a phase must keep P0's SLO attainment at least this high there.
ORACLE_MIN_P0_SLO = 0.99

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
    trace: dict[str, Any] | None = None  # how a trace was replayed (`bench.replay`)
    jitter: Jitter | None = None  # latency noise every arm's run gets (`bench.noise`)

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
            **(
                {
                    "trace": self.trace,
                    "arrivals": arrivals_per_s(self.workload, self.scenario.duration),
                }
                if self.trace is not None
                else {}
            ),
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
    """Capacity, rates and the workload; for a trace scenario, the replay's (its
    `plan.scenario` has the phase in bench time: use it, not the one passed in)."""
    seed = scenario.spec.seed if seed is None else seed
    profile = scenario.spec.backends.build_profile()
    if engine is not None:
        profile = engine_profile(engine, profile)  # calibrated as that engine admits
    if scenario.trace is not None:
        tp = plan_trace(scenario, profile, seed=seed)
        ts = scenario.spec.trace
        assert ts is not None
        info = {
            "source": scenario.trace.source,
            "format": scenario.trace.format,
            "start_s": ts.start,
            "duration_s": round(scenario.trace.duration, 3),
            "requests": len(tp.workload),
            "skipped_rows": scenario.trace.skipped,
            "prompts_clamped": tp.clamped,
            "peak_x_capacity": ts.peak,
            "peak_window_s": ts.peak_window,
            "busiest_rps_trace_time": round(tp.busiest_rps, 3),
            "time_scale": round(tp.time_scale, 4),
            "length_scale": scenario.trace_length_scale,
            "class_rule": (
                {"column": ts.class_column, "values": ts.class_values}
                if ts.class_column
                else {"shares": ts.classes}
            ),
        }
        return Plan(
            tp.scenario,
            profile,
            seed,
            [tp.capacity],
            [tp.rate_rps],
            tp.workload,
            engine,
            trace=info,
        )
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
        jitter=plan.jitter,
        engine=plan.engine,
    )


def oracle_sweep(
    plan: Plan,
    progress: Progress | None = None,
    *,
    factors: tuple[float, ...] | None = None,
    phases: list[int] | None = None,
    extend: int | None = None,
    min_p0_slo: float | None = ORACLE_MIN_P0_SLO,
) -> tuple[list[int], list[dict[str, Any]]]:
    """The best fixed cap of each phase: run the whole scenario with Sluice's dispatcher at
    each candidate cap (multiples of the phases' sweet spots), and for each phase keep the
    cap whose requests arriving in that phase got the most goodput among the caps that
    kept P0's SLO attainment there at `min_p0_slo` or more (None: goodput alone; no cap
    does: the one with the best P0 attainment; ties: fewer preemptions, then the smaller
    cap). When a phase's best cap has no candidate within 25 % above (or below) it, the
    sweep tries 1.25 x (or 0.8 x) that cap too, up to `extend` more rounds: the optimum
    is not left at the edge of the grid. `factors` and `extend` default to the
    scenario's `oracle:` section."""
    spec = plan.scenario.spec.oracle
    factors = spec.factors if factors is None else factors
    extend = spec.extend if extend is None else extend
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
                            "p0_slo_attainment": p["slo_attainment"]["P0"],
                        }
                        for p in res["phases"]
                    ],
                    "wall_s": res["wall_s"],
                }
            )
        caps = [_best_cap(table, i, min_p0_slo) for i in range(len(plan.scenario.phases))]
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


def _p0_ok(row: dict[str, Any], phase: int, min_p0_slo: float | None) -> bool:
    p0 = row["phases"][phase].get("p0_slo_attainment")
    return min_p0_slo is None or p0 is None or p0 >= min_p0_slo


def _best_cap(table: list[dict[str, Any]], phase: int, min_p0_slo: float | None = None) -> int:
    ok = [row for row in table if _p0_ok(row, phase, min_p0_slo)]
    if not ok:  # no cap keeps P0's objective: the one that comes closest
        best = max(
            table,
            key=lambda row: (
                row["phases"][phase].get("p0_slo_attainment") or 0.0,
                row["phases"][phase]["goodput_tokens_per_s"],
                -row["cap"],
            ),
        )
        return int(best["cap"])
    best = max(
        ok,
        key=lambda row: (
            row["phases"][phase]["goodput_tokens_per_s"],
            -row["phases"][phase]["backend_preemptions"],
            -row["cap"],
        ),
    )
    return int(best["cap"])


def oracle_constraint(
    table: list[dict[str, Any]], caps: list[int], min_p0_slo: float | None = ORACLE_MIN_P0_SLO
) -> dict[str, Any]:
    """Whether each phase's oracle cap kept P0's objective (for results.json)."""
    by_cap = {row["cap"]: row for row in table}
    return {
        "min_p0_slo_attainment": min_p0_slo,
        "met_per_phase": [_p0_ok(by_cap[c], i, min_p0_slo) for i, c in enumerate(caps)],
    }


def run_virtual(
    scenario: Scenario,
    arms: list[str] | None = None,
    *,
    seed: int | None = None,
    progress: Progress | None = None,
    cap: int | None = None,
    jitter: Jitter | None = None,
    engine: str | None = None,
    replicas: int | None = None,
    scrape_interval: float | None = None,
    balance: str | None = None,
    fleet_sweep: bool = False,
) -> dict[str, Any]:
    """Run the arms of a scenario in virtual time; the results.json document. `cap`: the
    `static` and `litellm` arms' cap (default: the first phase's sweet spot). `jitter`:
    latency noise between engines and gateway for every run, the oracle's sweep included.
    `engine`: the engine surface every backend presents (sluice.sim.surfaces).
    `replicas`, `scrape_interval`, `balance`: the gateway arms' fleet, in place of the
    scenario's `fleet:` (`bench.fleet`); `fleet_sweep`: then the fleet against one gateway
    over replica counts and scrape intervals (`bench.fleet_sweep`)."""
    started = time.perf_counter()
    arms = list(arms or scenario.spec.arms)
    for a in arms:
        if a not in ARMS:
            raise ValueError(f"unknown arm {a!r}; arms: {', '.join(ARMS)}")
    if progress is not None:
        progress("calibrating capacity", 0.0)
    plan = make_plan(scenario, seed=seed, engine=engine)
    plan.jitter = jitter
    scenario = plan.scenario  # a trace's phase is in bench time only now
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
            static_cap=cap or plan.sweet_spots[0],
            oracle_caps=oracle_caps,
        )
        spec = fleet_arm(
            spec,
            scenario.spec.fleet,
            replicas=replicas,
            scrape_interval_s=scrape_interval,
            balance=balance,
        )
        run = run_plan_arm(plan, spec, progress, a)
        runs[a] = run
        res = arm_results(run, scenario, sweet_spots=plan.sweet_spots, settle_targets=oracle_caps)
        res["series"] = _series_for_json(run)
        # each backend's TPOT and TTFT against the objectives, over time
        res["series"]["objectives"] = objective_series(run, scenario.duration + scenario.spec.drain)
        if spec.policy is not None and spec.gateway is None:
            res["fleet"] = fleet_results(run, spec)
        if run.quotas is not None:
            res["quotas"] = quota_results(run.quotas, scenario.duration)
        if a in ("static", "litellm"):
            res["cap"] = cap or plan.sweet_spots[0]
        if a == "oracle":
            res["caps_per_phase"] = oracle_caps
            assert sweep is not None and oracle_caps is not None
            res["constraint"] = oracle_constraint(sweep, oracle_caps)
        results[a] = res
    fleet_rows = None
    if fleet_sweep:
        from sluice.bench.fleet_sweep import fleet_sweep as run_sweep

        section = scenario.spec.fleet.model_copy(
            update={
                k: v
                for k, v in (
                    ("replicas", replicas),
                    ("scrape_interval", scrape_interval),
                    ("balance", balance),
                )
                if v is not None
            }
        )
        fleet_rows = run_sweep(plan, section, progress)
    return {
        "scenario": scenario.name,
        "description": scenario.spec.description,
        "mode": "virtual",
        "seed": plan.seed,
        "cpu": {"busy_fraction_max": None, "saturated": False},
        **(
            {"jitter": {"p50_s": jitter.p50_s, "p99_s": jitter.p99_s}} if jitter is not None else {}
        ),
        "plan": plan.describe(),
        "slos": {
            c: s.model_dump(exclude_none=True, by_alias=True) for c, s in scenario.slos.items()
        },
        "oracle_sweep": sweep,
        "arms": results,
        **({"fleet_sweep": fleet_rows} if fleet_rows is not None else {}),
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


def _finite(col: list[float]) -> list[float | None]:
    return [None if isinstance(v, float) and math.isinf(v) else v for v in col]


def arrivals_per_s(workload: list[ClientRequest], duration: float) -> dict[str, Any]:
    """Arrivals per second in bins (about 200 of them), for a trace's plot."""
    width = max(1.0, round(duration / 200))
    n = max(1, math.ceil(duration / width))
    counts = [0] * n
    for r in workload:
        counts[min(n - 1, int(r.arrival / width))] += 1
    return {"bin_s": width, "per_s": [round(c / width, 3) for c in counts]}


def _series_for_json(run: ArmRun) -> dict[str, Any]:
    s = dict(run.series)
    s["limit"] = [_finite(col) for col in s["limit"]]  # a peer without a cap: no limit
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
