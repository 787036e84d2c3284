"""The gateway's Prometheus metrics (prefix `sluice_`), on a registry of its own.

Counters and histograms are updated on the request path through pre-bound children's
own `inc` and `observe` (prometheus_client's public API; a labels() lookup per event would
cost more than the event). Gauges that describe the controller's state (queue depth,
limits, in-flight, pressure) are read from its snapshot when /metrics is scraped, so the
hot path pays nothing for them.

Under `sluice serve --workers N` (PROMETHEUS_MULTIPROC_DIR set by the master) every
worker writes its values to files in that folder and /metrics, whichever worker answers
it, adds them up with prometheus_client's MultiProcessCollector. A scrape cannot read the
other workers' controllers, so there the state gauges are set from the snapshot every
`STATE_PUBLISH_S` instead, each with the way workers combine: queue depths, in-flight and
limits add up (`livesum`), pressure and backend-reported figures take the worst
(`livemax`), health the least (`livemin`)."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable, Iterable, Iterator
from typing import Any, Literal, NamedTuple, TypeVar

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.registry import Collector

from sluice import __version__
from sluice.core.snapshot import BackendSnapshot, ControllerSnapshot

LATENCY_BUCKETS = (0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 15.0, 30.0, 60.0, 120.0)
STATE_PUBLISH_S = 0.5
QUOTA_MODES = ("redis", "local")


# (priority, route): what the request path's metrics are labelled by
MetricKey = tuple[int, str]


K = TypeVar("K")


class _Bound(dict[K, Callable[[float], None]]):
    """Pre-bound metric updates, made on first use of a key."""

    def __init__(self, make: Callable[[K], Callable[[float], None]]) -> None:
        super().__init__()
        self._make = make

    def __missing__(self, key: K) -> Callable[[float], None]:
        update = self[key] = self._make(key)
        return update


def multiprocess_dir() -> str | None:
    """The folder prometheus_client shares values through, when this is one of several
    worker processes (prometheus_client reads the same variable at import)."""
    return os.environ.get("PROMETHEUS_MULTIPROC_DIR") or None


class Telemetry:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.multiprocess = multiprocess_dir() is not None
        self._mp_registry: CollectorRegistry | None = None
        self._mp_collector: MultiProcessCollector | None = None
        if self.multiprocess:
            self._mp_registry = CollectorRegistry()
            self._mp_collector = MultiProcessCollector(self._mp_registry)
        self._state: _StateGauges | None = None
        self._publisher: asyncio.Task[None] | None = None
        self.requests = Counter(
            "sluice_requests",
            "Requests answered, by class, route and outcome",
            ["priority", "route", "outcome"],
            registry=r,
        )
        self.rejections = Counter(
            "sluice_rejections",
            "Requests refused with 429/503 (529 on the Anthropic route), by class, route and cause",
            ["priority", "route", "code"],
            registry=r,
        )
        self.retries = Counter(
            "sluice_client_retries",
            "Requests that are a client's retry, by class and client",
            ["priority", "client"],
            registry=r,
        )
        self.aborts = Counter(
            "sluice_upstream_aborts",
            "Upstream requests closed because the client went away",
            ["backend"],
            registry=r,
        )
        self.upstream_errors = Counter(
            "sluice_upstream_errors",
            "Upstream failures, by backend and kind",
            ["backend", "kind"],
            registry=r,
        )
        self.stalls = Counter(
            "sluice_host_stall_seconds",
            "Time the host did not run this gateway process at all (stalls of 50 ms or "
            "more; taken out of the limiters' latency samples)",
            registry=r,
        )
        self.slow_clients = Counter(
            "sluice_slow_client_disconnects",
            "Connections closed because no complete request head arrived within "
            "server.headerTimeout",
            registry=r,
        )
        self.malformed = Counter(
            "sluice_malformed_requests",
            "Requests the HTTP parser refused (bad request line or header, smuggling), "
            "answered without reaching a route, by status",
            ["status"],
            registry=r,
        )
        self.connections_refused = Counter(
            "sluice_connections_refused",
            "Client connections answered 503 too_many_connections and closed: the process "
            "held server.maxConnections already",
            registry=r,
        )
        self.fallbacks = Counter(
            "sluice_fallbacks",
            "Requests answered with a feature's fallback",
            ["feature"],
            registry=r,
        )
        self.reloads = Counter(
            "sluice_policy_reloads",
            "Policy reloads, by result (ok, refused)",
            ["result"],
            registry=r,
        )
        self.policy_ok = Gauge(
            "sluice_policy_last_reload_ok",
            "1 if the last policy reload was applied, 0 if "
            "it was refused (the previous policy stays in force)",
            registry=r,
            multiprocess_mode="livemin",
        )
        self.quota_backend = Gauge(
            "sluice_quota_backend",
            "Where tenant quotas are enforced when Redis is "
            "configured: redis (shared by all replicas) or local (Redis unreachable: each "
            "process on its own); with several workers, the number of workers in each mode",
            ["mode"],
            registry=r,
            multiprocess_mode="livesum",
        )
        self.quota_errors = Counter(
            "sluice_quota_redis_errors",
            "Failed Redis quota calls, by kind (timeout, connection, error)",
            ["kind"],
            registry=r,
        )
        self.policy_ok.set(1)
        self.build_info = Gauge(
            "sluice_build_info",
            "Always 1; the label says which version of Sluice runs (replicas mid-rollout differ)",
            ["version"],
            registry=r,
            multiprocess_mode="max",
        )
        self.build_info.labels(__version__).set(1)
        self.breaker_open = Gauge(
            "sluice_breaker_open",
            "1 while a circuit breaker refuses (open), 0.5 while it probes (half-open), 0 when "
            "closed; kind is backend or feature",
            ["kind", "name"],
            registry=r,
            multiprocess_mode="livemax",
        )
        self.breaker_transitions = Counter(
            "sluice_breaker_transitions",
            "Circuit breaker state changes, by breaker and the state entered",
            ["kind", "name", "state"],
            registry=r,
        )
        self.ttft = Histogram(
            "sluice_ttft_seconds",
            "Time to first token seen by the client, by class and route",
            ["priority", "route"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.latency = Histogram(
            "sluice_request_duration_seconds",
            "End-to-end request time, by class and route",
            ["priority", "route"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.retry_after = Histogram(
            "sluice_retry_after_seconds",
            "Retry-After given with each refusal that carries one, by class",
            ["priority"],
            buckets=(0.5, 1, 2, 5, 10, 15, 20, 30, 45, 60),
            registry=r,
        )
        self.queue_wait = Histogram(
            "sluice_queue_wait_seconds",
            "Time spent queued before dispatch, by class and route",
            ["priority", "route"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        # The request path's updates, bound per (priority, route) (its `ctx.metric_key`)
        # on first use and indexed directly, no method call between (the request path's
        # hottest calls): `count[key, outcome](1)`, `observe_latency[key](seconds)`.
        self.count: _Bound[tuple[MetricKey, str]] = _Bound(
            lambda k: self.requests.labels(str(k[0][0]), k[0][1], k[1]).inc
        )
        self.observe_ttft: _Bound[MetricKey] = _Bound(
            lambda k: self.ttft.labels(str(k[0]), k[1]).observe
        )
        self.observe_latency: _Bound[MetricKey] = _Bound(
            lambda k: self.latency.labels(str(k[0]), k[1]).observe
        )
        self.observe_queue_wait: _Bound[MetricKey] = _Bound(
            lambda k: self.queue_wait.labels(str(k[0]), k[1]).observe
        )

    def rejected(self, key: MetricKey, code: str) -> None:
        self.rejections.labels(str(key[0]), key[1], code).inc()

    def policy_reloaded(self, ok: bool, _errors: list[str]) -> None:
        self.reloads.labels("ok" if ok else "refused").inc()
        self.policy_ok.set(1 if ok else 0)

    def breaker_changed(self, breaker: str, state: str) -> None:
        """`breaker` is "kind:name" (CircuitBreaker's name)."""
        kind, _, name = breaker.partition(":")
        value = {"open": 1.0, "half_open": 0.5}.get(state, 0.0)
        self.breaker_open.labels(kind, name).set(value)
        self.breaker_transitions.labels(kind, name, state).inc()

    def malformed_request(self, status: int) -> None:
        self.malformed.labels(str(status)).inc()

    def breaker_removed(self, breaker: str) -> None:
        """A reload removed the breaker's feature: it refuses nothing any more."""
        kind, _, name = breaker.partition(":")
        self.breaker_open.labels(kind, name).set(0.0)

    def set_quota_mode(self, mode: str) -> None:
        for m in QUOTA_MODES:
            self.quota_backend.labels(m).set(1 if m == mode else 0)

    def quota_error(self, kind: str) -> None:
        self.quota_errors.labels(kind).inc()

    def render(self) -> bytes:
        """The /metrics body: this process's registry, or all workers' values added up."""
        if self._mp_registry is None:
            return generate_latest(self.registry)
        self.publish_state()
        return generate_latest(self._mp_registry)

    def _families(self, *metrics: Any) -> Iterable[Metric]:
        if self._mp_collector is None:
            return [f for m in metrics for f in m.collect()]
        names = {f.name for m in metrics for f in m.describe()}  # the families' names
        return [f for f in self._mp_collector.collect() if f.name in names]

    def counters(self) -> dict[str, Any]:
        """Cumulative counters for the dashboard: answers by class and outcome, refusals by
        class and cause, and TTFT and Retry-After sum/count by class (of all workers)."""
        out: dict[str, Any] = {"requests": {}, "rejections": {}, "ttft": {}, "retry_after": {}}
        for metric, key, label in (
            (self.requests, "requests", "outcome"),
            (self.rejections, "rejections", "code"),
        ):
            for family in self._families(metric):
                for s in family.samples:
                    if s.name.endswith("_total"):
                        by_class = out[key].setdefault("P" + s.labels["priority"], {})
                        what = s.labels[label]  # over every route
                        by_class[what] = by_class.get(what, 0.0) + s.value
        histograms: tuple[tuple[Histogram, str], ...] = (
            (self.ttft, "ttft"),
            (self.retry_after, "retry_after"),
        )
        for hist, key in histograms:
            for family in self._families(hist):
                for s in family.samples:
                    if s.name.endswith(("_sum", "_count")):
                        entry = out[key].setdefault("P" + s.labels["priority"], {})
                        part = s.name.rsplit("_", 1)[1]
                        entry[part] = entry.get(part, 0.0) + s.value
        return out

    def watch_state(self, snapshot: Callable[[], ControllerSnapshot]) -> None:
        if self.multiprocess:
            self._state = _StateGauges(snapshot, self.registry)
        else:
            self.registry.register(_StateCollector(snapshot))

    def publish_state(self) -> None:
        """Multiprocess mode: set the state gauges from the controller now."""
        if self._state is not None:
            self._state.publish()

    def start(self) -> None:
        """In multiprocess mode, publish the state gauges every STATE_PUBLISH_S (call
        from the running loop)."""
        if self._state is not None and self._publisher is None:
            self._publisher = asyncio.create_task(self._publish_forever(), name="state-gauges")

    def stop(self) -> None:
        if self._publisher is not None:
            self._publisher.cancel()
            self._publisher = None

    async def _publish_forever(self) -> None:
        while True:
            self.publish_state()
            await asyncio.sleep(STATE_PUBLISH_S)


# how a gauge's values from several workers combine (prometheus_client's names)
CombineMode = Literal["livesum", "livemax", "livemin"]


class BackendGauge(NamedTuple):
    """A gauge per backend, read from its entry in the controller's snapshot."""

    metric: str
    help: str
    combine: CombineMode  # how workers' values combine
    value: Callable[[BackendSnapshot], float | None]  # None: no sample


PER_BACKEND: tuple[BackendGauge, ...] = (
    BackendGauge(
        "sluice_backend_limit", "Adaptive concurrency limit", "livesum", lambda b: b.limit
    ),
    BackendGauge("sluice_backend_inflight", "Requests in flight", "livesum", lambda b: b.inflight),
    BackendGauge(
        "sluice_backend_kv_usage",
        "KV-cache usage the backend reports, 0..1",
        "livemax",
        lambda b: b.kv_usage,
    ),
    BackendGauge(
        "sluice_backend_waiting",
        "Requests waiting inside the backend",
        "livemax",
        lambda b: b.waiting,
    ),
    BackendGauge(
        "sluice_backend_healthy", "1 if the backend is in service", "livemin", lambda b: b.healthy
    ),
    BackendGauge(
        "sluice_backend_metrics_fresh",
        "1 if the backend's metrics are fresh (else latency-only control)",
        "livemin",
        lambda b: b.metrics_fresh,
    ),
)


SIGNAL_METRIC = (
    "sluice_backend_signal",
    "1 if the backend's engine exports this signal to the limiter, 0 if it lacks it",
)


def _signal_samples(s: ControllerSnapshot) -> Iterator[tuple[tuple[str, str, str], float]]:
    """((backend, engine, signal), 1 or 0) for every backend whose engine is known."""
    for name, b in s.backends.items():
        if b.signals:
            for signal, has in b.signals.items():
                yield (name, b.engine or "", signal), 1.0 if has else 0.0


class _StateGauges:
    """Multiprocess mode: the state gauges as real gauges, set from the snapshot."""

    def __init__(
        self, snapshot: Callable[[], ControllerSnapshot], registry: CollectorRegistry
    ) -> None:
        self._snapshot = snapshot
        self.pressure = Gauge(
            "sluice_pressure",
            "Overload pressure, 0..1",
            registry=registry,
            multiprocess_mode="livemax",
        )
        self.depth = Gauge(
            "sluice_queue_depth",
            "Requests queued",
            ["priority"],
            registry=registry,
            multiprocess_mode="livesum",
        )
        self.oldest = Gauge(
            "sluice_queue_oldest_seconds",
            "Wait of the oldest queued request",
            ["priority"],
            registry=registry,
            multiprocess_mode="livemax",
        )
        self.backend: list[tuple[Callable[[BackendSnapshot], float | None], Gauge]] = []
        for g in PER_BACKEND:
            mode = g.combine
            gauge = Gauge(g.metric, g.help, ["backend"], registry=registry, multiprocess_mode=mode)
            self.backend.append((g.value, gauge))
        self.signal = Gauge(
            *SIGNAL_METRIC,
            ["backend", "engine", "signal"],
            registry=registry,
            multiprocess_mode="livemax",
        )
        self._backends: set[str] = set()

    def publish(self) -> None:
        s = self._snapshot()
        self.pressure.set(float(s.pressure))
        for cls, c in s.classes.items():
            prio = cls.removeprefix("P")
            self.depth.labels(prio).set(float(c.queued))
            self.oldest.labels(prio).set(float(c.head_sojourn_s))
        seen = set(s.backends)
        for name in self._backends - seen:
            # a value file cannot forget a label set: a backend that left reads 0
            for _, gauge in self.backend:
                gauge.labels(name).set(0.0)
        self._backends |= seen
        for name, b in s.backends.items():
            for read, gauge in self.backend:
                value = read(b)
                if value is not None:
                    gauge.labels(name).set(float(value))
        for labels, value in _signal_samples(s):
            self.signal.labels(*labels).set(value)


class _StateCollector(Collector):
    """Gauges read from the controller's snapshot at scrape time."""

    def __init__(self, snapshot: Callable[[], ControllerSnapshot]) -> None:
        self._snapshot = snapshot

    def describe(self) -> list[Any]:
        return []

    def collect(self) -> Iterator[GaugeMetricFamily]:
        s = self._snapshot()
        pressure = GaugeMetricFamily("sluice_pressure", "Overload pressure, 0..1")
        pressure.add_metric([], float(s.pressure))
        yield pressure
        depth = GaugeMetricFamily("sluice_queue_depth", "Requests queued", labels=["priority"])
        oldest = GaugeMetricFamily(
            "sluice_queue_oldest_seconds",
            "Wait of the oldest queued request",
            labels=["priority"],
        )
        for cls, c in s.classes.items():
            prio = cls.removeprefix("P")
            depth.add_metric([prio], float(c.queued))
            oldest.add_metric([prio], float(c.head_sojourn_s))
        yield depth
        yield oldest
        families = [
            (g.value, GaugeMetricFamily(g.metric, g.help, labels=["backend"])) for g in PER_BACKEND
        ]
        for name, b in s.backends.items():
            for read, fam in families:
                value = read(b)
                if value is not None:
                    fam.add_metric([name], float(value))
        yield from (fam for _, fam in families)
        signal = GaugeMetricFamily(*SIGNAL_METRIC, labels=["backend", "engine", "signal"])
        for labels, value in _signal_samples(s):
            signal.add_metric(list(labels), value)
        yield signal
