"""An engine's surface in virtual time: what the gateway's scraper would read from one
simulated backend presenting that engine (`sluice bench ... --engine NAME`).

The engine's own metrics pages (sluice.sim.surfaces) are rendered from its state as of its
last completed step and read back by the gateway's adapter for that engine
(sluice.gateway.engines), so the controller gets exactly what it would get in front of
that engine: TensorRT-LLM's drained iteration statistics, llama.cpp's busy and deferred
slots without latency histograms, TGI's reserved tokens, and nothing it does not export.
The engine's refusals (TGI's 429 when its router is full) are answered here too."""

from __future__ import annotations

import orjson

from sluice.core.types import BackendMetrics
from sluice.gateway.engines import adapter
from sluice.sim.engine import Engine, EngineSnapshot, StepResult
from sluice.sim.profiles import Profile
from sluice.sim.surfaces import Surface, get_surface

MODEL_NAME = "sim"


def engine_profile(engine: str, base: Profile) -> Profile:
    """The profile as `engine` runs it (its admission against the KV cache)."""
    return get_surface(engine).profile(base)


class EngineView:
    """One backend's surface: fed by its steps, scraped like the real engine."""

    def __init__(self, engine: str, sim: Engine) -> None:
        self.surface: Surface = get_surface(engine)
        self.sim = sim
        self._published: EngineSnapshot = sim.snapshot()
        self.metrics = self.surface.metrics(sim, MODEL_NAME, lambda: self._published)
        self.adapter = adapter(engine)
        self._static = {
            path: orjson.dumps(value).decode()
            for path, value in self.surface.static(MODEL_NAME, sim.profile).items()
        }

    def observe(self, result: StepResult, snap: EngineSnapshot) -> None:
        """A step ended: `snap`, its state as scheduled (taken when the step started, as
        an engine's scheduler stats are), is what the engine shows until the next one."""
        self._published = snap
        self.metrics.observe_step(result, snap)

    def scrape(self, at: float) -> BackendMetrics:
        pages = dict(self._static)
        for route in self.adapter.routes:
            if route.path in self.surface.metric_paths:
                pages[route.path] = self.metrics.render(route.path)[0].decode()
        return self.adapter.read(pages, at)

    def refuses(self, in_flight: int) -> bool:
        return self.surface.refusal(in_flight) is not None
