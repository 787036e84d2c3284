"""The models one simulator serves: its base model and the LoRA adapters loaded on it.

Like vLLM 0.32's `OpenAIServingModels` (vllm/entrypoints/openai/models/serving.py): a
request may name the base model, a loaded adapter, or no model at all (the base model);
any other name is a 404 "The model `x` does not exist."; answers carry the name the request
used (an adapter's name for an adapter). `GET /v1/models` lists the base model and then the
adapters (`root` the adapter's path, `parent` the base model). Adapters come from
`--lora-modules name=path` at start and, when runtime updating is allowed (vLLM's
`VLLM_ALLOW_RUNTIME_LORA_UPDATING`), from `POST /v1/load_lora_adapter` and
`/v1/unload_lora_adapter` (vllm/entrypoints/serve/lora/api_router.py), with vLLM's checks
and messages. An adapter costs the engine nothing extra here (LoRA is not modelled).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from sluice.sim.openai_api import ApiError


@dataclass(slots=True)
class Adapter:
    name: str
    path: str
    created: int


def _permission(created: int) -> dict[str, Any]:
    # vLLM's ModelPermission with its defaults
    return {
        "id": f"modelperm-{created:016x}",
        "object": "model_permission",
        "created": created,
        "allow_create_engine": False,
        "allow_sampling": True,
        "allow_logprobs": True,
        "allow_search_indices": False,
        "allow_view": True,
        "allow_fine_tuning": False,
        "organization": "*",
        "group": None,
        "is_blocking": False,
    }


class ModelRegistry:
    def __init__(self, base: str, *, allow_runtime_updates: bool = False) -> None:
        self.base = base
        self.allow_runtime_updates = allow_runtime_updates
        self.adapters: dict[str, Adapter] = {}

    def resolve(self, model: Any) -> str:
        """The served name a request's `model` field stands for; ApiError 404 if none."""
        if model is None or model == "" or model == self.base:
            return self.base
        if isinstance(model, str) and model in self.adapters:
            return model
        raise ApiError(404, f"The model `{model}` does not exist.", "NotFoundError", "model")

    def is_served(self, model: str) -> bool:
        return model == self.base or model in self.adapters

    def adapter_cards(self) -> list[dict[str, Any]]:
        return [
            {
                "id": a.name,
                "object": "model",
                "created": a.created,
                "owned_by": "vllm",
                "root": a.path,
                "parent": self.base,
                "max_model_len": None,
                "permission": [_permission(a.created)],
            }
            for a in self.adapters.values()
        ]

    def load(self, name: Any, path: Any, *, load_inplace: bool = False) -> str:
        """vLLM's `load_lora_adapter` checks; the success text vLLM answers with."""
        if not name or not path or not isinstance(name, str) or not isinstance(path, str):
            raise ApiError(
                400, "Both 'lora_name' and 'lora_path' must be provided.", "InvalidUserInput"
            )
        if name == self.base:
            raise ApiError(
                400,
                f"The lora adapter '{name}' conflicts with a served base model.",
                "InvalidUserInput",
            )
        if not load_inplace and name in self.adapters:
            raise ApiError(
                400,
                f"The lora adapter '{name}' has already been loaded. If you want to load the "
                "adapter in place, set 'load_inplace' to True.",
                "InvalidUserInput",
            )
        self.adapters[name] = Adapter(name, path, int(time.time()))
        return f"Success: LoRA adapter '{name}' added successfully."

    def unload(self, name: Any) -> str:
        if not name or not isinstance(name, str):
            raise ApiError(
                400,
                "'lora_name' needs to be provided to unload a LoRA adapter.",
                "InvalidUserInput",
            )
        if name not in self.adapters:
            raise ApiError(404, f"The lora adapter '{name}' cannot be found.", "NotFoundError")
        del self.adapters[name]
        return f"Success: LoRA adapter '{name}' removed successfully."


def parse_lora_modules(specs: list[str]) -> dict[str, str]:
    """`--lora-modules name=path ...` (vLLM's simple form); ValueError on a bad one."""
    out: dict[str, str] = {}
    for spec in specs:
        name, sep, path = spec.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"--lora-modules expects name=path, got {spec!r}")
        out[name] = path
    return out
