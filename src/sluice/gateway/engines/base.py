"""What every engine adapter is: the routes it reads and how it turns their answers into
the core's `BackendMetrics`. Adapters are pure (text in, numbers out) and keep only what
windows need between scrapes (histogram buckets, a counter made from a gauge)."""

from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import orjson

from sluice.core.types import BackendMetrics


@dataclass(frozen=True, slots=True)
class Route:
    """A route an adapter reads. `once`: static information, read until it answers once.
    `required`: a scrape fails (latency-only control) when it does not answer."""

    path: str
    once: bool = False
    required: bool = False


class EngineAdapter(ABC):
    name: str = ""
    routes: tuple[Route, ...] = ()
    # How to start the engine so that Sluice sees every signal it has (logged when a
    # signal is missing; docs/engines.md says more).
    start_hint: str = ""

    @abstractmethod
    def read(self, pages: Mapping[str, str], at: float) -> BackendMetrics:
        """`pages`: route path -> body, for the routes that answered (a `once` route's
        body stays there once it answered). Raises ValueError on a malformed page."""

    def metrics(
        self, at: float, *, has_ttft: bool = False, has_tpot: bool = False, **fields: Any
    ) -> BackendMetrics:
        """The reading, with the signals it carries: every field that has a value, and
        the latency histograms that are on the page (`has_*`: even when their window had
        no sample)."""
        m = BackendMetrics(at=at, engine=self.name, **fields)
        signals = {
            name
            for name, value in (
                ("running", m.running),
                ("waiting", m.waiting),
                ("kv_usage", m.kv_usage),
                ("kv_capacity", m.kv_capacity),
                ("preemptions", m.preemptions_total),
            )
            if value is not None
        }
        if has_ttft:
            signals.add("ttft_p95")
        if has_tpot:
            signals.add("tpot_p95")
        return dataclasses.replace(m, signals=frozenset(signals))


def json_list(body: str, what: str) -> list[dict[str, Any]]:
    """A JSON list of objects (an engine's /slots, its iteration statistics); ValueError
    otherwise."""
    try:
        value = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise ValueError(f"{what} is not JSON: {exc}") from None
    if not isinstance(value, list) or not all(isinstance(v, dict) for v in value):
        raise ValueError(f"{what} is not a list of objects")
    return value
