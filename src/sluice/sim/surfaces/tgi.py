"""Hugging Face TGI's surface: the router's /metrics (`tgi_*` gauges of
`backends/v3/src/backend.rs`, `queue.rs` and `lib.rs`, and the per-request mean time per
token histogram of `router/src/server.rs`, v3.3.7), /info (struct Info of
`router/src/lib.rs`), /health answering 200 with an empty body. TGI admits a request into
the batch only when its input + max_new_tokens fit the token budget (nothing is
preempted), and answers 429 {"error": "Model is overloaded", "error_type": "overloaded"}
once `max_concurrent_requests` (128) requests are in the router (`router/src/infer/mod.rs`,
the semaphore in generate_stream)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import orjson

from sluice.sim.engine import Engine, EngineSnapshot, StepResult
from sluice.sim.metrics import _Hist
from sluice.sim.profiles import Profile
from sluice.sim.surfaces.base import Surface, SurfaceMetrics, hist_lines, replace, sample, text

MAX_CONCURRENT_REQUESTS = 128  # TGI's --max-concurrent-requests default
# TGI's duration buckets: 0.0001 x 1.5^k, k = 1..35 (router/src/server.rs)
DURATION_BUCKETS = tuple(0.0001 * 1.5**k for k in range(1, 36))


class _TgiMetrics(SurfaceMetrics):
    def __init__(self, engine: Engine, snapshot: Callable[[], EngineSnapshot]):
        self.profile = engine.profile
        self.snapshot = snapshot
        self.tpot = _Hist(DURATION_BUCKETS)

    def observe_step(self, result: StepResult, snap: EngineSnapshot) -> None:
        for f in result.finished:
            if f.time_per_output_token is not None:
                self.tpot.observe(f.time_per_output_token)

    def render(self, path: str) -> tuple[bytes, str]:
        s = self.snapshot()
        return text(
            [
                *sample("tgi_queue_size", s.waiting),
                *sample("tgi_batch_current_size", s.running),
                *sample("tgi_batch_current_max_tokens", s.reserved_blocks * s.block_size),
                *sample("tgi_batch_max_total_tokens", self.profile.kv_capacity_tokens),
                *hist_lines("tgi_request_mean_time_per_token_duration", self.tpot),
            ]
        )


class TgiSurface(Surface):
    name = "tgi"

    def profile(self, base: Profile) -> Profile:
        return replace(base, kv_reserve="request")

    def metrics(
        self, engine: Engine, model_name: str, snapshot: Callable[[], EngineSnapshot]
    ) -> SurfaceMetrics:
        return _TgiMetrics(engine, snapshot)

    def static(self, model_name: str, profile: Profile) -> dict[str, Any]:
        return {
            "/info": {
                "model_id": model_name,
                "model_sha": None,
                "model_pipeline_tag": "text-generation",
                "max_concurrent_requests": MAX_CONCURRENT_REQUESTS,
                "max_best_of": 2,
                "max_stop_sequences": 4,
                "max_input_tokens": profile.max_model_len - 1,
                "max_total_tokens": profile.max_model_len,
                "validation_workers": 2,
                "max_client_batch_size": 4,
                "router": "text-generation-router",
                "version": "3.3.7",
                "sha": None,
                "docker_label": None,
            }
        }

    def model_card(self, model_name: str, profile: Profile, created: int) -> dict[str, Any]:
        return {"id": model_name, "object": "model", "created": 0, "owned_by": model_name}

    def refusal(self, in_flight: int) -> tuple[int, bytes] | None:
        if in_flight >= MAX_CONCURRENT_REQUESTS:
            body = {"error": "Model is overloaded", "error_type": "overloaded"}
            return 429, orjson.dumps(body)
        return None
