"""The tokenizer's routes (vllm/entrypoints/serve/tokenize/api_router.py): `/tokenize`
and `/detokenize`. They run nothing on the GPU: they need a key, and bypass the queues
and the limiter (RouteSpec.queued False). `model` may be left out, as vLLM allows: any
backend then answers (the backends behind one gateway usually serve one model)."""

from __future__ import annotations

from multidict import CIMultiDictProxy

from sluice.gateway.request_body import ParsedRequest, json_object
from sluice.gateway.routes import bodies
from sluice.gateway.routes.spec import RouteSpec


def parse_tokenizer(raw: bytes, _headers: CIMultiDictProxy[str]) -> ParsedRequest:
    body = json_object(raw)
    return bodies.parsed(body, bodies.model_of(body, required=False), 0)


TOKENIZE = RouteSpec("tokenize", "/tokenize", parse_tokenizer, queued=False)
DETOKENIZE = RouteSpec("detokenize", "/detokenize", parse_tokenizer, queued=False)
