"""`none`: a backend whose metrics Sluice does not read (an engine it has no adapter for,
or one pinned so in the policy). The limiter runs on latency alone (TTFT, TPOT, drops),
and the backend's state says so."""

from __future__ import annotations

from collections.abc import Mapping

from sluice.core.types import BackendMetrics
from sluice.gateway.engines.base import EngineAdapter


class NoneAdapter(EngineAdapter):
    name = "none"
    routes = ()
    start_hint = "no metrics are read from this backend: latency-only control"

    def read(self, pages: Mapping[str, str], at: float) -> BackendMetrics:
        return self.metrics(at)
