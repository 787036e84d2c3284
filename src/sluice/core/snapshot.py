"""What the Controller shows of itself (`Controller.snapshot()`): small frozen values.

In-process readers (telemetry, the virtual-time harness, the bench) read their fields;
`ControllerSnapshot.as_dict()` is the one conversion to the JSON form that /admin/state
and /dashboard/state serve (the dashboard's page reads it), and `from_dict` the one way
back (the real-mode bench reads a gateway's /admin/state). Its keys and their order are
that JSON's: change a field here and the JSON changes with it.

`BackendSnapshot.limiter` stays a mapping: it is the limiter's own inner state
(`Limiter.describe()`), whose fields depend on the algorithm.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class ReturnsSnapshot:
    """A class's return slots (booking rule): the counters, then the ledger's state."""

    booked: int
    returned: int
    returned_admitted: int
    unservable: int
    waited: int
    waited_s: float
    outstanding: int
    expired: int
    show_rate: float
    booked_ahead_s: float
    room_rate: float

    def as_dict(self) -> dict[str, Any]:
        return {
            "booked": self.booked,
            "returned": self.returned,
            "returned_admitted": self.returned_admitted,
            "unservable": self.unservable,
            "waited": self.waited,
            "waited_s": self.waited_s,
            "outstanding": self.outstanding,
            "expired": self.expired,
            "show_rate": self.show_rate,
            "booked_ahead_s": self.booked_ahead_s,
            "room_rate": self.room_rate,
        }


@dataclass(frozen=True, slots=True)
class ClassSnapshot:
    """One priority class: its queue, its rates and quote, and its counters, which add up:
    arrived = admitted + sum(rejected);
    admitted = queued + dispatched + sum(dropped) + cancelled_queued;
    dispatched = inflight + sum(finished) + cancelled_inflight."""

    name: str  # the queue's name in the policy
    queued: int
    head_sojourn_s: float
    dispatch_rate: float
    arrival_rate: float
    retry_after_s: float  # what a refusal would be told now
    returns: ReturnsSnapshot
    tenants_queued: Mapping[str, int]
    arrived: int
    admitted: int
    rejected: Mapping[str, int]  # by RejectCode value
    dispatched: int
    dropped: Mapping[str, int]  # by RejectCode value
    cancelled_queued: int
    cancelled_inflight: int
    finished: Mapping[str, int]  # by Outcome value

    def as_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "queued": self.queued,
            "head_sojourn_s": self.head_sojourn_s,
            "dispatch_rate": self.dispatch_rate,
            "arrival_rate": self.arrival_rate,
            "retry_after_s": self.retry_after_s,
            "returns": self.returns.as_dict(),
            "tenants_queued": dict(self.tenants_queued),
            "arrived": self.arrived,
            "admitted": self.admitted,
            "rejected": dict(self.rejected),
            "dispatched": self.dispatched,
            "dropped": dict(self.dropped),
            "cancelled_queued": self.cancelled_queued,
            "cancelled_inflight": self.cancelled_inflight,
            "finished": dict(self.finished),
        }


@dataclass(frozen=True, slots=True)
class BackendSnapshot:
    """One backend as the controller sees it. `kv_usage` and `waiting` are the last fresh
    scrape's (None while metrics are stale); `engine` and `signals` the last scrape's that
    said (what an engine exports does not change when one scrape fails)."""

    healthy: bool
    limit: int
    inflight: int
    inflight_tokens: int
    kv_budget_tokens: float | None
    kv_usage: float | None
    waiting: float | None
    metrics_fresh: bool
    models: tuple[str, ...]  # sorted; empty: serves any model
    engine: str | None
    signals: Mapping[str, bool] | None  # each of SIGNALS: whether the engine exports it
    limiter: Mapping[str, object] | None = None  # Limiter.describe() (None: nothing)
    # The in-flight requests' outputs are bounded (core/bounded_outputs.py) and P0 may go
    # up to `ceiling` in flight where their bounds fit the cache; or, after a fall of the
    # limit for the cache's sake, P0 refills up to `ceiling` (core/p0_refill.py); the limit
    # otherwise.
    outputs_bounded: bool = False
    ceiling: int | None = None

    def as_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "healthy": self.healthy,
            "limit": self.limit,
            "inflight": self.inflight,
            "inflight_tokens": self.inflight_tokens,
            "kv_budget_tokens": self.kv_budget_tokens,
            "kv_usage": self.kv_usage,
            "waiting": self.waiting,
            "metrics_fresh": self.metrics_fresh,
            "models": list(self.models),
            "engine": self.engine,
            "signals": None if self.signals is None else dict(self.signals),
            "outputs_bounded": self.outputs_bounded,
            "ceiling": self.ceiling,
        }
        if self.limiter is not None:  # absent from the JSON rather than null
            out["limiter"] = dict(self.limiter)
        return out


@dataclass(frozen=True, slots=True)
class FleetSnapshot:
    """This gateway's part of the fleet sharing its backends (core/fleet_share.py)."""

    share: float
    estimate: float
    prior: float
    processes: int | None  # the live gateway processes, when told
    requests_seen: float

    def as_dict(self) -> dict[str, Any]:
        return {
            "share": self.share,
            "estimate": self.estimate,
            "prior": self.prior,
            "processes": self.processes,
            "requests_seen": self.requests_seen,
        }


@dataclass(frozen=True, slots=True)
class ControllerSnapshot:
    pressure: float
    algorithm: str  # the policy's limiter.algorithm
    expected_ttft_s: float
    aged_dispatches: int
    fleet: FleetSnapshot
    classes: Mapping[str, ClassSnapshot]  # "P0", "P1", "P2"
    backends: Mapping[str, BackendSnapshot]  # by backend name

    def as_dict(self) -> dict[str, Any]:
        """The JSON form (/admin/state, /dashboard/state): plain dicts, lists and numbers."""
        return {
            "pressure": self.pressure,
            "algorithm": self.algorithm,
            "expected_ttft_s": self.expected_ttft_s,
            "aged_dispatches": self.aged_dispatches,
            "fleet": self.fleet.as_dict(),
            "classes": {k: c.as_dict() for k, c in self.classes.items()},
            "backends": {k: b.as_dict() for k, b in self.backends.items()},
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> ControllerSnapshot:
        """The snapshot `as_dict()` gave (as a gateway's /admin/state serves it)."""
        classes = {
            k: ClassSnapshot(**{**c, "returns": ReturnsSnapshot(**c["returns"])})
            for k, c in d["classes"].items()
        }
        backends = {
            k: BackendSnapshot(**{**b, "models": tuple(b["models"])})
            for k, b in d["backends"].items()
        }
        return cls(
            pressure=d["pressure"],
            algorithm=d["algorithm"],
            expected_ttft_s=d["expected_ttft_s"],
            aged_dispatches=d["aged_dispatches"],
            fleet=FleetSnapshot(**d["fleet"]),
            classes=classes,
            backends=backends,
        )
