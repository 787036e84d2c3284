"""The pooling routes of a vLLM server (vllm/entrypoints/pooling/: embed, scoring,
classify, pooling): embeddings (`/v1/embeddings`, Cohere-style `/v2/embed`), rerank
(`/rerank`, `/v1/rerank`, `/v2/rerank`), score (`/score`, `/v1/score`), `/classify` and
`/pooling`.

They are prefill-only: the engine runs each input's prompt once and answers, generating
no token, so a request holds KV for its prompt only and finishes in one step (the core
costs it as such: RouteSpec.prefill_only). Cost: every input's tokens; a rerank or score
request runs one sequence per (query, document) pair, each holding the query and its
document. Usage: `prompt_tokens` (Cohere's /v2/embed reports `meta.billed_units`, which is
not read: the estimate stands). Never streamed; no text fallback (a non-core feature's
breaker answers these with a 503)."""

from __future__ import annotations

from typing import Any

from multidict import CIMultiDictProxy

from sluice.gateway.request_body import BadRequest, ParsedRequest, json_object
from sluice.gateway.routes import bodies
from sluice.gateway.routes.spec import RouteSpec, UsageShape

POOLING_USAGE = UsageShape(("prompt_tokens",), None)
# the fields that hold the inputs of each kind of request
_EMBED_FIELDS = ("input", "messages", "texts", "images", "inputs")
_PAIR_QUERIES = ("query", "queries", "text_1", "data_1")
_PAIR_DOCUMENTS = ("documents", "items", "text_2", "data_2")


def _count(value: Any) -> int:
    """How many inputs a field holds (a list of strings or of token lists: each one)."""
    if isinstance(value, list) and value and not isinstance(value[0], int):
        return len(value)
    return 1


def parse_inputs(raw: bytes, _headers: CIMultiDictProxy[str]) -> ParsedRequest:
    """Embeddings, classify, pooling: every input's tokens, one sequence each."""
    body = json_object(raw)
    present = [f for f in _EMBED_FIELDS if body.get(f) is not None]
    if not present:
        raise BadRequest("the request has no input ('input', 'messages', 'texts', ...)")
    prompt = sum(bodies.input_tokens(body[f]) for f in present)
    sequences = sum(_count(body[f]) for f in present if f != "messages")
    return bodies.parsed(body, bodies.model_of(body), prompt, sequences=max(1, sequences))


def parse_pairs(raw: bytes, _headers: CIMultiDictProxy[str]) -> ParsedRequest:
    """Rerank and score: one sequence per (query, document) pair, each with both."""
    body = json_object(raw)
    query = next((body[f] for f in _PAIR_QUERIES if body.get(f) is not None), None)
    docs = next((body[f] for f in _PAIR_DOCUMENTS if body.get(f) is not None), None)
    if query is None or docs is None:
        raise BadRequest("the request needs a query and documents to score against it")
    n_docs = _count(docs)
    n_queries = _count(query)
    pairs = max(n_docs, n_queries)
    prompt = bodies.input_tokens(docs) * max(1, pairs // n_docs)
    prompt += bodies.input_tokens(query) * max(1, pairs // n_queries)
    return bodies.parsed(body, bodies.model_of(body), prompt, sequences=pairs)


def _route(name: str, path: str, parse: Any) -> RouteSpec:
    return RouteSpec(name, path, parse, usage=POOLING_USAGE, prefill_only=True)


EMBEDDINGS = _route("embeddings", "/v1/embeddings", parse_inputs)
EMBED_V2 = _route("embed_v2", "/v2/embed", parse_inputs)
CLASSIFY = _route("classify", "/classify", parse_inputs)
POOLING = _route("pooling", "/pooling", parse_inputs)
RERANK = _route("rerank", "/rerank", parse_pairs)
RERANK_V1 = _route("rerank", "/v1/rerank", parse_pairs)
RERANK_V2 = _route("rerank", "/v2/rerank", parse_pairs)
SCORE = _route("score", "/score", parse_pairs)
SCORE_V1 = _route("score", "/v1/score", parse_pairs)
