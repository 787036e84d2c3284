"""The gateway's Prometheus metrics (prefix `sluice_`), on a registry of its own.

Counters and histograms are updated on the request path through pre-bound children (a
labels() lookup per event would cost more than the event). Gauges that describe the
controller's state (queue depth, limits, in-flight, pressure) are read from its snapshot
when /metrics is scraped, so the hot path pays nothing for them."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

CLASSES = ("0", "1", "2")
LATENCY_BUCKETS = (0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 15.0, 30.0, 60.0, 120.0)


class Telemetry:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter(
            "sluice_requests", "Requests answered, by class and outcome",
            ["priority", "outcome"], registry=r,
        )
        self.rejections = Counter(
            "sluice_rejections", "Requests refused with 429/503, by class and cause",
            ["priority", "code"], registry=r,
        )
        self.retries = Counter(
            "sluice_client_retries", "Requests that are a client's retry, by class and client",
            ["priority", "client"], registry=r,
        )
        self.aborts = Counter(
            "sluice_upstream_aborts", "Upstream requests closed because the client went away",
            ["backend"], registry=r,
        )
        self.upstream_errors = Counter(
            "sluice_upstream_errors", "Upstream failures, by backend and kind",
            ["backend", "kind"], registry=r,
        )
        self.fallbacks = Counter(
            "sluice_fallbacks", "Requests answered with a feature's fallback",
            ["feature"], registry=r,
        )
        self.reloads = Counter(
            "sluice_policy_reloads", "Policy reloads, by result (ok, refused)",
            ["result"], registry=r,
        )
        self.policy_ok = Gauge(
            "sluice_policy_last_reload_ok", "1 if the last policy reload was applied, 0 if "
            "it was refused (the previous policy stays in force)", registry=r,
        )
        self.policy_ok.set(1)
        self.ttft = Histogram(
            "sluice_ttft_seconds", "Time to first token seen by the client, by class",
            ["priority"], buckets=LATENCY_BUCKETS, registry=r,
        )
        self.latency = Histogram(
            "sluice_request_duration_seconds", "End-to-end request time, by class",
            ["priority"], buckets=LATENCY_BUCKETS, registry=r,
        )
        self.queue_wait = Histogram(
            "sluice_queue_wait_seconds", "Time spent queued before dispatch, by class",
            ["priority"], buckets=LATENCY_BUCKETS, registry=r,
        )
        self._ttft = {c: self.ttft.labels(c) for c in CLASSES}
        self._latency = {c: self.latency.labels(c) for c in CLASSES}
        self._queue_wait = {c: self.queue_wait.labels(c) for c in CLASSES}
        self._outcomes: dict[tuple[str, str], Any] = {}

    def outcome(self, priority: int, outcome: str) -> None:
        key = (str(priority), outcome)
        child = self._outcomes.get(key)
        if child is None:
            child = self._outcomes[key] = self.requests.labels(*key)
        child.inc()

    def observe_ttft(self, priority: int, seconds: float) -> None:
        self._ttft[str(priority)].observe(seconds)

    def observe_latency(self, priority: int, seconds: float) -> None:
        self._latency[str(priority)].observe(seconds)

    def observe_queue_wait(self, priority: int, seconds: float) -> None:
        self._queue_wait[str(priority)].observe(seconds)

    def policy_reloaded(self, ok: bool, _errors: list[str]) -> None:
        self.reloads.labels("ok" if ok else "refused").inc()
        self.policy_ok.set(1 if ok else 0)

    def counters(self) -> dict[str, Any]:
        """Cumulative counters for the dashboard: answers by class and outcome, refusals by
        class and cause, and TTFT sum/count by class."""
        out: dict[str, Any] = {"requests": {}, "rejections": {}, "ttft": {}}
        for metric, key, label in ((self.requests, "requests", "outcome"),
                                   (self.rejections, "rejections", "code")):
            for family in metric.collect():
                for s in family.samples:
                    if s.name.endswith("_total"):
                        by_class = out[key].setdefault("P" + s.labels["priority"], {})
                        by_class[s.labels[label]] = s.value
        for family in self.ttft.collect():
            for s in family.samples:
                if s.name.endswith(("_sum", "_count")):
                    entry = out["ttft"].setdefault("P" + s.labels["priority"], {})
                    entry[s.name.rsplit("_", 1)[1]] = s.value
        return out

    def watch_state(self, snapshot: Callable[[], dict[str, Any]]) -> None:
        self.registry.register(_StateCollector(snapshot))


class _StateCollector(Collector):
    """Gauges read from the controller's snapshot at scrape time."""

    def __init__(self, snapshot: Callable[[], dict[str, Any]]) -> None:
        self._snapshot = snapshot

    def describe(self) -> list[Any]:
        return []

    def collect(self) -> Iterator[GaugeMetricFamily]:
        s = self._snapshot()
        pressure = GaugeMetricFamily("sluice_pressure", "Overload pressure, 0..1")
        pressure.add_metric([], float(s["pressure"]))
        yield pressure
        depth = GaugeMetricFamily("sluice_queue_depth", "Requests queued", labels=["priority"])
        oldest = GaugeMetricFamily(
            "sluice_queue_oldest_seconds", "Wait of the oldest queued request",
            labels=["priority"],
        )
        for cls, c in s["classes"].items():
            prio = cls.removeprefix("P")
            depth.add_metric([prio], float(c["queued"]))
            oldest.add_metric([prio], float(c["head_sojourn_s"]))
        yield depth
        yield oldest
        per_backend = {
            "limit": ("sluice_backend_limit", "Adaptive concurrency limit"),
            "inflight": ("sluice_backend_inflight", "Requests in flight"),
            "kv_usage": ("sluice_backend_kv_usage", "KV-cache usage the backend reports, 0..1"),
            "waiting": ("sluice_backend_waiting", "Requests waiting inside the backend"),
            "healthy": ("sluice_backend_healthy", "1 if the backend is in service"),
            "metrics_fresh": ("sluice_backend_metrics_fresh",
                              "1 if the backend's metrics are fresh (else latency-only control)"),
        }
        families = {k: GaugeMetricFamily(n, h, labels=["backend"]) for k, (n, h) in
                    per_backend.items()}
        for name, b in s["backends"].items():
            for key, fam in families.items():
                value = b.get(key)
                if value is not None:
                    fam.add_metric([name], float(value))
        yield from families.values()
