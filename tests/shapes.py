"""Compare the simulator's JSON with vLLM's own, as dumped by scripts/vllm/golden_shapes.py
from vLLM 0.32's protocol models into tests/unit/data/vllm_0_32_shapes.json."""

from __future__ import annotations

import json
import pathlib
from typing import Any

GOLDEN = pathlib.Path(__file__).parent / "unit" / "data" / "vllm_0_32_shapes.json"
# values that differ from one answer to the next: compared by type only
_VOLATILE = {
    "id", "item_id", "text", "delta", "message", "prompt", "model", "root", "texts", "base64",
    "embedding", "content",
}  # fmt: skip


def golden() -> dict[str, Any]:
    data: dict[str, Any] = json.loads(GOLDEN.read_text())
    return data


def shape(value: Any, key: str = "") -> Any:
    """Key order, nesting, nulls, booleans and fixed strings kept; numbers (and ids, texts)
    reduced to their type, so two answers of the same shape compare equal."""
    if isinstance(value, dict):
        return [[k, shape(v, k)] for k, v in value.items()]
    if isinstance(value, list):
        if value and all(isinstance(v, int | float) and not isinstance(v, bool) for v in value):
            return [f"<list of {type(value[0]).__name__}>"]
        return [shape(v, key) for v in value[:1]]  # the first element stands for all
    if isinstance(value, bool) or value is None:
        return value
    if isinstance(value, int | float):
        return f"<{type(value).__name__}>"
    if isinstance(value, str) and key in _VOLATILE:
        return "<str>"
    return value


def same_shape(ours: Any, theirs: Any) -> bool:
    return json.dumps(shape(ours)) == json.dumps(shape(theirs))
