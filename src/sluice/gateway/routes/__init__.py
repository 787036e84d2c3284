"""Every route the gateway proxies, as data (spec.py: RouteSpec): one module per API
family, all through the one request path (request_path.py)."""

from __future__ import annotations

from sluice.gateway.routes.audio import TRANSCRIPTIONS, TRANSLATIONS
from sluice.gateway.routes.messages import COUNT_TOKENS, MESSAGES
from sluice.gateway.routes.openai_api import CHAT, CHAT_BATCH, COMPLETIONS
from sluice.gateway.routes.pooling import (
    CLASSIFY,
    EMBED_V2,
    EMBEDDINGS,
    POOLING,
    RERANK,
    RERANK_V1,
    RERANK_V2,
    SCORE,
    SCORE_V1,
)
from sluice.gateway.routes.responses import RESPONSE_CANCEL, RESPONSE_GET, RESPONSES
from sluice.gateway.routes.spec import RouteSpec, StreamShape, UsageShape
from sluice.gateway.routes.tokenizer import DETOKENIZE, TOKENIZE

# (method, path as aiohttp's router takes it, spec)
PROXIED: tuple[tuple[str, str, RouteSpec], ...] = (
    ("POST", "/v1/chat/completions", CHAT),
    ("POST", "/v1/completions", COMPLETIONS),
    ("POST", "/v1/chat/completions/batch", CHAT_BATCH),
    ("POST", "/v1/responses", RESPONSES),
    ("GET", "/v1/responses/{response_id}", RESPONSE_GET),
    ("POST", "/v1/responses/{response_id}/cancel", RESPONSE_CANCEL),
    ("POST", "/v1/messages", MESSAGES),
    ("POST", "/v1/messages/count_tokens", COUNT_TOKENS),
    ("POST", "/v1/embeddings", EMBEDDINGS),
    ("POST", "/v2/embed", EMBED_V2),
    ("POST", "/rerank", RERANK),
    ("POST", "/v1/rerank", RERANK_V1),
    ("POST", "/v2/rerank", RERANK_V2),
    ("POST", "/score", SCORE),
    ("POST", "/v1/score", SCORE_V1),
    ("POST", "/classify", CLASSIFY),
    ("POST", "/pooling", POOLING),
    ("POST", "/tokenize", TOKENIZE),
    ("POST", "/detokenize", DETOKENIZE),
    ("POST", "/v1/audio/transcriptions", TRANSCRIPTIONS),
    ("POST", "/v1/audio/translations", TRANSLATIONS),
)

__all__ = [
    "CHAT",
    "COMPLETIONS",
    "COUNT_TOKENS",
    "MESSAGES",
    "PROXIED",
    "RESPONSES",
    "RouteSpec",
    "StreamShape",
    "UsageShape",
]
