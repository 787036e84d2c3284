"""TensorRT-LLM's `trtllm-serve`: JSON iteration statistics on /metrics, and (newer
versions, with `return_perf_metrics`) Prometheus `trtllm_*` series on /prometheus/metrics.

From TensorRT-LLM's own source: `tensorrt_llm/serve/openai_server.py` registers /metrics
as `get_iteration_stats`, which drains the iteration statistics queued since the last call
and answers them as a JSON list (`[]` when no iteration ran), and mounts
/prometheus/metrics only when `return_perf_metrics` is set; the PyTorch backend queues
iteration statistics only with `enable_iter_perf_stats: true`
(`docs/source/commands/trtllm-serve.rst`). An iteration's fields, as
`tests/unittest/llmapi/apps/_test_openai_metrics.py` checks them (0.17 to 1.x):
`numActiveRequests`, `numQueuedRequests`, `maxNumActiveRequests`, `iterLatencyMS`,
`kvCacheStats{maxNumBlocks, freeNumBlocks, usedNumBlocks, tokensPerBlock, ...}` and
`inflightBatchingStats{numScheduledRequests, numContextRequests, numGenRequests,
numPausedRequests, numCtxTokens, ...}`. The Prometheus names are those of
`tensorrt_llm/metrics/collector.py` (MetricsCollector): `trtllm_num_requests_running`,
`trtllm_num_requests_waiting`, `trtllm_kv_cache_utilization`, `trtllm_kv_cache_max_blocks`,
`trtllm_kv_cache_tokens_per_block` (or the `tokens_per_block`/`block_size` label of
`trtllm_kv_cache_config_info`), `trtllm_num_paused_requests`, and the histograms
`trtllm_time_to_first_token_seconds` and `trtllm_time_per_output_token_seconds` (the
only latency series TensorRT-LLM has: without /prometheus/metrics there is no TTFT or
TPOT P95).

Read here: the last iteration of each page. Waiting counts the paused requests too (they
wait to be scheduled again, as Dynamo's TensorRT-LLM worker counts them). There is no
preemption counter: its nearest equivalent is made from `numPausedRequests` (the
scheduler pauses requests when the KV cache runs out under the MAX_UTILIZATION
policy), rising by every pause an iteration adds. An empty page means no iteration ran
since the last scrape: the engine is idle (nothing running or waiting)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from sluice.core.types import BackendMetrics
from sluice.gateway.engines.base import EngineAdapter, Route, json_list
from sluice.gateway.engines.prom import Scanner, WindowedP95, int_or_none

JSON_ROUTE = "/metrics"
PROM_ROUTE = "/prometheus/metrics"
RUNNING = "trtllm_num_requests_running"
WAITING = "trtllm_num_requests_waiting"
UTILIZATION = "trtllm_kv_cache_utilization"
MAX_BLOCKS = "trtllm_kv_cache_max_blocks"
TOKENS_PER_BLOCK = "trtllm_kv_cache_tokens_per_block"
PAUSED = "trtllm_num_paused_requests"
CONFIG_INFO = ("trtllm_kv_cache_config_info", "trtllm_cache_config_info")
TTFT = ("trtllm_time_to_first_token_seconds",)
TPOT = ("trtllm_time_per_output_token_seconds",)


def is_iteration_stats(text: str) -> bool:
    """Whether a /metrics body is trtllm-serve's JSON list of iteration statistics."""
    return text.lstrip()[:1] == "["


def _num(d: Any, *keys: str) -> float | None:
    for k in keys:
        if not isinstance(d, dict):
            return None
        d = d.get(k)
    if isinstance(d, bool) or not isinstance(d, int | float):
        return None
    return float(d)


class TrtllmAdapter(EngineAdapter):
    name = "trtllm"
    routes = (Route(JSON_ROUTE, required=True), Route(PROM_ROUTE))
    start_hint = (
        "start trtllm-serve with `enable_iter_perf_stats: true` (PyTorch backend) and "
        "`return_perf_metrics: true` in --extra_llm_api_options (TTFT/TPOT on "
        "/prometheus/metrics)"
    )

    def __init__(self) -> None:
        values = (RUNNING, WAITING, UTILIZATION, MAX_BLOCKS, TOKENS_PER_BLOCK, PAUSED)
        self._scan = Scanner(values, (*TTFT, *TPOT), CONFIG_INFO)
        self._ttft = WindowedP95()
        self._tpot = WindowedP95()
        self._last: dict[str, Any] | None = None  # the last iteration seen
        self._paused = 0.0
        self._pauses = 0.0  # the counter made from numPausedRequests

    def read(self, pages: Mapping[str, str], at: float) -> BackendMetrics:
        fields: dict[str, Any] = {}
        body = pages.get(JSON_ROUTE, "")
        prom_text = pages.get(PROM_ROUTE, "")
        if body and not is_iteration_stats(body):
            prom_text = prom_text or body  # a version that answers Prometheus on /metrics
        elif body:
            self._read_iterations(body, fields)
        has: dict[str, bool] = {}
        if prom_text:
            has = self._read_prometheus(prom_text, fields)
        return self.metrics(at, **has, **fields)

    def _read_iterations(self, body: str, fields: dict[str, Any]) -> None:
        stats = json_list(body, "iteration stats")
        for s in stats:
            paused = _num(s, "inflightBatchingStats", "numPausedRequests") or 0.0
            self._pauses += max(0.0, paused - self._paused)
            self._paused = paused
        if stats:
            self._last = stats[-1]
        last = self._last
        if last is None:
            return  # no iteration yet (or enable_iter_perf_stats is off): nothing known
        idle = not stats
        running = 0.0 if idle else _num(last, "numActiveRequests")
        queued = 0.0 if idle else _num(last, "numQueuedRequests")
        paused = 0.0 if idle else (_num(last, "inflightBatchingStats", "numPausedRequests") or 0.0)
        kv = last.get("kvCacheStats")
        max_blocks = _num(kv, "maxNumBlocks")
        used = _num(kv, "usedNumBlocks")
        per_block = _num(kv, "tokensPerBlock")
        fields["running"] = running
        fields["waiting"] = None if queued is None else queued + paused
        if max_blocks and used is not None:
            fields["kv_usage"] = used / max_blocks
        if max_blocks and per_block:
            fields["num_gpu_blocks"] = int(max_blocks)
            fields["block_size"] = int(per_block)
        fields["preemptions_total"] = self._pauses

    def _read_prometheus(self, text: str, fields: dict[str, Any]) -> dict[str, bool]:
        """Latency histograms, and the rest when the iteration statistics did not say it;
        which histograms are on the page."""
        page = self._scan.scan(text)
        v = page.values
        ttft, has_ttft = self._ttft.update(page, TTFT)
        tpot, has_tpot = self._tpot.update(page, TPOT)
        fields["ttft_p95_s"], fields["tpot_p95_s"] = ttft, tpot
        has = {"has_ttft": has_ttft, "has_tpot": has_tpot}
        if fields.get("running") is not None:
            return has  # the iteration statistics said the rest
        per_block = v.get(TOKENS_PER_BLOCK)
        if per_block is None:
            for name in CONFIG_INFO:
                info = page.infos.get(name, {})
                per_block = int_or_none(info.get("tokens_per_block") or info.get("block_size"))
                if per_block:
                    break
        fields["running"] = v.get(RUNNING)
        fields["waiting"] = v.get(WAITING)
        fields["kv_usage"] = v.get(UTILIZATION)
        if v.get(MAX_BLOCKS) and per_block:
            fields["num_gpu_blocks"] = int(v[MAX_BLOCKS])
            fields["block_size"] = int(per_block)
        if PAUSED in v:
            self._pauses += max(0.0, v[PAUSED] - self._paused)
            self._paused = v[PAUSED]
            fields["preemptions_total"] = self._pauses
        return has
