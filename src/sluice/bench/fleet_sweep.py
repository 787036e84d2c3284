"""`sluice bench SCENARIO --fleet-sweep`: the fleet against one gateway of the fleet's
combined capacity, as the replica count grows and as the scrape interval stretches.

Two lines of runs, each on the scenario's workload and engines (`fleet.sweep` sets them):
the replica counts at the scenario's scrape interval, and the scrape intervals at the
scenario's replica count. Each row is the `sluice` arm as that fleet beside
`one-gateway` (one controller, no restart) at the same scrape interval, so a row's
goodput ratio says what the split into replicas costs, not what a slower scrape costs
one gateway. Per row: P0's SLO attainment, the engines' preemptions, goodput and its
ratio to one gateway, the most requests one engine ran, how the clients sent back by a
429 fared at its Retry-After, and the CPU seconds of the run.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from sluice.bench.arms import arm_spec
from sluice.bench.fleet import ONE_GATEWAY, fleet_arm
from sluice.bench.metrics import arm_results
from sluice.bench.runner import Plan, Progress, run_plan_arm
from sluice.bench.scenario import FleetSection


def _row(
    plan: Plan,
    section: FleetSection,
    replicas: int,
    interval: float,
    progress: Progress | None,
) -> dict[str, Any]:
    base = arm_spec("sluice", plan.scenario, max_limit=plan.max_limit, static_cap=0)
    spec = fleet_arm(base, section, replicas=replicas, scrape_interval_s=interval)
    cpu = time.process_time()
    run = run_plan_arm(plan, spec, progress, f"fleet R={replicas} scrape {interval:g}s")
    res = arm_results(run, plan.scenario)
    cpu = time.process_time() - cpu
    p0 = res["classes"]["P0"]
    retry = res["retry_admission"]
    return {
        "replicas": replicas,
        "scrape_interval_s": interval,
        "p0_slo": p0["slo_attainment"],
        "p1_slo": res["classes"]["P1"]["slo_attainment"],
        "p2_slo": res["classes"]["P2"]["slo_attainment"],
        "preemptions": res["backend_preemptions"],
        "goodput_tokens_per_s": res["goodput_tokens_per_s"],
        "peak_running": max(run.peak_running, default=0),
        "retry_after_admitted_ratio": retry["ratio"],
        "retry_after_p50_s": retry["retry_after_p50_s"],
        "cpu_s": round(cpu, 1),
    }


def _one_gateway(
    plan: Plan, section: FleetSection, interval: float, progress: Progress | None
) -> dict[str, Any]:
    base = arm_spec(ONE_GATEWAY, plan.scenario, max_limit=plan.max_limit, static_cap=0)
    spec = fleet_arm(base, section, scrape_interval_s=interval)
    cpu = time.process_time()
    run = run_plan_arm(plan, spec, progress, f"one gateway, scrape {interval:g}s")
    res = arm_results(run, plan.scenario)
    return {
        "scrape_interval_s": interval,
        "p0_slo": res["classes"]["P0"]["slo_attainment"],
        "preemptions": res["backend_preemptions"],
        "goodput_tokens_per_s": res["goodput_tokens_per_s"],
        "peak_running": max(run.peak_running, default=0),
        "cpu_s": round(time.process_time() - cpu, 1),
    }


def fleet_sweep(
    plan: Plan, section: FleetSection, progress: Progress | None = None
) -> dict[str, Any]:
    """The two lines of runs (module docstring) around the fleet `section`."""
    sweep = section.sweep
    interval0 = section.scrape_interval or 0.25
    started = time.process_time()
    singles: dict[float, dict[str, Any]] = {}

    def single(interval: float) -> dict[str, Any]:
        if interval not in singles:
            singles[interval] = _one_gateway(plan, section, interval, progress)
        return singles[interval]

    rows: dict[tuple[int, float], dict[str, Any]] = {}
    wanted = [(r, interval0) for r in sweep.replicas]
    wanted += [(section.replicas, s) for s in sweep.scrape_intervals]
    for r, s in wanted:
        if (r, s) in rows:
            continue
        row = _row(plan, section, r, s, progress)
        one = single(s)
        good = one["goodput_tokens_per_s"]
        row["one_gateway_goodput_tokens_per_s"] = good
        row["goodput_vs_one_gateway"] = (
            round(row["goodput_tokens_per_s"] / good, 4) if good else None
        )
        rows[(r, s)] = row
    return {
        "replicas_at_scrape_interval_s": interval0,
        "scrape_intervals_at_replicas": section.replicas,
        "by_replicas": [rows[(r, interval0)] for r in sweep.replicas],
        "by_scrape_interval": [rows[(section.replicas, s)] for s in sweep.scrape_intervals],
        "one_gateway": [singles[s] for s in sorted(singles)],
        "cpu_s": round(time.process_time() - started, 1),
    }


HEAD = [
    "replicas",
    "scrape s",
    "P0 SLO",
    "preemptions",
    "goodput tok/s",
    "vs one gateway",
    "peak running",
    "admitted at Retry-After",
    "CPU s",
]


def sweep_rows(sweep: dict[str, Any], key: str) -> list[list[str]]:
    def pct(x: float | None) -> str:
        return "-" if x is None else f"{100 * x:.1f}%"

    return [
        [
            str(r["replicas"]),
            f"{r['scrape_interval_s']:g}",
            pct(r["p0_slo"]),
            str(r["preemptions"]),
            f"{r['goodput_tokens_per_s']:.0f}",
            pct(r["goodput_vs_one_gateway"]),
            str(r["peak_running"]),
            pct(r["retry_after_admitted_ratio"]),
            f"{r['cpu_s']:g}",
        ]
        for r in sweep[key]
    ]


def plot_sweep(sweep: dict[str, Any], out: Path) -> str:
    """fleet_sweep.png: P0 SLO and goodput against one gateway (left axis), preemptions
    (right axis), against the replica count and against the scrape interval."""
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 3.8))
    for ax, key, x, label, log in (
        (axes[0], "by_replicas", "replicas", "gateway replicas", True),
        (axes[1], "by_scrape_interval", "scrape_interval_s", "scrape interval (s)", True),
    ):
        rows = sweep[key]
        xs = [r[x] for r in rows]
        ax.plot(xs, [100 * (r["p0_slo"] or 0) for r in rows], "o-", label="P0 SLO %")
        ax.plot(
            xs,
            [100 * (r["goodput_vs_one_gateway"] or 0) for r in rows],
            "s-",
            label="goodput % of one gateway",
        )
        ax.axhline(99, color="tab:blue", lw=0.6, ls=":")
        ax.axhline(95, color="tab:orange", lw=0.6, ls=":")
        top = max(100.0, *(100 * (r["goodput_vs_one_gateway"] or 0) for r in rows))
        ax.set_ylim(min(80.0, *(100 * (r["p0_slo"] or 0) for r in rows)) - 2, top + 4)
        ax.set_xlabel(label)
        if log:
            ax.set_xscale("log")
            ax.set_xticks(xs)
            ax.set_xticklabels([f"{v:g}" for v in xs])
        ax2 = ax.twinx()
        ax2.bar(
            xs,
            [r["preemptions"] for r in rows],
            width=[v * 0.15 for v in xs],
            alpha=0.3,
            color="tab:red",
            label="preemptions",
        )
        ax2.set_ylabel("preemptions")
        ax2.set_ylim(bottom=0, top=max(1, *(r["preemptions"] for r in rows)) * 1.2)
        ax.legend(loc="lower left", fontsize=7)
    axes[0].set_title(f"scrape every {sweep['replicas_at_scrape_interval_s']:g} s", fontsize=9)
    axes[1].set_title(f"{sweep['scrape_intervals_at_replicas']} replicas", fontsize=9)
    fig.tight_layout()
    name = "fleet_sweep.png"
    fig.savefig(out / name, dpi=110)
    plt.close(fig)
    return name
