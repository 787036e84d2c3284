"""Hugging Face Text Generation Inference: its router's /metrics (Prometheus, rendered by
the metrics-rs exporter) and /info.

From TGI's own source (v1.4 to v3.3.7): `backends/v3/src/backend.rs` and
`backends/v2/src/backend.rs` set the gauges `tgi_batch_current_size` (requests in the
running batch) and `tgi_batch_current_max_tokens` (the tokens the running batch may reach:
TGI reserves each request's input plus max_new_tokens), `backends/*/src/queue.rs` sets
`tgi_queue_size` (requests waiting in the router's queue), `backends/v3/src/lib.rs` sets
`tgi_batch_max_total_tokens` once after warm-up (v2.4 on); older routers state the same
figure as `max_batch_total_tokens` in /info (`router/src/lib.rs`, struct Info, v1 to
v2.x). `router/src/server.rs` records the histogram
`tgi_request_mean_time_per_token_duration` (each request's mean time per output token;
every `*_duration` series gets buckets) and answers /metrics with the exporter's text.

What TGI lacks: a time-to-first-token series (it records queue time and whole-request
durations, not the first token), and preemptions (a batch's tokens are reserved when it is
admitted, so nothing is preempted). KV usage is the running batch's reserved tokens over
the capacity. /info's `max_concurrent_requests` (TGI answers 429 beyond it) caps the
limit."""

from __future__ import annotations

from collections.abc import Mapping

import orjson

from sluice.core.types import BackendMetrics
from sluice.gateway.engines.base import EngineAdapter, Route
from sluice.gateway.engines.prom import Scanner, WindowedP95

RUNNING = "tgi_batch_current_size"
WAITING = "tgi_queue_size"
RESERVED = "tgi_batch_current_max_tokens"
CAPACITY = "tgi_batch_max_total_tokens"
TPOT = ("tgi_request_mean_time_per_token_duration",)


class TgiAdapter(EngineAdapter):
    name = "tgi"
    routes = (Route("/metrics", required=True), Route("/info", once=True))
    start_hint = "TGI exports what it has on /metrics by default (it has no TTFT series)"

    def __init__(self) -> None:
        self._scan = Scanner((RUNNING, WAITING, RESERVED, CAPACITY), TPOT)
        self._tpot = WindowedP95()

    def read(self, pages: Mapping[str, str], at: float) -> BackendMetrics:
        page = self._scan.scan(pages["/metrics"])
        v = page.values
        capacity = v.get(CAPACITY) or _info_capacity(pages.get("/info"))
        reserved = v.get(RESERVED)
        usage = None
        if capacity and reserved is not None:
            usage = min(1.0, reserved / capacity)
        tpot, has_tpot = self._tpot.update(page, TPOT)
        return self.metrics(
            at,
            has_tpot=has_tpot,
            max_concurrency=_info_int(pages.get("/info"), "max_concurrent_requests"),
            running=v.get(RUNNING),
            waiting=v.get(WAITING),
            kv_usage=usage,
            kv_capacity_tokens=capacity,
            tpot_p95_s=tpot,
        )


def _info_int(body: str | None, key: str) -> int | None:
    if not body:
        return None
    try:
        info = orjson.loads(body)
    except orjson.JSONDecodeError:
        return None
    value = info.get(key) if isinstance(info, dict) else None
    ok = isinstance(value, int | float) and not isinstance(value, bool) and value > 0
    return int(value) if ok else None  # type: ignore[arg-type]


def _info_capacity(body: str | None) -> float | None:
    value = _info_int(body, "max_batch_total_tokens")
    return None if value is None else float(value)
