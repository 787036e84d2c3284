"""`sluice check-config PATH`: validate a policy and print every error with its field path."""

from __future__ import annotations

import argparse
import sys

from sluice.config import ConfigError, load_policy, lockout_errors, missing_environment


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("path", help="policy.yaml, or a Kubernetes ConfigMap holding it")


def run(args: argparse.Namespace) -> int:
    try:
        policy = load_policy(args.path)
        if lockout := lockout_errors(policy):
            raise ConfigError(args.path, lockout)
    except ConfigError as exc:
        print(f"{exc.source}: invalid policy", file=sys.stderr)
        for line in exc.errors:
            print(f"  {line}", file=sys.stderr)
        return 1
    for line in missing_environment(policy):
        # a deploy check may run where the secrets are not: `sluice serve` refuses these
        print(f"{args.path}: warning: {line}", file=sys.stderr)
    ordered = sorted(policy.queues, key=lambda q: q.priority)
    queues = ", ".join(f"P{q.priority} {q.name}" for q in ordered)
    print(
        f"{args.path}: OK ({queues}; {len(policy.tenants)} tenants, "
        f"{len(policy.backends)} backends, {len(policy.features)} features)"
    )
    return 0
