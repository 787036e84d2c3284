"""Parse an inference server's Prometheus /metrics into `BackendMetrics`.

Knows vLLM's current (V1) and older metric names, and SGLang's. Histograms are turned into
P95s over the window since the previous scrape (bucket deltas), so the figures are recent
rather than lifetime averages. Pure: text in, numbers out.

The gateway scrapes every 250 ms on its own event loop, and a vLLM /metrics page is ~56 KB
(~450 samples) of which about 40 lines matter here: a full Prometheus parse of it took
~24 ms of CPU, enough to stall every stream the gateway relays (and its notice of client
disconnects) under CPU contention. So the page is scanned line by line and only the lines
of the wanted series are parsed (well under a millisecond)."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

from sluice.core.types import BackendMetrics

# Gauge/counter names, first match wins (newest name first), without a counter's `_total`.
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
_CACHE_INFO = "vllm:cache_config_info"
_VALUES = frozenset(n for names in _GAUGES.values() for n in names)
_BUCKETS = {f"{h}_bucket": h for h in (*_TTFT, *_TPOT)}
# Cheap first filter: every wanted line starts with one of these names.
_STARTS = tuple(sorted({*_VALUES, *(f"{n}_total" for n in _VALUES), *_BUCKETS, _CACHE_INFO}))
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)\s*=\s*"((?:[^"\\]|\\.)*)"')
_LE = re.compile(r'(?:^|[,\s])le\s*=\s*"([^"]*)"')


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


def _sample(line: str) -> tuple[str, str, float]:
    """`name{labels} value [timestamp]` -> (name, labels text, value); ValueError if
    the line is not a sample."""
    brace = line.find("{")
    if brace < 0:
        parts = line.split()
        if len(parts) < 2:
            raise ValueError(f"not a sample: {line[:80]!r}")
        return parts[0], "", float(parts[1])
    close = line.rfind("}")
    rest = line[close + 1 :].split()
    if close < brace or not rest:
        raise ValueError(f"not a sample: {line[:80]!r}")
    return line[:brace].strip(), line[brace + 1 : close], float(rest[0])


def _labels(text: str) -> dict[str, str]:
    return {k: v.replace('\\"', '"').replace("\\\\", "\\") for k, v in _LABEL.findall(text)}


class MetricsParser:
    """Keeps the previous scrape's histograms so each scrape yields windowed P95s."""

    def __init__(self) -> None:
        self._prev: dict[str, _Histogram] = {}

    def parse(self, text: str, at: float) -> BackendMetrics:
        """Raises ValueError on a malformed line among the wanted series."""
        values: dict[str, float] = {}
        hists: dict[str, _Histogram] = {}
        num_gpu_blocks: int | None = None
        block_size: int | None = None
        for line in text.split("\n"):
            if not line.startswith(_STARTS):
                continue  # comments, blank lines, the other series
            end = line.find("{")
            if end < 0:
                end = line.find(" ")
            name = line[:end].rstrip() if end >= 0 else line
            key = name.removesuffix("_total")  # counters, whichever way TYPE spells them
            if key in _VALUES:
                _, _, value = _sample(line)
                values[key] = values.get(key, 0.0) + value  # summed over label sets
            elif name in _BUCKETS:
                _, labels, value = _sample(line)
                m = _LE.search(labels)
                if m is None:
                    raise ValueError(f"a histogram bucket without le: {line[:80]!r}")
                le = float(m.group(1))
                h = hists.setdefault(_BUCKETS[name], _Histogram())
                h.buckets[le] = h.buckets.get(le, 0.0) + value
            elif name == _CACHE_INFO:
                info = _labels(_sample(line)[1])
                num_gpu_blocks = _int_label(info.get("num_gpu_blocks"))
                block_size = _int_label(info.get("block_size"))
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
