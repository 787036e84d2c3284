"""What every engine adapter is: the routes it reads and how it turns their answers into
the core's `BackendMetrics`. Adapters are pure (text in, numbers out) and keep only what
windows need between scrapes (histogram buckets, a counter made from a gauge)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass

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

    def metrics(self, at: float, signals: set[str], **fields: object) -> BackendMetrics:
        return BackendMetrics(at=at, engine=self.name, signals=frozenset(signals), **fields)  # type: ignore[arg-type]


def found(signals: set[str], name: str, value: object) -> None:
    """Record that the page carries `name` when its value is there."""
    if value is not None:
        signals.add(name)
