"""The `sluice` command line. Each verb lives in its own module, which provides
`configure(parser)` to declare its arguments and `run(args) -> int` to do the work;
imports are lazy so that `sluice --help` stays fast."""

from __future__ import annotations

import argparse
import importlib
import sys

# verb -> (module, one-line help)
VERBS: dict[str, tuple[str, str]] = {
    "serve": ("sluice.gateway.serve_cmd", "run the gateway"),
    "sim": ("sluice.sim.sim_cmd", "run the vLLM-compatible simulator"),
    "demo": ("sluice.bench.demo_cmd", "simulator + gateway + bursty traffic, with a report"),
    "bench": ("sluice.bench.bench_cmd", "run a benchmark scenario against baselines"),
    "check-config": ("sluice.config_cmd", "validate a policy file"),
}


def build_parser(verb: str | None = None) -> argparse.ArgumentParser:
    """The parser; only the chosen verb's module is imported (a failure in one verb's
    dependencies must not break the others, and `sluice check-config` must stay fast)."""
    parser = argparse.ArgumentParser(
        prog="sluice", description="Sluice: an overload-protecting gateway for LLM inference."
    )
    sub = parser.add_subparsers(dest="verb", required=True, metavar="VERB")
    for name, (module_name, help_text) in VERBS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        if name == verb:
            module = importlib.import_module(module_name)
            module.configure(p)
            p.set_defaults(_run=module.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    verb = next((a for a in argv if not a.startswith("-")), None)
    args = build_parser(verb if verb in VERBS else None).parse_args(argv)
    return int(args._run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
