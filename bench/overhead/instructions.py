"""Machine instructions and estimated cycles a proxy spends per request, counted by
valgrind: CPU figures that a shared, noisy machine cannot move.

run.py's CPU time per request moves by 10-20% between rounds of the same code here (other
processes, the sibling hyperthread, frequency), which is larger than most changes worth
making; opcount.py's Python bytecodes are steady but miss everything done in C (aiohttp's
HTTP parser, uvloop, orjson, hashlib, and the interpreter's own work per bytecode). This
script runs each proxy as run.py does (its own process, in front of the same fake upstream,
loaded by loadgen.py at the same concurrency) under valgrind's callgrind with counting off,
the caches and branch predictor simulated; after a warm-up it counts N requests only
(`callgrind_control -i on`, then a dump) and reads:

- instructions (Ir), and
- estimated cycles, KCachegrind's estimate: Ir + 10 x (L1 misses + mispredicted branches)
  + 100 x last-level misses. Instructions alone flatter code that is large: Sluice's
  request path adds about half as many L1 instruction-cache misses per request as the
  whole bare pass-through has, each worth ten instructions or so.

The counts cover the whole proxy process while those requests ran, background tasks
included, which weigh far more per request under valgrind's ~50x slowdown than at full
speed, where they are a few per second against thousands of requests. So Sluice runs
run.py's policy with its metric scrapes (4 a second) spaced to one a minute (the first,
at start, keeps the backend's metrics fresh for the count), and the proxy is then left idle
for a few seconds, counted too: each figure is also given net of that idle rate over the
load's wall time (what is left of the health checks, 1 a second, and timers). Repeated
runs agree within 1%.

Run: python bench/overhead/instructions.py [--arms passthrough,sluice] [--mode json]
         [--requests 300] [--warmup 100] [--sluice-bin PATH] [--sluice-config PATH]
         [--ablate prom,breaker,access,cost,drain,core]   (ablated.py: what each part costs)
Needs valgrind (apt install valgrind); about a minute per arm.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import orjson
import yaml
from arms import (
    HERE,
    LABELS,
    VENV_BIN,
    Arm,
    ArmSkipped,
    sluice_config,
    start_arm,
    start_upstream,
)
from rich.console import Console
from rich.table import Table
from runner import CHOSEN_STACK, loadgen_command

READY_S = 300.0  # starting a gateway under valgrind takes a while
IDLE_S = 5.0
VALGRIND = ["valgrind", "--tool=callgrind", "--cache-sim=yes", "--branch-sim=yes"]


@dataclass
class Counts:
    instructions: float
    cycles: float  # estimated

    def per(self, n: float) -> Counts:
        return Counts(self.instructions / n, self.cycles / n)

    def minus(self, other: Counts) -> Counts:
        return Counts(
            max(0.0, self.instructions - other.instructions), max(0.0, self.cycles - other.cycles)
        )


def load(url: str, mode: str, n: int, concurrency: int) -> None:
    """n requests through the proxy (loadgen.py, closed loop); all must succeed."""
    cmd = loadgen_command(url, mode, n, concurrency, chunks=16, interval_ms=10)
    cmd += ["--timeout", "600", "--no-wait"]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True)
    result = orjson.loads(out.stdout.strip().splitlines()[-1])
    errors = result.get("errors") or {}
    if errors:
        raise SystemExit(f"{url}: requests failed under valgrind: {errors}")


def callgrind_control(*args: str) -> None:
    subprocess.run(["callgrind_control", *args], capture_output=True, check=True)


def read_counts(out_file: Path) -> Counts:
    """Instructions and estimated cycles in one of callgrind's dumps."""
    events: list[str] = []
    for line in out_file.read_text().splitlines():
        if line.startswith("events:"):
            events = line.split()[1:]
        elif line.startswith("totals:"):
            e = dict(zip(events, (int(x) for x in line.split()[1:]), strict=True))
            l1 = e["I1mr"] + e["D1mr"] + e["D1mw"]
            last = e["ILmr"] + e["DLmr"] + e["DLmw"]
            branches = e["Bcm"] + e["Bim"]
            return Counts(e["Ir"], e["Ir"] + 10 * (l1 + branches) + 100 * last)
    raise SystemExit(f"no totals in {out_file}")


def few_scrapes(tmp: Path, concurrency: int) -> Path:
    """run.py's sluice policy, its backend metrics scraped once a minute."""
    path, _ = sluice_config(tmp, None, concurrency)
    policy = yaml.safe_load(path.read_text())
    policy["scraper"] = {"interval": "60s", "staleAfter": "10m"}
    out = tmp / "policy-few-scrapes.yaml"
    out.write_text(yaml.safe_dump(policy, sort_keys=False))
    return out


def measure(name: str, upstream: Arm, tmp: Path, args: argparse.Namespace) -> tuple[Counts, Counts]:
    """(per request, per request net of the idle rate) for one arm."""
    out = tmp / f"{name}.callgrind"
    prefix = [*VALGRIND, "--instr-atstart=no", f"--callgrind-out-file={out}"]
    arm = start_arm(
        CHOSEN_STACK if name == "passthrough" else name,
        tmp,
        upstream.url,
        sluice_cfg=args.sluice_config or few_scrapes(tmp, args.concurrency),
        sluice_bin=args.sluice_bin,
        baseline_bin=args.baseline_bin,
        concurrency=args.concurrency,
        prefix=prefix,
        ready_s=READY_S,
    )
    try:
        pid = str(arm.pid)
        load(arm.url, args.mode, args.warmup, args.concurrency)
        callgrind_control("-i", "on", pid)
        started = time.monotonic()
        load(arm.url, args.mode, args.requests, args.concurrency)
        wall = time.monotonic() - started
        callgrind_control("--dump", pid)  # the load: out.1
        time.sleep(IDLE_S)  # nothing to wait for: the idle proxy is what is measured
        callgrind_control("--dump", pid)  # idle: out.2
        callgrind_control("-i", "off", pid)
    finally:
        arm.stop(grace=120.0)
    loaded = read_counts(Path(f"{out}.1"))
    idle = read_counts(Path(f"{out}.2")).per(IDLE_S / wall)  # over the load's wall time
    return loaded.per(args.requests), loaded.minus(idle).per(args.requests)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arms", default="passthrough,sluice")
    parser.add_argument("--mode", choices=["json", "stream", "paced"], default="json")
    parser.add_argument("--requests", type=int, default=300)
    parser.add_argument("--warmup", type=int, default=100)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--sluice-bin", type=Path, default=VENV_BIN / "sluice")
    parser.add_argument(
        "--baseline-bin",
        type=Path,
        default=None,
        help="the sluice executable of the sluice-before arm (e.g. main's tree's)",
    )
    parser.add_argument("--sluice-config", type=Path, default=None)
    parser.add_argument(
        "--ablate",
        default="",
        help="run sluice with these parts stubbed out (ablated.py lists them)",
    )
    args = parser.parse_args()
    if args.ablate:
        # a console script for ablated.py, on this interpreter (valgrind runs it by path)
        args.sluice_bin = Path(tempfile.mkdtemp(prefix="sluice-ablated-")) / "sluice"
        args.sluice_bin.write_text(
            f"#!{sys.executable}\nimport sys\nsys.path.insert(0, {str(HERE)!r})\n"
            "import ablated\nablated.main()\n"
        )
        args.sluice_bin.chmod(0o755)
        os.environ["SLUICE_ABLATE"] = args.ablate
    if shutil.which("valgrind") is None or shutil.which("callgrind_control") is None:
        raise SystemExit("valgrind is not installed (apt install valgrind)")
    console = Console()
    names = [a for a in args.arms.split(",") if a]
    results: dict[str, tuple[Counts, Counts]] = {}
    with tempfile.TemporaryDirectory(prefix="sluice-instr-") as tmp_dir:
        tmp = Path(tmp_dir)
        upstream = start_upstream(tmp)
        try:
            with console.status("") as status:
                for name in names:
                    status.update(
                        f"{name}: {args.warmup} + {args.requests} requests under valgrind"
                    )
                    try:
                        results[name] = measure(name, upstream, tmp, args)
                    except ArmSkipped as exc:
                        console.print(f"[yellow]skipping {name}[/]: {exc}")
                        continue
                    raw, net = results[name]
                    console.print(
                        f"{name}: {raw.instructions:,.0f} instructions, {raw.cycles:,.0f} "
                        f"estimated cycles per request (net of idle: {net.instructions:,.0f}, "
                        f"{net.cycles:,.0f})"
                    )
        finally:
            upstream.stop()
    base = results.get("passthrough")
    table = Table(title=f"per request, mode {args.mode}, concurrency {args.concurrency}")
    for column in ("arm", "instructions", "x bare", "est. cycles", "x bare"):
        table.add_column(column, justify="left" if column == "arm" else "right")
    table.add_column("net of idle: cycles", justify="right")
    table.add_column("x bare", justify="right")
    for name, (raw, net) in results.items():
        table.add_row(
            LABELS.get(name, name),
            f"{raw.instructions:,.0f}",
            f"{raw.instructions / base[0].instructions:.2f}" if base else "-",
            f"{raw.cycles:,.0f}",
            f"{raw.cycles / base[0].cycles:.2f}" if base else "-",
            f"{net.cycles:,.0f}",
            f"{net.cycles / base[1].cycles:.2f}" if base else "-",
        )
    console.print(table)


if __name__ == "__main__":
    main()
