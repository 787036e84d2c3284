"""`sluice demo`: the overload story in one command, on real processes.

Starts two simulated vLLM backends and the gateway (the built-in policy: three classes,
tenants sk-demo-p0/p1/p2), drives a minute of mixed-priority traffic with a 20 s burst at
3x capacity while showing live progress and the dashboard's address, then the same traffic
straight at the backends for comparison (skip it with --no-compare). Ends with the summary
table and a report folder (results.json, plots, report.md)."""

from __future__ import annotations

import argparse

from sluice.bench import bench_cmd


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--out", metavar="DIR", help="report folder (default: reports/demo-<timestamp>)"
    )
    parser.add_argument(
        "--no-compare",
        action="store_true",
        help="run only through Sluice, not also straight to the backends",
    )
    parser.add_argument("--seed", type=int, default=None)


def run(args: argparse.Namespace) -> int:
    from rich.console import Console

    console = Console()
    console.rule("[bold]Sluice demo")
    console.print(
        "Two simulated vLLM backends (small KV cache), the Sluice gateway in front, and a "
        "minute of traffic: 20% P0 interactive chat (streaming), 40% P1 agents, 40% P2 "
        "batch; steady at 0.7x capacity, a 20 s burst at 3x, then recovery.\n"
        "Through Sluice, P0 should keep its latency, P2 be refused first with an accurate "
        "Retry-After (and come back), and the backends never preempt."
        + (
            ""
            if args.no_compare
            else " Then the same traffic goes straight to the backends, for comparison."
        )
    )
    return bench_cmd.run(bench_args(args))


def bench_args(args: argparse.Namespace) -> argparse.Namespace:
    """`sluice bench demo --mode real ...` with every other option at its default (one
    parser: an option bench gains is never missing here)."""
    parser = argparse.ArgumentParser()
    bench_cmd.configure(parser)
    out = parser.parse_args(
        ["demo", "--mode", "real", "--arms", "sluice" if args.no_compare else "sluice,direct"]
    )
    out.out = args.out
    out.seed = args.seed
    return out
