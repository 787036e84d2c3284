"""llama.cpp's `llama-server` surface: `--parallel` slots, each owning its share of the
context (the engine runs at most that many requests and defers the rest, first come
first served, never preempting); /metrics with the `llamacpp:*` gauges of
`tools/server/server-task.cpp` (to_metrics: requests_processing, requests_deferred,
token counters); /slots in the shape of `tools/server/server-context.cpp`
(server_slot::to_json, with n_past); /props; /health answering {"status": "ok"};
/v1/models owned by "llamacpp"."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from sluice.sim.engine import Engine, EngineSnapshot, StepResult
from sluice.sim.profiles import Profile
from sluice.sim.surfaces.base import Surface, SurfaceMetrics, json_body, replace, sample, text


def slot_tokens(profile: Profile) -> int:
    return (profile.num_gpu_blocks // profile.max_num_seqs) * profile.block_size


class _LlamacppMetrics(SurfaceMetrics):
    def __init__(self, engine: Engine, snapshot: Callable[[], EngineSnapshot]):
        self.profile = engine.profile
        self.snapshot = snapshot
        self.decodes = 0

    def observe_step(self, result: StepResult, snap: EngineSnapshot) -> None:
        if result.num_scheduled_tokens:
            self.decodes += 1

    def render(self, path: str) -> tuple[bytes, str]:
        s = self.snapshot()
        if path == "/slots":
            return json_body(self._slots(s))
        return text(
            [
                *sample("llamacpp:prompt_tokens_total", s.prompt_tokens_total, "counter"),
                *sample("llamacpp:tokens_predicted_total", s.generation_tokens_total, "counter"),
                *sample("llamacpp:n_decode_total", self.decodes, "counter"),
                *sample("llamacpp:requests_processing", s.running),
                *sample("llamacpp:requests_deferred", s.waiting),
            ]
        )

    def _slots(self, s: EngineSnapshot) -> list[dict[str, Any]]:
        n_ctx = slot_tokens(self.profile)
        used = s.used_blocks * s.block_size
        out = []
        for i in range(self.profile.max_num_seqs):
            busy = i < s.running
            # the engine keeps no slot numbers: the cache's tokens, shared by the busy slots
            n_past = used // s.running + (1 if i < used % max(1, s.running) else 0) if busy else 0
            out.append(
                {
                    "id": i,
                    "n_ctx": n_ctx,
                    "speculative": False,
                    "is_processing": busy,
                    "n_past": n_past,
                }
            )
        return out


class LlamacppSurface(Surface):
    name = "llamacpp"
    owned_by = "llamacpp"
    metric_paths = ("/metrics", "/slots")

    def profile(self, base: Profile) -> Profile:
        """`max_num_seqs` slots (`--parallel`), each with an equal share of the context:
        as many as hold the profile's longest request, unless the profile asks fewer."""
        slots = max(1, min(base.max_num_seqs, base.kv_capacity_tokens // base.max_model_len))
        per_slot = (base.num_gpu_blocks // slots) * base.block_size
        return replace(base, kv_reserve="slot", max_num_seqs=slots, max_model_len=per_slot)

    def metrics(
        self, engine: Engine, model_name: str, snapshot: Callable[[], EngineSnapshot]
    ) -> SurfaceMetrics:
        return _LlamacppMetrics(engine, snapshot)

    def static(self, model_name: str, profile: Profile) -> dict[str, Any]:
        return {
            "/props": {
                "default_generation_settings": {"n_ctx": slot_tokens(profile)},
                "total_slots": profile.max_num_seqs,
                "model_alias": model_name,
                "build_info": "b0-sluice-sim",
            }
        }

    def health(self) -> tuple[int, bytes, str]:
        return 200, b'{"status":"ok"}', "application/json"

    def model_card(self, model_name: str, profile: Profile, created: int) -> dict[str, Any]:
        card = super().model_card(model_name, profile, created)
        card["meta"] = {"n_ctx_train": profile.max_model_len}
        return card
