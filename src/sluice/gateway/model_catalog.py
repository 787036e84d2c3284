"""`GET /v1/models` and `GET /v1/models/{id}`: the union of what the backends serve, as
their own /v1/models describe it (vLLM lists each LoRA adapter it has loaded with its
`parent`, the base model, and `root`, its path); a backend whose models are set in the
policy is described by name only. Where two backends list the same id, the first one's
card (by backend name) is shown. vLLM 0.32 itself has no `/v1/models/{id}`; the gateway
answers it from the union (the openai SDK's `models.retrieve`)."""

from __future__ import annotations

from typing import Any

from sluice.gateway.backend_pool import BackendPool


def model_cards(pool: BackendPool) -> dict[str, dict[str, Any]]:
    cards: dict[str, dict[str, Any]] = {}
    for name in sorted(pool.backends):
        h = pool.backends[name]
        for model in sorted(h.models):
            if model in cards:
                continue
            card = dict(h.cards.get(model) or {})
            card.setdefault("id", model)
            card.setdefault("object", "model")
            card.setdefault("created", 0)
            card.setdefault("owned_by", "sluice")
            cards[model] = card
    return cards


def model_list(pool: BackendPool) -> dict[str, Any]:
    return {"object": "list", "data": list(model_cards(pool).values())}
