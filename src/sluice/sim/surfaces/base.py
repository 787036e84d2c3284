"""What an engine's surface is, for the simulator (`sluice sim --engine NAME`) and the
virtual-time bench: how that engine admits requests (a Profile change), the metrics it
exports and on which routes, its health and models answers, and its refusals. The engine
underneath is the simulator's; a surface only changes what it looks like from outside."""

from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any

import orjson

from sluice.sim.engine import Engine, EngineSnapshot, StepResult
from sluice.sim.metrics import _Hist
from sluice.sim.profiles import Profile

PROM_TEXT = "text/plain; version=0.0.4; charset=utf-8"
JSON = "application/json"


class SurfaceMetrics(ABC):
    """What an engine exports, fed by its steps; `render(path)` answers a metrics route."""

    @abstractmethod
    def observe_step(self, result: StepResult, snap: EngineSnapshot) -> None: ...

    @abstractmethod
    def render(self, path: str) -> tuple[bytes, str]: ...


class Surface(ABC):
    name: str = ""
    owned_by: str = ""  # /v1/models owned_by
    # GET routes answered by SurfaceMetrics.render, and static JSON routes (static()).
    metric_paths: tuple[str, ...] = ("/metrics",)

    def profile(self, base: Profile) -> Profile:
        """The profile as this engine runs it (its admission against the KV cache)."""
        return base

    @abstractmethod
    def metrics(
        self, engine: Engine, model_name: str, snapshot: Callable[[], EngineSnapshot]
    ) -> SurfaceMetrics:
        """`snapshot`: the state the gauges show (the engine's, or the last step's)."""

    def static(self, model_name: str, profile: Profile) -> dict[str, Any]:
        """Other GET routes with a fixed JSON answer (TGI's /info, llama.cpp's /props)."""
        return {}

    def health(self) -> tuple[int, bytes, str]:
        return 200, b"", "text/plain"

    def model_card(self, model_name: str, profile: Profile, created: int) -> dict[str, Any]:
        return {"id": model_name, "object": "model", "created": created, "owned_by": self.owned_by}

    def refusal(self, in_flight: int) -> tuple[int, bytes] | None:
        """An answer instead of taking a new request while `in_flight` requests are being
        served (TGI's 429), or None."""
        return None


def replace(profile: Profile, **changes: Any) -> Profile:
    return dataclasses.replace(profile, **changes)


def hist_lines(name: str, h: _Hist, labels: str = "") -> list[str]:
    """A histogram in Prometheus text (`labels`: `k="v",...` without braces)."""
    sep = "," if labels else ""
    out = [f"# TYPE {name} histogram"]
    for le, count in h.cumulative():
        out.append(f'{name}_bucket{{{labels}{sep}le="{le}"}} {count}')
    brace = f"{{{labels}}}" if labels else ""
    out.append(f"{name}_sum{brace} {h.total}")
    out.append(f"{name}_count{brace} {h.cumulative()[-1][1]}")
    return out


def sample(name: str, value: float, kind: str = "gauge", labels: str = "") -> list[str]:
    brace = f"{{{labels}}}" if labels else ""
    return [f"# TYPE {name} {kind}", f"{name}{brace} {value}"]


def text(lines: list[str]) -> tuple[bytes, str]:
    return ("\n".join(lines) + "\n").encode(), PROM_TEXT


def json_body(value: Any) -> tuple[bytes, str]:
    return orjson.dumps(value), JSON


class LatencyHists:
    """First-token and inter-token latencies of every step, as an engine records them."""

    def __init__(self, ttft: tuple[float, ...], itl: tuple[float, ...]) -> None:
        self.ttft = _Hist(ttft)
        self.itl = _Hist(itl)

    def observe(self, result: StepResult) -> None:
        for event in result.tokens:
            (self.ttft if event.index == 0 else self.itl).observe(event.latency)
