"""Where Sluice's concurrency goes below the sweet spot: its arm re-run in virtual time with
one constraint of the control law lifted at a time (the limiter is not changed: these are
keyword arguments of the same `sluice` limiter, `Controller(limiter_kwargs=...)`, and the
policy's `dispatcher.reserved.p0`).

    .venv/bin/python bench/limiter_ablation.py flood [--out reports/ablation-flood.json]
    .venv/bin/python bench/limiter_ablation.py azure-slice [--peak 1.5] [--out FILE.json]

* `flood`: issue 16's real-mode flood (`sluice bench flood`, one `tiny` engine at 0.25x,
  sweet spot 12): the P0 reservation (0.2 / 0) x the limiter's KV budget fraction (0.8 /
  0.95), against LiteLLM's `max_parallel_requests` at 12 (the issue's bar: Sluice's tokens
  delivered >= 95 % of it, running mean >= 85 % of the sweet spot).
* `azure-slice`: 5 minutes of the Azure conversation trace (from 1,650 s, its busiest
  stretch) at `--peak` x capacity on 2 x H100: the default limiter, then without its TPOT
  cut, without its `waiting` cut, without its first-token cuts (TTFT jump and overdue first
  token), and without the three.

Virtual time: the figures do not depend on the machine's load. Prints a Markdown table
(docs/bench.md has the one it measured) and writes the figures as JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import Progress

from sluice.bench.arms import arm_spec, sluice_policy
from sluice.bench.harness import ArmSpec
from sluice.bench.metrics import arm_results
from sluice.bench.runner import make_plan, run_plan_arm
from sluice.bench.scenario import load_scenario

OFF = 1e9  # a threshold no signal reaches

AZURE_VARIANTS: dict[str, dict[str, float]] = {
    "default": {},
    "no TPOT cut": {"tpot_target_s": OFF},
    "no `waiting` cut": {"waiting_tolerance": OFF},
    "no first-token cuts": {"ttft_jump": OFF, "ttft_alarm_ratio": OFF},
    "none of the three": {
        "tpot_target_s": OFF,
        "waiting_tolerance": OFF,
        "ttft_jump": OFF,
        "ttft_alarm_ratio": OFF,
    },
}
FLOOD_VARIANTS = [(0.2, 0.8), (0.2, 0.95), (0.0, 0.8), (0.0, 0.95)]


def _sluice_arm(plan: Any, reserved_p0: float, limiter: dict[str, float]) -> ArmSpec:
    policy = sluice_policy(plan.scenario, plan.max_limit, reserved_p0=reserved_p0)
    return ArmSpec(
        "sluice", policy, controller_kwargs={"limiter_kwargs": {"sluice": dict(limiter)}}
    )


def _figures(plan: Any, run: Any) -> dict[str, Any]:
    r = arm_results(run, plan.scenario, sweet_spots=plan.sweet_spots)
    p0 = r["classes"]["P0"]
    return {
        "running_mean": r["backend_running"]["mean"],
        "tokens_delivered": r["tokens_delivered"],
        "goodput_tokens_per_s": r["goodput_tokens_per_s"],
        "p0_slo": p0["slo_attainment"],
        "p0_ttft_slo": p0["ttft_slo_attainment"],
        "p0_tpot_p95_s": p0["tpot_p95_s"],
        "preemptions": r["backend_preemptions"],
        "cut_reasons": {b: d.get("cut_reasons") for b, d in (r.get("limiters") or {}).items()},
    }


def flood(progress: Progress) -> tuple[dict[str, Any], str]:
    plan = make_plan(load_scenario("flood"))
    spot = plan.sweet_spots[0]
    task = progress.add_task("flood", total=len(FLOOD_VARIANTS) + 1)
    litellm = arm_spec("litellm", plan.scenario, max_limit=plan.max_limit, static_cap=spot)
    ref = _figures(plan, run_plan_arm(plan, litellm))
    progress.advance(task)
    rows = []
    for reserved, fraction in FLOOD_VARIANTS:
        arm = _sluice_arm(plan, reserved, {"kv_budget_fraction": fraction})
        f = _figures(plan, run_plan_arm(plan, arm))
        rows.append({"reserved_p0": reserved, "kv_budget_fraction": fraction, **f})
        progress.advance(task)
    lines = [
        f"| reserved P0 | KV budget fraction | running mean | of the sweet spot ({spot}) "
        "| tokens delivered | vs LiteLLM at the sweet spot | P0 TTFT <= 1 s | preemptions |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['reserved_p0']} | {r['kv_budget_fraction']} | {r['running_mean']:.1f} "
            f"| {100 * r['running_mean'] / spot:.0f} % | {r['tokens_delivered']:,} "
            f"| {100 * r['tokens_delivered'] / ref['tokens_delivered']:.1f} % "
            f"| {100 * r['p0_ttft_slo']:.1f} % | {r['preemptions']} |"
        )
    lines.append(
        f"| LiteLLM at {spot} | - | {ref['running_mean']:.1f} "
        f"| {100 * ref['running_mean'] / spot:.0f} % | {ref['tokens_delivered']:,} | 100 % "
        f"| {100 * ref['p0_ttft_slo']:.1f} % | {ref['preemptions']} |"
    )
    return {"sweet_spot": spot, "litellm": ref, "variants": rows}, "\n".join(lines)


def azure_slice(progress: Progress, peak: float) -> tuple[dict[str, Any], str]:
    scenario = load_scenario(
        "azure-conv", {"trace": {"start": 1650, "duration": 300, "peak": peak}}
    )
    plan = make_plan(scenario)
    task = progress.add_task(f"azure slice, peak {peak}", total=len(AZURE_VARIANTS))
    rows = []
    for name, kwargs in AZURE_VARIANTS.items():
        f = _figures(plan, run_plan_arm(plan, _sluice_arm(plan, 0.2, kwargs)))
        rows.append({"limiter": name, "kwargs": kwargs, **f})
        progress.advance(task)
    lines = [
        "| limiter | running mean | goodput tok/s | P0 SLO | P0 TPOT p95 ms | preemptions |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        tpot = r["p0_tpot_p95_s"]
        lines.append(
            f"| {r['limiter']} | {r['running_mean']:.1f} | {r['goodput_tokens_per_s']:,.0f} "
            f"| {100 * r['p0_slo']:.1f} % | {'-' if tpot is None else f'{1000 * tpot:.0f}'} "
            f"| {r['preemptions']} |"
        )
    return {"peak": peak, "sweet_spot": plan.sweet_spots[0], "variants": rows}, "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("what", choices=["flood", "azure-slice"])
    ap.add_argument("--peak", type=float, default=1.5, help="azure-slice: the busiest minute")
    ap.add_argument("--out", type=Path, help="write the figures here (JSON)")
    args = ap.parse_args(argv)
    console = Console()
    with Progress(console=console) as progress:
        if args.what == "flood":
            doc, table = flood(progress)
        else:
            doc, table = azure_slice(progress, args.peak)
    print(table)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(doc, indent=2))
        console.print(f"figures: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
