"""vLLM's surface: the simulator's own (sluice.sim.metrics follows vLLM V1's names,
labels and buckets; sluice.sim.server its routes and answers)."""

from __future__ import annotations

from collections.abc import Callable

from sluice.sim.engine import Engine, EngineSnapshot, StepResult
from sluice.sim.metrics import SimMetrics
from sluice.sim.surfaces.base import Surface, SurfaceMetrics


class _VllmMetrics(SurfaceMetrics):
    def __init__(self, metrics: SimMetrics) -> None:
        self.sim = metrics

    def observe_step(self, result: StepResult, snap: EngineSnapshot) -> None:
        self.sim.observe_step(result)

    def render(self, path: str) -> tuple[bytes, str]:
        from prometheus_client import CONTENT_TYPE_LATEST

        return self.sim.exposition(), CONTENT_TYPE_LATEST


class VllmSurface(Surface):
    name = "vllm"
    owned_by = "vllm"

    def metrics(
        self, engine: Engine, model_name: str, snapshot: Callable[[], EngineSnapshot]
    ) -> SurfaceMetrics:
        return _VllmMetrics(SimMetrics(engine, model_name, snapshot=snapshot))
