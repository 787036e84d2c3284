"""`sluice bench SCENARIO`: run a scenario's arms in virtual time (or against real
processes on loopback) and write results.json, PNG plots and report.md."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

import orjson

from sluice.bench.arms import ARMS, VIRTUAL_ONLY
from sluice.bench.scenario import ScenarioError, builtin_scenarios, load_scenario
from sluice.sim.surfaces import SURFACES


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "scenario",
        metavar="SCENARIO",
        help="a built-in scenario (" + ", ".join(builtin_scenarios()) + ") or a YAML file",
    )
    parser.add_argument(
        "--arms",
        help="comma-separated arms to run (default: the scenario's; known: "
        + ", ".join(ARMS)
        + ")",
    )
    parser.add_argument(
        "--mode",
        choices=["virtual", "real"],
        default="virtual",
        help="virtual: discrete-event simulation (default); real: processes on 127.0.0.1",
    )
    parser.add_argument("--out", metavar="DIR", help="output folder (reports/SCENARIO-<time>/)")
    parser.add_argument("--seed", type=int, help="workload seed (the scenario's)")
    parser.add_argument(
        "--engine",
        choices=sorted(SURFACES),
        help="virtual mode: every backend presents this engine's surface (its metrics read "
        "through the gateway's adapter, its admission, its refusals); default vllm's state",
    )
    parser.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    parser.add_argument(
        "--real-size",
        action="store_true",
        help="virtual mode at the size real mode uses (the scenario's `real` section), to "
        "compare the two",
    )


def _arms(args: argparse.Namespace, default: tuple[str, ...]) -> list[str]:
    arms = [a.strip() for a in args.arms.split(",") if a.strip()] if args.arms else list(default)
    unknown = [a for a in arms if a not in ARMS]
    if unknown:
        raise ValueError(f"unknown arm(s) {', '.join(unknown)}; known: {', '.join(ARMS)}")
    if not arms:
        raise ValueError("no arm to run")
    return list(dict.fromkeys(arms))


def run(args: argparse.Namespace) -> int:
    from rich.console import Console

    console = Console()
    if not console.is_terminal:
        console = Console(width=max(console.width, 150))  # the summary table is wide
    err = Console(stderr=True)
    try:
        scenario = load_scenario(args.scenario)
        arms = _arms(args, scenario.spec.arms)
    except ScenarioError as exc:
        err.print(f"[red]{exc.source}: invalid scenario[/red]")
        for line in exc.errors:
            err.print(f"  {line}")
        return 2
    except ValueError as exc:
        err.print(f"[red]sluice bench: {exc}[/red]")
        return 2
    if args.mode == "real" and args.engine:
        err.print(
            "[red]sluice bench: --engine is for virtual mode (real mode: sluice sim "
            "--engine NAME behind sluice serve)[/red]"
        )
        return 2
    if args.mode == "real":
        skipped = [a for a in arms if a in VIRTUAL_ONLY]
        if skipped:
            err.print(f"[yellow]{', '.join(skipped)}: virtual time only, skipped[/yellow]")
        arms = [a for a in arms if a not in VIRTUAL_ONLY]
        if not arms:
            err.print("[red]sluice bench: no arm left to run in real mode[/red]")
            return 2

    stamp = time.strftime("%Y%m%d-%H%M%S")
    out = Path(args.out) if args.out else Path("reports") / f"{scenario.name}-{stamp}"
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        err.print(f"[red]sluice bench: cannot create {out}: {exc.strerror}[/red]")
        return 1

    started = time.perf_counter()
    try:
        results = _run_with_progress(scenario, arms, args, console)
    except KeyboardInterrupt:
        err.print("[yellow]interrupted[/yellow]")
        return 130
    except RuntimeError as exc:  # real mode: processes that would not start, etc.
        err.print(f"[red]sluice bench: {exc}[/red]")
        return 1
    wall = time.perf_counter() - started
    results.setdefault("timing", {})["wall_s"] = round(wall, 2)

    (out / "results.json").write_bytes(orjson.dumps(results, option=orjson.OPT_INDENT_2))
    from sluice.bench.report import write_plots, write_report

    plots = [] if args.no_plots else write_plots(results, out)
    report = write_report(results, out, plots)
    _print_summary(console, results, wall)
    console.print(f"Report: {report}")
    return 0


def _run_with_progress(
    scenario: Any, arms: list[str], args: argparse.Namespace, console: Any
) -> dict[str, Any]:
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    columns = (
        TextColumn("[bold]{task.description:<34}"),
        BarColumn(),
        TextColumn("{task.percentage:>3.0f}%"),
        TimeElapsedColumn(),
    )
    with Progress(*columns, console=console, transient=True) as bar:
        task = bar.add_task(f"{scenario.name}", total=1.0)
        last = [""]

        def progress(label: str, fraction: float) -> None:
            if label != last[0]:
                last[0] = label
                bar.update(task, description=label, completed=0.0)
            bar.update(task, completed=fraction)

        if args.mode == "virtual":
            from sluice.bench.runner import run_virtual

            if args.real_size:
                scenario = scenario.for_real_mode()
            return run_virtual(
                scenario, arms, seed=args.seed, progress=progress, engine=args.engine
            )
        from sluice.bench.real import run_real

        def announce(url: str) -> None:
            console.print(f"Gateway up: watch it live at [bold]{url}/dashboard[/bold]")

        return run_real(scenario, arms, seed=args.seed, progress=progress, on_gateway=announce)


def _print_summary(console: Any, results: dict[str, Any], wall: float) -> None:
    from rich.table import Table

    from sluice.bench.report import summary_rows

    head, rows = summary_rows(results)
    table = Table(title=f"sluice bench {results['scenario']} ({results['mode']}, {wall:.1f} s)")
    for h in head:
        table.add_column(h, justify="left" if h in ("arm", "refusal order") else "right")
    for r in rows:
        table.add_row(*r)
    console.print(table)
    cpu = results.get("cpu") or {}
    if results["mode"] == "real":
        busy = cpu.get("busy_fraction_max")
        if cpu.get("saturated"):
            arms = results["arms"]
            which = [a for a, r in arms.items() if (r.get("cpu") or {}).get("saturated")]
            other = max(
                (
                    (r.get("cpu") or {}).get("cores_used_mean", {}).get("other", 0.0)
                    for r in arms.values()
                ),
                default=0.0,
            )
            console.print(
                f"[bold red]WARNING: the CPU saturated (busy {busy:.0%} max"
                + (f", during {', '.join(which)}" if which else "")
                + f"; other work on the machine used up to {other:.2f} cores): these "
                "figures do not count.[/bold red]"
            )
        elif busy is not None:
            console.print(f"CPU busy (max of the samples): {busy:.0%}")


if __name__ == "__main__":  # pragma: no cover
    from sluice.cli import main

    sys.exit(main(["bench", *sys.argv[1:]]))
