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
from sluice.bench.fleet import BALANCES
from sluice.bench.noise import parse_jitter
from sluice.bench.scenario import ScenarioError, builtin_scenarios, load_scenario
from sluice.config import CLASS_NAMES, ConfigError, Policy, load_policy, parse_duration
from sluice.sim.surfaces import SURFACES


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "scenario",
        metavar="SCENARIO",
        nargs="?",
        help="a built-in scenario (" + ", ".join(builtin_scenarios()) + ") or a YAML file "
        "(with --trace alone: azure-conv's backends and clients)",
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
    trace = parser.add_argument_group(
        "trace replay (docs/bench.md, Traces)",
        "replay a production trace: the Azure LLM inference trace CSV or BurstGPT's",
    )
    trace.add_argument(
        "--trace",
        metavar="PATH",
        help="the trace file (or azure-conv-2023, shipped with Sluice); replaces the "
        "scenario's phases",
    )
    trace.add_argument("--trace-start", metavar="S", help="slice start, trace seconds (0)")
    trace.add_argument("--trace-duration", metavar="S", help="slice length (to the end)")
    trace.add_argument(
        "--peak",
        type=float,
        metavar="X",
        help="scale time so that the busiest --peak-window offers X x capacity",
    )
    trace.add_argument("--peak-window", metavar="S", help="the busiest window's length (60s)")
    trace.add_argument("--speedup", type=float, metavar="K", help="play the trace K x faster")
    trace.add_argument(
        "--classes",
        metavar="P0=a,P1=b,P2=c",
        help="class shares by a stable hash of each row (default 0.2/0.4/0.4)",
    )
    trace.add_argument(
        "--class-column",
        metavar="COLUMN",
        help="take each request's class from this column (with --class-values)",
    )
    trace.add_argument(
        "--class-values",
        metavar="VALUE=Pn,...",
        help="column value -> class, e.g. GPT-4=P0,ChatGPT=P1",
    )
    parser.add_argument(
        "--cap",
        type=int,
        metavar="N",
        help="the static and litellm arms' cap per backend (default: the first phase's "
        "calibrated sweet spot; give the one a real --sweep found to compare in real mode)",
    )
    parser.add_argument(
        "--jitter",
        metavar="P50_MS,P99_MS",
        help="virtual time: delay each engine step's tokens on their way to the gateway by "
        "a lognormal lag of this median and p99 (a busy machine's event loops; take a real "
        "run's arrival_late figures)",
    )
    parser.add_argument(
        "--sweep",
        action="store_true",
        help="instead of the arms: the sweet spot by a closed-loop sweep of one backend, "
        "virtual time (at real size) and, with --mode real, a real simulator beside it",
    )
    parser.add_argument(
        "--sweep-levels",
        metavar="C,C,...",
        help="concurrency levels to sweep (default: 0.5x to 1.5x the calibrated sweet spot)",
    )
    fleet = parser.add_argument_group(
        "fleets of gateway replicas (docs/bench.md, Fleets)",
        "virtual time: the gateway arms as R replicas in front of the same engines",
    )
    fleet.add_argument(
        "--replicas", type=int, metavar="R", help="gateway replicas (the scenario's fleet)"
    )
    fleet.add_argument(
        "--scrape-interval",
        metavar="S",
        help="how often each replica scrapes each engine, e.g. 250ms (the scenario's; 250ms)",
    )
    fleet.add_argument(
        "--balance",
        choices=BALANCES,
        help="how the Service spreads client connections over the replicas",
    )
    fleet.add_argument(
        "--fleet-sweep",
        action="store_true",
        help="after the arms: the fleet against one gateway at R = 1, 2, 4, 8, 16 and at "
        "scrape intervals 100ms to 2s (the scenario's fleet.sweep), a table and a plot",
    )
    parser.add_argument(
        "--policy",
        metavar="PATH",
        help="judge the run by this policy's per-class objectives (queues[].slo), and run "
        "the arms' gateways with them (default: the scenario's `slos`, else the defaults)",
    )
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


_TRACE_FLAGS = (
    ("trace_start", "start"),
    ("trace_duration", "duration"),
    ("peak", "peak"),
    ("peak_window", "peakWindow"),
    ("speedup", "speedup"),
    ("class_column", "classColumn"),
)


def _pairs(text: str, flag: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for item in text.split(","):
        key, sep, value = item.partition("=")
        if not sep or not key.strip() or not value.strip():
            raise ValueError(f"{flag}: expected KEY=VALUE,... (got {item!r})")
        out[key.strip()] = value.strip()
    return out


def trace_overrides(args: argparse.Namespace) -> dict[str, Any] | None:
    """The command line's trace options as a scenario `trace` mapping (None: none given)."""
    trace: dict[str, Any] = {}
    if args.trace:
        trace["path"] = args.trace
    for attr, key in _TRACE_FLAGS:
        value = getattr(args, attr, None)
        if value is not None:
            trace[key] = value
    if args.classes:
        shares = _pairs(args.classes, "--classes")
        try:
            trace["classes"] = {k: float(v) for k, v in shares.items()}
        except ValueError:
            raise ValueError(f"--classes: shares must be numbers (got {args.classes!r})") from None
    if args.class_values:
        trace["classValues"] = _pairs(args.class_values, "--class-values")
    if args.peak is not None and args.speedup is None:
        trace["speedup"] = None
    if args.speedup is not None and args.peak is None:
        trace["peak"] = None
    return {"trace": trace} if trace else None


def policy_slos(policy: Policy) -> dict[str, Any]:
    """A policy's objectives as a scenario's `slos` section (one source of truth)."""
    return {
        CLASS_NAMES[p]: o.model_dump(by_alias=True, exclude_none=True)
        for p, o in policy.objectives().items()
    }


def run(args: argparse.Namespace) -> int:
    from rich.console import Console

    console = Console()
    if not console.is_terminal:
        console = Console(width=max(console.width, 150))  # the summary table is wide
    err = Console(stderr=True)
    try:
        overrides = trace_overrides(args)
        name = args.scenario
        if name is None:
            if not args.trace:
                raise ValueError("give a SCENARIO, or a --trace to replay")
            name = "azure-conv"  # its backends, clients and arms around the trace
            assert overrides is not None
            stem = Path(args.trace).name.split(".")[0]
            overrides["name"] = f"trace-{stem}"
            overrides["description"] = f"replay of {args.trace}"
        if overrides and not args.trace and load_scenario(name).trace is None:
            raise ValueError("the trace options need --trace or a scenario with a trace")
        if getattr(args, "policy", None):
            overrides = {**(overrides or {}), "slos": policy_slos(load_policy(args.policy))}
        scenario = load_scenario(name, overrides)
        arms = _arms(args, scenario.spec.arms)
        fleet_flags = (args.replicas, args.scrape_interval, args.balance, args.fleet_sweep)
        if args.mode == "real" and any(f not in (None, False) for f in fleet_flags):
            raise ValueError(
                "--replicas, --scrape-interval, --balance and --fleet-sweep are for virtual "
                "mode (real mode: run several sluice serve, tests/integration/test_replicas.py)"
            )
        if args.replicas is not None and not 1 <= args.replicas <= 256:
            raise ValueError("--replicas must be between 1 and 256")
        if args.scrape_interval is not None:
            try:
                args.scrape_interval = parse_duration(args.scrape_interval)
            except ValueError as exc:
                raise ValueError(f"--scrape-interval: {exc}") from None
            if not args.scrape_interval > 0:
                raise ValueError("--scrape-interval must be positive")
        if args.jitter:
            if args.mode == "real":
                raise ValueError("--jitter models noise in virtual time; real mode has its own")
            parse_jitter(args.jitter)
    except ScenarioError as exc:
        err.print(f"[red]{exc.source}: invalid scenario[/red]")
        for line in exc.errors:
            err.print(f"  {line}")
        return 2
    except ConfigError as exc:
        err.print(f"[red]{exc.source}: invalid policy[/red]")
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

    if args.sweep:
        return _run_sweep(scenario, args, console, err, out)
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
            jitter = parse_jitter(args.jitter) if args.jitter else None
            return run_virtual(
                scenario,
                arms,
                seed=args.seed,
                progress=progress,
                cap=args.cap,
                jitter=jitter,
                engine=args.engine,
                replicas=args.replicas,
                scrape_interval=args.scrape_interval,
                balance=args.balance,
                fleet_sweep=args.fleet_sweep,
            )
        from sluice.bench.real import run_real

        def announce(url: str) -> None:
            console.print(f"Gateway up: watch it live at [bold]{url}/dashboard[/bold]")

        return run_real(
            scenario, arms, seed=args.seed, progress=progress, on_gateway=announce, cap=args.cap
        )


def _run_sweep(scenario: Any, args: argparse.Namespace, console: Any, err: Any, out: Path) -> int:
    from rich.table import Table

    from sluice.bench.runner import make_plan
    from sluice.bench.sweep import MEASURE_S, default_levels, sweep_real, sweep_virtual

    small = scenario.for_real_mode() if args.mode == "real" or args.real_size else scenario
    plan = make_plan(small, seed=args.seed)
    small = plan.scenario
    try:
        levels = (
            [int(x) for x in args.sweep_levels.split(",") if x.strip()]
            if args.sweep_levels
            else default_levels(plan.sweet_spots[0])
        )
    except ValueError:
        err.print(f"[red]sluice bench: --sweep-levels: integers, got {args.sweep_levels!r}[/red]")
        return 2
    doc: dict[str, Any] = {
        "scenario": scenario.name,
        "mode": "sweep",
        "calibrated_sweet_spot": plan.sweet_spots[0],
        "virtual": sweep_virtual(small, levels, horizon=MEASURE_S),
    }
    if args.mode == "real":
        with console.status("real closed-loop sweep") as status:

            def progress(label: str, fraction: float) -> None:
                status.update(f"{label} ({100 * fraction:.0f}%)")

            try:
                doc["real"] = sweep_real(
                    small, levels, horizon=MEASURE_S, seed=plan.seed, progress=progress
                )
            except RuntimeError as exc:
                err.print(f"[red]sluice bench: {exc}[/red]")
                return 1
    (out / "results.json").write_bytes(orjson.dumps(doc, option=orjson.OPT_INDENT_2))
    if not args.no_plots:
        from sluice.bench.report import write_sweep_plot

        write_sweep_plot(doc, out)
    table = Table(title=f"closed-loop sweep, {scenario.name} (one backend)")
    table.add_column("in flight", justify="right")
    modes = [m for m in ("virtual", "real") if m in doc]
    for m in modes:
        for h in ("tok/s", "req/s", "preempt", "TPOT p95 ms", "running"):
            table.add_column(f"{m} {h}", justify="right")
    for i, c in enumerate(levels):
        row = [str(c)]
        for m in modes:
            r = doc[m]["levels"][i]
            tpot = r["tpot_p95_s"]
            row += [
                f"{r['tokens_per_s']:.0f}",
                f"{r['rps']:.2f}",
                str(r["preemptions"]),
                "-" if tpot is None else f"{1000 * tpot:.0f}",
                "-" if r["running_mean"] is None else f"{r['running_mean']:.1f}",
            ]
        table.add_row(*row)
    console.print(table)
    for m in modes:
        d = doc[m]
        console.print(
            f"{m}: sweet spot {d['sweet_spot']} (no preemption, TPOT p95 within the P0 SLO), "
            f"throughput knee {d['knee']}, preemptions from {d['preemptions_from']}"
        )
    if "real" in doc:
        cpu = doc["real"]["cpu"]
        console.print(f"CPU busy during the real sweep: max {cpu['busy_fraction_max']}")
    console.print(f"Results: {out / 'results.json'}")
    return 0


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
    sweep = results.get("fleet_sweep")
    if sweep:
        from sluice.bench.fleet_sweep import HEAD, sweep_rows

        for key, title in (("by_replicas", "replicas"), ("by_scrape_interval", "scrape interval")):
            t = Table(title=f"the fleet against one gateway, by {title}")
            for h in HEAD:
                t.add_column(h, justify="right")
            for r in sweep_rows(sweep, key):
                t.add_row(*r)
            console.print(t)
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
