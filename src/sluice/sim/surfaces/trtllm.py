"""TensorRT-LLM's `trtllm-serve` surface: /metrics answers the iteration statistics queued
since the last call as a JSON list (`tensorrt_llm/serve/openai_server.py`,
get_iteration_stats; fields as `tests/unittest/llmapi/apps/_test_openai_metrics.py` checks
them), /prometheus/metrics the `trtllm_*` series of `tensorrt_llm/metrics/collector.py`
(with `return_perf_metrics`). The engine admits a request only when its whole prompt +
max_tokens fits (the default GUARANTEED_NO_EVICT capacity scheduler): nothing is paused."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from typing import Any

from sluice.sim.engine import Engine, EngineSnapshot, StepResult
from sluice.sim.metrics import ITL_BUCKETS, TTFT_BUCKETS
from sluice.sim.profiles import Profile
from sluice.sim.surfaces.base import (
    LatencyHists,
    Surface,
    SurfaceMetrics,
    hist_lines,
    json_body,
    replace,
    sample,
    text,
)

# trtllm-serve keeps at most this many iterations between two reads (iter_stats_max_iterations)
MAX_ITERATIONS = 1000


class _TrtllmMetrics(SurfaceMetrics):
    def __init__(self, engine: Engine, model_name: str, snapshot: Callable[[], EngineSnapshot]):
        self.profile = engine.profile
        self.snapshot = snapshot
        self.labels = f'engine_type="trtllm",model_name="{model_name}"'
        self.iterations: deque[dict[str, Any]] = deque(maxlen=MAX_ITERATIONS)
        self.iter = 0
        self.hists = LatencyHists(TTFT_BUCKETS, ITL_BUCKETS)

    def observe_step(self, result: StepResult, snap: EngineSnapshot) -> None:
        self.hists.observe(result)
        if not result.num_scheduled_tokens and not result.finished:
            return  # no iteration ran
        self.iter += 1
        p = self.profile
        self.iterations.append(
            {
                "iter": self.iter,
                "iterLatencyMS": result.duration * 1000.0,
                "numActiveRequests": snap.running,
                "numQueuedRequests": snap.waiting,
                "numCompletedRequests": len(result.finished),
                "maxNumActiveRequests": p.max_num_seqs,
                "gpuMemUsage": 0,
                "cpuMemUsage": 0,
                "timestamp": time.strftime("%m-%d-%Y %H:%M:%S"),
                "kvCacheStats": {
                    "maxNumBlocks": snap.num_gpu_blocks,
                    "freeNumBlocks": snap.num_gpu_blocks - snap.used_blocks,
                    "usedNumBlocks": snap.used_blocks,
                    "tokensPerBlock": snap.block_size,
                    "allocTotalBlocks": snap.used_blocks,
                    "allocNewBlocks": 0,
                    "reusedBlocks": 0,
                    "missedBlocks": 0,
                    "cacheHitRate": 0.0,
                },
                "inflightBatchingStats": {
                    "numScheduledRequests": snap.running,
                    "numContextRequests": 0,
                    "numGenRequests": snap.running,
                    "numPausedRequests": 0,
                    "numCtxTokens": result.num_prompt_tokens,
                    "microBatchId": 0,
                    "avgNumDecodedTokensPerIter": 1.0,
                },
            }
        )

    def render(self, path: str) -> tuple[bytes, str]:
        if path == "/metrics":
            drained = list(self.iterations)
            self.iterations.clear()
            return json_body(drained)
        s, lb = self.snapshot(), self.labels
        return text(
            [
                *sample("trtllm_num_requests_running", s.running, labels=lb),
                *sample("trtllm_num_requests_waiting", s.waiting, labels=lb),
                *sample("trtllm_kv_cache_utilization", s.kv_usage, labels=lb),
                *sample("trtllm_kv_cache_max_blocks", s.num_gpu_blocks, labels=lb),
                *sample("trtllm_kv_cache_tokens_per_block", s.block_size, labels=lb),
                *sample("trtllm_num_paused_requests", 0, labels=lb),
                *hist_lines("trtllm_time_to_first_token_seconds", self.hists.ttft, lb),
                *hist_lines("trtllm_time_per_output_token_seconds", self.hists.itl, lb),
            ]
        )


class TrtllmSurface(Surface):
    name = "trtllm"
    owned_by = "tensorrt_llm"
    metric_paths = ("/metrics", "/prometheus/metrics")

    def profile(self, base: Profile) -> Profile:
        return replace(base, kv_reserve="request")

    def metrics(
        self, engine: Engine, model_name: str, snapshot: Callable[[], EngineSnapshot]
    ) -> SurfaceMetrics:
        return _TrtllmMetrics(engine, model_name, snapshot)
