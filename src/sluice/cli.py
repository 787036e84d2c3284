"""The `sluice` command line. Each verb lives in its own module, which provides
`configure(parser)` to declare its arguments and `run(args) -> int` to do the work;
imports are lazy so that `sluice --help` stays fast."""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import sys

# verb -> (module, one-line help)
VERBS: dict[str, tuple[str, str]] = {
    "serve": ("sluice.gateway.serve_cmd", "run the gateway"),
    "sim": ("sluice.sim.sim_cmd", "run the vLLM-compatible simulator"),
    "demo": ("sluice.bench.demo_cmd", "simulator + gateway + bursty traffic, with a report"),
    "bench": ("sluice.bench.bench_cmd", "run a benchmark scenario against baselines"),
    "check-config": ("sluice.config_cmd", "validate a policy file"),
}
# verbs that need an optional extra -> (extra, the modules it brings)
EXTRAS: dict[str, tuple[str, tuple[str, ...]]] = {
    "demo": ("bench", ("rich", "matplotlib")),
    "bench": ("bench", ("rich", "matplotlib")),
}


def missing_extra(verb: str) -> str | None:
    """A clear message when `verb` needs an extra that is not installed, else None."""
    extra, modules = EXTRAS.get(verb, ("", ()))
    absent = [m for m in modules if importlib.util.find_spec(m) is None]
    if not absent:
        return None
    return (
        f"sluice {verb} needs the optional `{extra}` part ({', '.join(absent)} missing): "
        f"pip install 'sluice[{extra}]'"
    )


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
    if verb in VERBS and (message := missing_extra(verb)):
        print(message, file=sys.stderr)
        return 2
    args = build_parser(verb if verb in VERBS else None).parse_args(argv)
    return int(args._run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
