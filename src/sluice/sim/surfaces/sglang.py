"""SGLang's surface: `sglang:*` names of `python/sglang/srt/metrics/collector.py` (0.5.10:
sglang:max_total_num_tokens, sglang:cache_config_info{page_size,num_pages}, the retraction
counter, TTFT and inter-token histograms). SGLang allocates as tokens come and retracts
(preempts) running requests when the pool runs out, like vLLM."""

from __future__ import annotations

from collections.abc import Callable

from sluice.sim.engine import Engine, EngineSnapshot, StepResult
from sluice.sim.metrics import ITL_BUCKETS, TTFT_BUCKETS
from sluice.sim.surfaces.base import LatencyHists, Surface, SurfaceMetrics, hist_lines, sample, text


class _SglangMetrics(SurfaceMetrics):
    def __init__(self, engine: Engine, model_name: str, snapshot: Callable[[], EngineSnapshot]):
        self.profile = engine.profile
        self.labels = f'engine_type="unified",model_name="{model_name}"'
        self.snapshot = snapshot
        self.hists = LatencyHists(TTFT_BUCKETS, ITL_BUCKETS)

    def observe_step(self, result: StepResult, snap: EngineSnapshot) -> None:
        self.hists.observe(result)

    def render(self, path: str) -> tuple[bytes, str]:
        s, p, lb = self.snapshot(), self.profile, self.labels
        used = s.used_blocks * s.block_size
        lines = [
            *sample("sglang:num_running_reqs", s.running, labels=lb),
            *sample("sglang:num_queue_reqs", s.waiting, labels=lb),
            *sample("sglang:num_used_tokens", used, labels=lb),
            *sample("sglang:token_usage", s.kv_usage, labels=lb),
            *sample("sglang:max_total_num_tokens", p.kv_capacity_tokens, labels=lb),
            *sample(
                "sglang:cache_config_info",
                1.0,
                labels=f'num_pages="{p.num_gpu_blocks}",page_size="{p.block_size}"',
            ),
            *sample("sglang:num_retracted_requests_total", s.num_preemptions_total, "counter", lb),
            *hist_lines("sglang:time_to_first_token_seconds", self.hists.ttft, lb),
            *hist_lines("sglang:inter_token_latency_seconds", self.hists.itl, lb),
        ]
        return text(lines)


class SglangSurface(Surface):
    name = "sglang"
    owned_by = "sglang"

    def metrics(
        self, engine: Engine, model_name: str, snapshot: Callable[[], EngineSnapshot]
    ) -> SurfaceMetrics:
        return _SglangMetrics(engine, model_name, snapshot)
