"""What a peer gateway model offers the bench: the calls the virtual-time harness (and the
real-mode peer proxy, `bench.peers.proxy`) make on Sluice's `Controller`, with the peer's
own decisions behind them. Pure like the core: time comes from the injected clock, nothing
sleeps, so each model is unit-tested with exact values.

A model answers `arrive` at once (refused, with the HTTP status and Retry-After the peer
sends, or accepted), and hands accepted requests to a backend through `step` (at once, or
later when it queues them), as the gateway drives `Controller.step`. `snapshot()` has
the fields of `Controller.snapshot()` the harness samples (`backends[NAME].limit`,
`pressure`)."""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, NamedTuple

from sluice.core.clock import Clock
from sluice.core.types import Assignment, BackendMetrics, Outcome, RequestInfo


class PeerCode(StrEnum):
    """Why a peer refused a request (the `code` of its error body, as the bench counts it)."""

    LITELLM_PARALLEL = "max_parallel_requests"  # LiteLLM: 429, Retry-After 60
    GIE_SHED = "saturated_sheddable"  # GIE: 429, sheddable request while saturated
    GIE_TTL = "flow_control_ttl"  # GIE flow control: 503, evicted from its queue
    ENVOY_LIMIT = "concurrency_limit"  # Envoy adaptive concurrency: 503


STATUS = {
    PeerCode.LITELLM_PARALLEL: 429,
    PeerCode.GIE_SHED: 429,
    PeerCode.GIE_TTL: 503,
    PeerCode.ENVOY_LIMIT: 503,
}


@dataclass(slots=True)
class PeerAdmission:
    admitted: bool  # accepted: it will come out of `dispatch`
    code: PeerCode | None = None
    retry_after_s: float | None = None  # the Retry-After header, None when the peer sends none
    booking: str | None = None  # no peer books a return slot (Sluice's X-Sluice-Booking)
    retry_window_s: float = 0.0


@dataclass(slots=True)
class PeerRejection:
    """A request the peer had accepted and now drops (a queue's TTL)."""

    request_id: str
    code: PeerCode
    retry_after_s: float | None = None
    booking: str | None = None
    retry_window_s: float = 0.0


class PeerStep(NamedTuple):
    """What one pass of a peer model decided (the shape of `Controller.step`'s `Step`)."""

    assignments: list[Assignment]
    rejections: list[PeerRejection]
    wake_at: float | None


@dataclass(frozen=True, slots=True)
class PeerBackend:
    limit: float  # inf: no cap
    inflight: int


@dataclass(frozen=True, slots=True)
class PeerSnapshot:
    """The fields of `ControllerSnapshot` the harness samples (`pressure`,
    `backends[name].limit`), and the requests queued per class P0..P2."""

    pressure: float
    queued: list[int]
    backends: dict[str, PeerBackend]


class PeerGateway(ABC):
    """Shared bookkeeping: backends, health, their last metrics, and who is in flight where.
    Subclasses decide admission (`arrive`) and placement (`dispatch`)."""

    name = "peer"
    scrape_interval_s = 0.25  # how often the peer reads each backend's metrics

    def __init__(self, clock: Clock, backends: list[str]) -> None:
        self._clock = clock
        self.backends = list(backends)
        self.healthy = dict.fromkeys(backends, True)
        self.metrics: dict[str, BackendMetrics | None] = dict.fromkeys(backends)
        self.inflight = dict.fromkeys(backends, 0)
        self.where: dict[str, str] = {}  # request id -> backend, while in flight
        self._ready: list[Assignment] = []

    # -- the harness's calls -------------------------------------------------------------

    def set_backend_models(self, backend: str, models: Any) -> None:  # noqa: B027 (a no-op default on purpose)
        pass  # every backend serves the bench's one model

    def set_backend_health(self, backend: str, healthy: bool) -> None:
        self.healthy[backend] = healthy

    def on_metrics(self, backend: str, m: BackendMetrics) -> None:
        self.metrics[backend] = m

    def metrics_stale(self, backend: str) -> None:
        self.metrics[backend] = None

    @abstractmethod
    def arrive(self, info: RequestInfo) -> PeerAdmission: ...

    def step(self) -> PeerStep:
        """One pass after any event, as `Controller.step`: the requests it drops, those it
        sends now, and when to look again."""
        rejections = self._expire()
        return PeerStep(self._dispatch(), rejections, self._next_wakeup())

    # -- a pass's parts, for the models to extend -------------------------------------

    def _expire(self) -> list[PeerRejection]:
        return []

    def _dispatch(self) -> list[Assignment]:
        out, self._ready = self._ready, []
        return out

    def _next_wakeup(self) -> float | None:
        return None

    def cancel(self, request_id: str) -> None:
        """The client left before its request was sent (or the harness drops it)."""
        self._ready = [a for a in self._ready if a.request_id != request_id]
        self._release(request_id)

    def on_first_token(self, request_id: str) -> None:  # noqa: B027 (a no-op default on purpose)
        pass

    def on_finish(
        self,
        request_id: str,
        outcome: Outcome,
        prompt_tokens: int | None = None,
        completion_tokens: int | None = None,
    ) -> None:
        self._release(request_id)

    def limit(self, backend: str) -> float:
        """The cap on this backend's in-flight requests (inf: none)."""
        return math.inf

    def queued(self) -> list[int]:
        """Requests waiting in the gateway, per class P0..P2."""
        return [0, 0, 0]

    def limits(self) -> dict[str, float]:
        """Each backend's cap, as `Controller.limits`."""
        return {b: self.limit(b) for b in self.backends}

    def snapshot(self) -> PeerSnapshot:
        return PeerSnapshot(
            pressure=0.0,
            queued=self.queued(),
            backends={b: PeerBackend(self.limit(b), self.inflight[b]) for b in self.backends},
        )

    # -- helpers -------------------------------------------------------------------------

    def _send(self, request_id: str, backend: str, queued_s: float = 0.0) -> None:
        self.where[request_id] = backend
        self.inflight[backend] += 1
        self._ready.append(Assignment(request_id, backend, queued_s))

    def _release(self, request_id: str) -> str | None:
        b = self.where.pop(request_id, None)
        if b is not None:
            self.inflight[b] -= 1
        return b

    def _up(self) -> list[str]:
        return [b for b in self.backends if self.healthy[b]]
