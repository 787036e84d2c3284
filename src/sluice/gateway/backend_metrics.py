"""Parse an inference server's Prometheus /metrics into `BackendMetrics`.

Knows vLLM's current (V1) and older metric names, and SGLang's. Histograms are turned into
P95s over the window since the previous scrape (bucket deltas), so the figures are recent
rather than lifetime averages. Pure: text in, numbers out."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families

from sluice.core.types import BackendMetrics

# Gauge/counter names, first match wins (newest name first). Family names as the parser
# reports them (counters lose their `_total` suffix).
_GAUGES: dict[str, tuple[str, ...]] = {
    "running": ("vllm:num_requests_running", "sglang:num_running_reqs"),
    "waiting": ("vllm:num_requests_waiting", "sglang:num_queue_reqs"),
    "kv_usage": ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc", "sglang:token_usage"),
    "preemptions_total": ("vllm:num_preemptions", "sglang:num_retracted_reqs"),
}
_TTFT = ("vllm:time_to_first_token_seconds", "sglang:time_to_first_token_seconds")
_TPOT = (
    "vllm:inter_token_latency_seconds",
    "vllm:time_per_output_token_seconds",
    "sglang:inter_token_latency_seconds",
    "sglang:time_per_output_token_seconds",
)


@dataclass
class _Histogram:
    buckets: dict[float, float] = field(default_factory=dict)  # le -> cumulative count


def _quantile(cumulative: list[tuple[float, float]], q: float) -> float | None:
    """Prometheus-style histogram_quantile over (le, cumulative count) pairs."""
    if not cumulative:
        return None
    total = cumulative[-1][1]
    if total <= 0:
        return None
    rank = q * total
    prev_le, prev_count = 0.0, 0.0
    for le, count in cumulative:
        if count >= rank:
            if math.isinf(le):
                return prev_le
            if count == prev_count:
                return le
            return prev_le + (le - prev_le) * (rank - prev_count) / (count - prev_count)
        prev_le, prev_count = le, count
    return prev_le


class MetricsParser:
    """Keeps the previous scrape's histograms so each scrape yields windowed P95s."""

    def __init__(self) -> None:
        self._prev: dict[str, _Histogram] = {}

    def parse(self, text: str, at: float) -> BackendMetrics:
        values: dict[str, float] = {}
        hists: dict[str, _Histogram] = {}
        num_gpu_blocks: int | None = None
        block_size: int | None = None
        for family in text_string_to_metric_families(text):
            name = family.name
            if name == "vllm:cache_config_info":
                for s in family.samples:
                    num_gpu_blocks = _int_label(s.labels.get("num_gpu_blocks"))
                    block_size = _int_label(s.labels.get("block_size"))
                continue
            if name in _TTFT or name in _TPOT:
                h = hists.setdefault(name, _Histogram())
                for s in family.samples:
                    if s.name.endswith("_bucket"):
                        le = float(s.labels["le"])
                        h.buckets[le] = h.buckets.get(le, 0.0) + s.value
                continue
            for s in family.samples:
                if s.name.endswith(("_created", "_bucket", "_sum", "_count")):
                    continue
                # Counters appear as NAME_total whichever way the TYPE line spells them.
                key = s.name.removesuffix("_total")
                values[key] = values.get(key, 0.0) + s.value  # summed over label sets
        found = {key: _first(values, names) for key, names in _GAUGES.items()}
        ttft = self._windowed_p95(hists, _TTFT)
        tpot = self._windowed_p95(hists, _TPOT)
        self._prev = hists
        return BackendMetrics(
            at=at,
            running=found["running"],
            waiting=found["waiting"],
            kv_usage=found["kv_usage"],
            preemptions_total=found["preemptions_total"],
            num_gpu_blocks=num_gpu_blocks,
            block_size=block_size,
            ttft_p95_s=ttft,
            tpot_p95_s=tpot,
        )

    def _windowed_p95(self, hists: dict[str, _Histogram], names: tuple[str, ...]) -> float | None:
        for name in names:
            h = hists.get(name)
            if h is None:
                continue
            prev = self._prev.get(name)
            window = []
            for le in sorted(h.buckets):
                before = prev.buckets.get(le, 0.0) if prev else 0.0
                # A restarted backend resets its counters: fall back to the lifetime figures.
                window.append((le, h.buckets[le] - before))
            if window and window[-1][1] < 0:
                window = [(le, h.buckets[le]) for le in sorted(h.buckets)]
            return _quantile(window, 0.95)
        return None


def _first(values: dict[str, float], names: tuple[str, ...]) -> float | None:
    for n in names:
        if n in values:
            return values[n]
    return None


def _int_label(value: str | None) -> int | None:
    if value is None:
        return None
    try:
        return int(float(value))
    except ValueError:
        return None
