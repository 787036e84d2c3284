"""One small adapter per inference engine, each turning what that engine exposes into the
core's `BackendMetrics`, and the detection of the engine from what a backend answers.
docs/engines.md says, per engine, what is read from which route and what is missing."""

from __future__ import annotations

import re
from typing import Any

from sluice.gateway.engines.base import EngineAdapter, Route
from sluice.gateway.engines.llamacpp import LlamacppAdapter
from sluice.gateway.engines.none import NoneAdapter
from sluice.gateway.engines.sglang import SglangAdapter
from sluice.gateway.engines.tgi import TgiAdapter
from sluice.gateway.engines.trtllm import TrtllmAdapter, is_iteration_stats
from sluice.gateway.engines.vllm import VllmAdapter

ADAPTERS: dict[str, type[EngineAdapter]] = {
    a.name: a
    for a in (VllmAdapter, SglangAdapter, TrtllmAdapter, LlamacppAdapter, TgiAdapter, NoneAdapter)
}
ENGINES = tuple(ADAPTERS)

# A metric name at the start of a line, by engine (the first one found wins).
_PREFIXES = re.compile(r"^(vllm:|sglang:|llamacpp:|trtllm_|tgi_)", re.MULTILINE)
_BY_PREFIX = {
    "vllm:": "vllm",
    "sglang:": "sglang",
    "llamacpp:": "llamacpp",
    "trtllm_": "trtllm",
    "tgi_": "tgi",
}
# /v1/models `owned_by`, by engine (TGI puts the model id there: /info says it instead)
_BY_OWNER = {"vllm": "vllm", "sglang": "sglang", "llamacpp": "llamacpp", "tensorrt_llm": "trtllm"}


def adapter(name: str) -> EngineAdapter:
    try:
        return ADAPTERS[name]()
    except KeyError:
        raise ValueError(f"unknown engine {name!r}; known: {', '.join(ENGINES)}") from None


def detect_from_metrics(status: int, body: str) -> str | None:
    """The engine whose /metrics this is, if it says."""
    if status != 200:
        return None
    if is_iteration_stats(body):
        return "trtllm"
    m = _PREFIXES.search(body)
    return None if m is None else _BY_PREFIX[m.group(1)]


def detect_from_models(body: Any) -> str | None:
    """The engine that answered this /v1/models, if its `owned_by` says."""
    data = body.get("data") if isinstance(body, dict) else None
    if not isinstance(data, list):
        return None
    for card in data:
        if isinstance(card, dict):
            name = _BY_OWNER.get(str(card.get("owned_by", "")).lower())
            if name:
                return name
    return None


def detect_from_info(body: Any) -> str | None:
    """TGI's /info names its router."""
    if isinstance(body, dict) and str(body.get("router", "")).startswith("text-generation"):
        return "tgi"
    return None


__all__ = [
    "ADAPTERS",
    "ENGINES",
    "EngineAdapter",
    "Route",
    "adapter",
    "detect_from_info",
    "detect_from_metrics",
    "detect_from_models",
]
