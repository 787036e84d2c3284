"""`sluice demo` runs `sluice bench demo --mode real`: its arguments are bench's own, every
option bench has included (a Namespace written by hand once lacked `trace`)."""

from __future__ import annotations

import argparse

from sluice.bench import bench_cmd, demo_cmd


def test_the_demo_gives_bench_every_option_it_reads() -> None:
    parser = argparse.ArgumentParser()
    bench_cmd.configure(parser)
    defaults = vars(parser.parse_args(["demo"]))
    args = demo_cmd.bench_args(argparse.Namespace(no_compare=False, out="/tmp/x", seed=3))
    assert set(vars(args)) == set(defaults)
    assert (args.scenario, args.mode, args.arms, args.out, args.seed) == (
        "demo", "real", "sluice,direct", "/tmp/x", 3,
    )  # fmt: skip
