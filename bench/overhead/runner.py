"""Runner of the proxy overhead benchmark; `run.py` is its command line (see its docstring)."""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import orjson
from arms import (
    API_KEY,
    HERE,
    LABELS,
    MODEL,
    VENV_BIN,
    Arm,
    ArmSkipped,
    start_arm,
    start_upstream,
)
from report import MODES, aggregate, chart, markdown
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from sluice.bench.procfs import BusySampler, cpu_seconds, process_tree

# The gateway's server stack, chosen by this benchmark (docs/decisions.md).
CHOSEN_STACK = "aiohttp"
DEFAULT_ARMS = "direct,passthrough,nginx,sluice"
SATURATED = 0.9  # mean busy fraction of a phase above which we call the CPU saturated


def loadgen_command(
    url: str, mode: str, n: int, concurrency: int, chunks: int, interval_ms: float
) -> list[str]:
    """loadgen.py against `url` with the benchmark's model and key."""
    cmd = [sys.executable, str(HERE / "loadgen.py"), "--url", url, "--mode", mode]
    cmd += ["--requests", str(n), "--concurrency", str(concurrency), "--chunks", str(chunks)]
    cmd += ["--interval-ms", str(interval_ms), "--model", MODEL, "--api-key", API_KEY]
    return cmd


def run_phase(
    arm: Arm, upstream: Arm, mode: str, n: int, args: argparse.Namespace
) -> dict[str, Any]:
    # "serial" is the non-streaming load one request at a time: latency without queueing.
    gen_mode, conc = ("json", 1) if mode == "serial" else (mode, args.concurrency)
    cmd = loadgen_command(arm.url, gen_mode, n, conc, args.chunks, args.interval_ms)
    gen = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert gen.stdin is not None and gen.stdout is not None
    if gen.stdout.readline().strip() != "READY":
        gen.kill()
        raise RuntimeError("load generator failed to start")
    # Workers may come and go (granian respawns, nginx reloads): list the tree each time.
    pids = process_tree(arm.pid) if arm.pid else []
    up_pids = process_tree(upstream.pid) if upstream.pid else []
    cpu0, up0 = cpu_seconds(pids), cpu_seconds(up_pids)
    with BusySampler() as busy:
        gen.stdin.write("go\n")
        gen.stdin.flush()
        line = gen.stdout.readline()
        cpu1, up1 = cpu_seconds(pids), cpu_seconds(up_pids)
    if gen.wait() != 0 or not line:
        raise RuntimeError(f"load generator failed on {arm.name}/{mode} (exit {gen.returncode})")
    result = orjson.loads(line)
    return {
        "arm": arm.name,
        "mode": mode,
        "cpu_s": cpu1 - cpu0 if arm.pid else None,
        "upstream_cpu_s": up1 - up0,
        "busy_mean": busy.mean,
        "busy_max": busy.max,
        **result,
    }


def main() -> int:
    parser = argparse.ArgumentParser(
        description=sys.modules["__main__"].__doc__ or __doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--requests",
        type=int,
        default=2000,
        help="non-streaming requests per arm and round (streams N/4, paced N/10, serial N/2)",
    )
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--chunks", type=int, default=64, help="SSE chunks per stream")
    parser.add_argument("--interval-ms", type=float, default=10.0, help="pace of paced streams")
    parser.add_argument(
        "--arms", default=DEFAULT_ARMS, help=f"comma list of: {', '.join(LABELS)}, passthrough"
    )
    parser.add_argument("--modes", default=",".join(MODES), help="comma list of: json,stream,paced")
    parser.add_argument("--nginx-workers", type=int, default=1)
    parser.add_argument(
        "--sluice-config",
        type=Path,
        default=None,
        help="policy for the sluice arm (default examples/policy.yaml)",
    )
    parser.add_argument(
        "--sluice-bin", type=Path, default=VENV_BIN / "sluice", help="the sluice executable"
    )
    parser.add_argument(
        "--baseline-bin",
        type=Path,
        default=None,
        help="the sluice executable of the sluice-before arm (e.g. main's tree's)",
    )
    parser.add_argument("--out", type=Path, default=HERE / "out")
    args = parser.parse_args()

    console = Console()
    arm_names = [CHOSEN_STACK if a == "passthrough" else a for a in args.arms.split(",") if a]
    arm_names = list(dict.fromkeys(arm_names))
    modes = [m for m in args.modes.split(",") if m]
    counts = {
        "json": args.requests,
        "stream": max(args.concurrency, args.requests // 4),
        "paced": max(args.concurrency, args.requests // 10),
        "serial": max(1, args.requests // 2),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    labels = {a: LABELS.get(a, a) for a in arm_names}
    if CHOSEN_STACK in labels and "passthrough" in args.arms.split(","):
        labels[CHOSEN_STACK] += " (pass-through floor)"

    running: list[Arm] = []
    skipped: dict[str, str] = {}
    phases: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="sluice-overhead-") as tmp_s:
        tmp = Path(tmp_s)
        try:
            upstream = start_upstream(tmp)
            running.append(upstream)
            for name in arm_names:
                # One gateway per mode: its adaptive limiter learns each workload's own
                # base latency, as in production, instead of carrying the fast stream's
                # per-token time into the paced one (the fake upstream changes speed on
                # request, a real backend would not).
                for mode in modes if name.startswith("sluice") else [None]:
                    try:
                        arm = start_arm(
                            name,
                            tmp / (mode or ""),
                            upstream.url,
                            nginx_workers=args.nginx_workers,
                            sluice_cfg=args.sluice_config,
                            sluice_bin=args.sluice_bin,
                            baseline_bin=args.baseline_bin,
                            concurrency=args.concurrency,
                        )
                    except ArmSkipped as exc:
                        skipped[name] = str(exc)
                        console.print(f"[yellow]skipping {name}[/]: {exc}")
                        break
                    arm.mode = mode
                    running.append(arm)
                    notes = "; ".join(arm.notes) + (f" (for mode {mode})" if mode else "")
                    console.print(f"[green]started[/] {labels[name]} {notes}")
            arms = [a for a in running if a.name != "upstream"]

            def arms_for(mode: str) -> list[Arm]:
                return [a for a in arms if a.mode in (None, mode)]

            # Warm every arm up (connection pools, caches) outside the figures.
            for mode in modes:
                for arm in arms_for(mode):
                    run_phase(arm, upstream, mode, 2 * args.concurrency, args)
            total = args.rounds * sum(len(arms_for(m)) for m in modes)
            columns = (
                TextColumn("{task.description}"),
                BarColumn(),
                MofNCompleteColumn(),
                TimeElapsedColumn(),
            )
            with Progress(*columns, console=console) as progress:
                task = progress.add_task("overhead", total=total)
                for rnd in range(args.rounds):
                    for mode in modes:
                        order = arms_for(mode)
                        shift = (rnd + modes.index(mode)) % len(order)
                        for arm in order[shift:] + order[:shift]:
                            progress.update(
                                task,
                                description=f"round {rnd + 1}/{args.rounds} {mode:6} {arm.name}",
                            )
                            phase = run_phase(arm, upstream, mode, counts[mode], args)
                            phase["round"] = rnd
                            phases.append(phase)
                            progress.advance(task)
        finally:
            logs = args.out / "logs"
            logs.mkdir(exist_ok=True)
            for arm in reversed(running):
                arm.stop()
                if arm.log is not None and arm.log.exists():
                    # The temp dir goes away; keep each process's output.
                    suffix = f"-{arm.mode}" if arm.mode else ""
                    shutil.copy(arm.log, logs / f"{arm.log.stem}{suffix}.log")

    names = [a for a in arm_names if a not in skipped]
    agg = aggregate(phases, names, modes, CHOSEN_STACK)
    # A mode saturated the CPU when any of its phases kept the machine busy on average.
    busy_by_mode = {
        m: max((p["busy_mean"] for p in phases if p["mode"] == m), default=0.0) for m in modes
    }
    results: dict[str, Any] = {
        "scenario": "overhead",
        "mode": "real",
        "config": {
            "rounds": args.rounds,
            "requests": counts["json"],
            "stream_requests": counts["stream"],
            "paced_requests": counts["paced"],
            "serial_requests": counts["serial"],
            "concurrency": args.concurrency,
            "chunks": args.chunks,
            "interval_ms": args.interval_ms,
            "cores": os.cpu_count(),
            "nginx_workers": args.nginx_workers,
            "passthrough_stack": CHOSEN_STACK,
            "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        },
        "cpu": {
            "busy_fraction_max": max((p["busy_max"] for p in phases), default=0.0),
            "busy_fraction_mean": sum(p["busy_mean"] for p in phases) / max(1, len(phases)),
            "busy_fraction_worst_phase_by_mode": busy_by_mode,
            "saturated": any(v >= SATURATED for v in busy_by_mode.values()),
            "saturated_modes": [m for m, v in busy_by_mode.items() if v >= SATURATED],
        },
        "labels": labels,
        "skipped": skipped,
        "notes": {a.name: a.notes for a in running if a.notes},
        "sluice_per_mode": True,
        "arms": agg,
        "phases": [
            {k: v for k, v in p.items() if k not in ("latencies_s", "ttfts_s")} for p in phases
        ],
    }
    (args.out / "results.json").write_bytes(
        orjson.dumps(results, option=orjson.OPT_INDENT_2 | orjson.OPT_SERIALIZE_NUMPY)
    )
    table = markdown(results)
    (args.out / "overhead.md").write_text(table + "\n")
    if agg:
        chart(results, args.out / "overhead.png")
    console.print(table)
    console.print(f"wrote {args.out}/results.json, overhead.md, overhead.png")
    return 0
