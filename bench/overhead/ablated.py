"""`sluice` with parts of its request path stubbed out: what each part costs.

Run by instructions.py --ablate PARTS (never in production): it patches the named parts to
no-ops, then runs `sluice` with its usual arguments. PARTS, comma-separated:

  prom     every Prometheus update on the request path (counters, histograms)
  breaker  the backend circuit breaker's record of each success
  access   the access log record
  cost     the token-cost model's learning (admitted footprints, output lengths)
  drain    the Retry-After estimator's arrival and dispatch rates
  core     the whole controller: every request is placed on backend-0 at once (no
           admission, queues, limiter, quotas or estimators; includes cost and drain)

With every part stubbed, what is left is the HTTP shell of the gateway (auth, parsing,
headers, deadlines, the relay and its usage accounting)."""

from __future__ import annotations

import os
import sys
from typing import Any

PARTS = ("prom", "breaker", "access", "cost", "drain", "core")


def ablate(parts: set[str]) -> None:
    unknown = parts - set(PARTS)
    if unknown:
        raise SystemExit(f"unknown parts {sorted(unknown)} (known: {', '.join(PARTS)})")
    if "prom" in parts:
        import sluice.gateway.telemetry as telemetry

        def no_update(bound: Any, key: Any) -> Any:
            update = bound[key] = lambda _amount: None
            return update

        telemetry._Bound.__missing__ = no_update  # type: ignore[method-assign]
    if "breaker" in parts:
        from sluice.core.circuit_breaker import CircuitBreaker

        CircuitBreaker.record_success = lambda _self: None  # type: ignore[method-assign]
    if "access" in parts:
        import sluice.gateway.stages.access_record as access_record

        access_record.access = lambda _fields: None
    if "cost" in parts:
        from sluice.core.token_cost import TokenCostModel

        TokenCostModel.observe = lambda _self, *_a: None  # type: ignore[method-assign]
        TokenCostModel.note_admitted = lambda _self, *_a: None  # type: ignore[method-assign]
    if "drain" in parts:
        from sluice.core.retry_after import DrainEstimator

        DrainEstimator.record_dispatch = lambda _self, *_a: None  # type: ignore[method-assign]
        DrainEstimator.record_arrival = lambda _self, *_a: None  # type: ignore[method-assign]
    if "core" in parts:
        from sluice.core.controller import Controller
        from sluice.core.types import Admission, Assignment

        def arrive(_self: Controller, req: Any, take: bool = False) -> Admission:
            return Admission(True, assignment=Assignment(req.request_id, "backend-0", 0.0))

        Controller.arrive = arrive  # type: ignore[method-assign]
        Controller.on_finish = lambda _self, *_a, **_k: None  # type: ignore[method-assign]
        Controller.quiet = lambda _self: True  # type: ignore[method-assign]


def main() -> None:
    ablate({p for p in os.environ.get("SLUICE_ABLATE", "").split(",") if p})
    from sluice.cli import main as sluice_main

    sys.exit(sluice_main())


if __name__ == "__main__":
    main()
