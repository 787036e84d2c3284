"""llama.cpp's `llama-server`: its /metrics (Prometheus text, only with `--metrics`) and
its /slots (JSON, on by default in current builds; `--slots` in older ones).

From llama.cpp's own source: `tools/server/server-task.cpp` (`to_metrics`; before the
2025 split, `examples/server/server.cpp` and then `tools/server/server.cpp`) writes the
gauges `llamacpp:requests_processing` (slots busy) and `llamacpp:requests_deferred`
(requests waiting for a slot: llama.cpp defers every request beyond its `--parallel`
slots), `llamacpp:n_busy_slots_per_decode`, throughput averages and token counters;
builds of 2024 to spring 2025 also wrote `llamacpp:kv_cache_usage_ratio` and
`llamacpp:kv_cache_tokens`. The slot's `to_json` (`server-context.cpp`) gives `id`,
`n_ctx`, `is_processing` (`state` in 2024 builds), `next_token{n_decoded, n_remain}` (an
object, a one-element list from late 2025), and from late 2025 `n_prompt_tokens`, and
then `n_past` (tokens in the slot's cache).

Read here: running and waiting from /metrics; KV usage from `kv_cache_usage_ratio` where
it exists, else from /slots (tokens in the busy slots' caches over the slots' context);
capacity from /slots (the slots' `n_ctx`, each slot's share of `--ctx-size`; with
`--kv-unified` every slot reports the whole context, and the capacity reads that many
times too large: the busy and deferred counts still hold the limit); the engine's
concurrency cap from /slots too: one request per slot, since a request beyond the slots
is deferred first come first served (no throughput gained, and a P0 request sent after
it waits behind it). llama.cpp has no preemption (each slot owns its context) and no
latency histograms: no TTFT or TPOT P95. Without `--metrics`, running comes from /slots
and waiting is missing (the limiter then compares its in-flight count with the busy
slots)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from sluice.core.types import BackendMetrics
from sluice.gateway.engines.base import EngineAdapter, Route, json_list
from sluice.gateway.engines.prom import Scanner

RUNNING = "llamacpp:requests_processing"
WAITING = "llamacpp:requests_deferred"
KV_RATIO = "llamacpp:kv_cache_usage_ratio"


class LlamacppAdapter(EngineAdapter):
    name = "llamacpp"
    routes = (Route("/metrics"), Route("/slots"))
    start_hint = "start llama-server with --metrics (and --slots on builds before 2025)"

    def __init__(self) -> None:
        self._scan = Scanner((RUNNING, WAITING, KV_RATIO))

    def read(self, pages: Mapping[str, str], at: float) -> BackendMetrics:
        if "/metrics" not in pages and "/slots" not in pages:
            raise ValueError("neither /metrics nor /slots answered")
        v = self._scan.scan(pages["/metrics"]).values if "/metrics" in pages else {}
        slots = json_list(pages["/slots"], "/slots") if "/slots" in pages else None
        running = v.get(RUNNING)
        usage = v.get(KV_RATIO)
        capacity, cap = None, None
        if slots is not None:
            capacity = float(sum(_num(s.get("n_ctx")) for s in slots)) or None
            cap = len(slots) or None
            if running is None:
                running = float(sum(_busy(s) for s in slots))
            if usage is None and capacity:
                used = [_tokens(s) for s in slots if _busy(s)]
                if all(u is not None for u in used):
                    usage = min(1.0, sum(u or 0 for u in used) / capacity)
        return self.metrics(
            at,
            running=running,
            waiting=v.get(WAITING),
            kv_usage=usage,
            kv_capacity_tokens=capacity,
            max_concurrency=cap,
        )


def _num(value: Any) -> float:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else 0.0


def _busy(slot: dict[str, Any]) -> bool:
    if "is_processing" in slot:
        return bool(slot["is_processing"])
    return _num(slot.get("state")) != 0  # 2024 builds: 0 idle, 1 processing


def _tokens(slot: dict[str, Any]) -> float | None:
    """Tokens in a busy slot's cache, when the build says."""
    if "n_past" in slot:
        return _num(slot["n_past"])
    nt = slot.get("next_token")
    if isinstance(nt, list):
        nt = nt[0] if nt else {}
    if "n_prompt_tokens" in slot and isinstance(nt, dict):
        return _num(slot["n_prompt_tokens"]) + _num(nt.get("n_decoded"))
    return None
