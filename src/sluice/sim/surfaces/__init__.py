"""Each engine's surface for the simulator and the virtual-time bench (base.py says what a
surface is); `sluice sim --engine NAME`, `sluice bench ... --engine NAME`."""

from __future__ import annotations

from sluice.sim.surfaces.base import Surface
from sluice.sim.surfaces.llamacpp import LlamacppSurface
from sluice.sim.surfaces.sglang import SglangSurface
from sluice.sim.surfaces.tgi import TgiSurface
from sluice.sim.surfaces.trtllm import TrtllmSurface
from sluice.sim.surfaces.vllm import VllmSurface

SURFACES: dict[str, type[Surface]] = {
    s.name: s for s in (VllmSurface, SglangSurface, TrtllmSurface, LlamacppSurface, TgiSurface)
}
DEFAULT_SURFACE = "vllm"


def get_surface(name: str) -> Surface:
    try:
        return SURFACES[name]()
    except KeyError:
        known = ", ".join(SURFACES)
        raise ValueError(f"unknown engine {name!r}; known engines: {known}") from None


__all__ = ["DEFAULT_SURFACE", "SURFACES", "Surface", "get_surface"]
