"""vLLM 0.32's pooling routes without I/O: `/v1/embeddings`, `/v2/embed` (Cohere),
`/rerank` (and `/v1/rerank`, `/v2/rerank`), `/score` (and `/v1/score`).

Read from vLLM 0.32.0: vllm/entrypoints/pooling/embed/{protocol,serving,io_processor}.py,
pooling/scoring/{protocol,serving,io_processor,utils}.py, pooling/base/protocol.py,
pooling/utils.py (`get_pooling_usage`, the base64 encoder) and vllm/pooling_params.py
(`dimensions`). Each prompt is one prefill-only engine request; the answer's usage is the
sum of their prompt tokens (`completion_tokens` 0). Rerank and score run as vLLM runs them
with an embedding model (the bi-encoder path): every query and every document is embedded
once (that is what the usage counts) and a pair's score is the cosine of its two
embeddings; pairs are 1:N (one query against each document) or N:N. Rerank sorts by
`relevance_score` and keeps `top_n` (0: all). Embeddings and scores come from
`sim.embedding`, so they are deterministic.

Not supported (a 400 that says so): `encoding_format` "bytes"/"bytes_only", fp8
`embed_dtype`s, image inputs, and multimodal score/rerank documents.
"""

from __future__ import annotations

import base64
import struct
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from sluice.sim import embedding, fields, tokenizer, tokens
from sluice.sim.openai_api import ApiError, bad_request


@dataclass(slots=True)
class Prompt:
    """One prefill-only engine request: its text (or token ids) and its prompt tokens."""

    text: str | None
    ids: list[int] | None
    tokens: int

    def embed(self, dim: int) -> list[float]:
        if self.ids is not None:
            return embedding.embed_tokens(self.ids, dim)
        return embedding.embed_text(self.text or "", dim)


def _too_long(n: int, max_model_len: int) -> ApiError:
    return ApiError(
        400,
        f"This model's maximum context length is {max_model_len} tokens. However, your "
        f"prompt contains {n} input tokens, which exceeds this limit even without any "
        "output tokens. Please reduce the length of the input prompt.",
        "BadRequestError",
        "input_tokens",
    )


def text_prompt(
    text: str, max_model_len: int, limit: int | None = None, *, left: bool = False
) -> Prompt:
    """`limit` is vLLM's truncate_prompt_tokens (-1: the model's length): keep that many
    tokens (4 bytes each) from the right end, or from the left with `left`."""
    n = tokens.count_text_tokens(text)
    if limit is not None:
        keep = max_model_len if limit == -1 else limit
        if n > keep:
            data = text.encode("utf-8", "replace")
            size = keep * tokens.BYTES_PER_TOKEN
            cut = data[len(data) - size :] if left else data[:size]
            text = cut.decode("utf-8", "ignore")
            n = keep
    if n > max_model_len:
        raise _too_long(n, max_model_len)
    return Prompt(text, None, max(1, n))


def ids_prompt(ids: list[int], max_model_len: int, limit: int | None = None) -> Prompt:
    if limit is not None:
        keep = max_model_len if limit == -1 else limit
        ids = ids[:keep]
    if len(ids) > max_model_len:
        raise _too_long(len(ids), max_model_len)
    return Prompt(None, ids, max(1, len(ids)))


def _is_ids(value: Any) -> bool:
    return isinstance(value, list) and all(
        isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in value
    )


# -- /v1/embeddings ----------------------------------------------------------------------


@dataclass(slots=True)
class EmbeddingsRequest:
    model: Any
    prompts: list[Prompt]
    encoding_format: str
    embed_dtype: str
    endianness: str
    dimensions: int | None


def _chat_prompt(messages: Any, loc: str, max_model_len: int, limit: int | None) -> Prompt:
    if not isinstance(messages, list) or not messages:
        raise fields.invalid(loc, "List should have at least 1 item after validation", "too_short")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise fields.invalid(f"{loc}.{i}", "Input should be a message with a role")
    try:
        ids = tokenizer.encode_chat(messages, add_generation_prompt=False)
    except ValueError as exc:
        raise fields.invalid(loc, str(exc)) from None
    text = " ".join(part for m in messages for part in tokenizer.content_texts(m.get("content")))
    prompt = ids_prompt(ids, max_model_len, limit)
    return Prompt(text, None, prompt.tokens)


def _dimensions(value: int | None, model: str) -> int | None:
    if value is not None and not 1 <= value <= embedding.EMBEDDING_DIM:
        raise bad_request(
            f"Model {model!r} only supports dimensions in range "
            f"[1, {embedding.EMBEDDING_DIM}], got {value}."
        )
    return value


def parse_embeddings(body: dict[str, Any], *, model: str, max_model_len: int) -> EmbeddingsRequest:
    if "normalize" in body:
        raise fields.invalid_value(
            "normalize", "Parameter `normalize` was removed; use `use_activation` instead."
        )
    limit = fields.integer(body, "truncate_prompt_tokens", minimum=-1)
    prompts: list[Prompt]
    if "messages" in body:
        messages = body["messages"]
        if isinstance(messages, list) and messages and all(isinstance(m, list) for m in messages):
            prompts = [
                _chat_prompt(conv, f"messages.{i}", max_model_len, limit)
                for i, conv in enumerate(messages)
            ]
        else:
            prompts = [_chat_prompt(messages, "messages", max_model_len, limit)]
    else:
        value = fields.required(body, "input")
        if isinstance(value, str):
            prompts = [text_prompt(value, max_model_len, limit)]
        elif isinstance(value, list) and value and all(isinstance(v, str) for v in value):
            prompts = [text_prompt(v, max_model_len, limit) for v in value]
        elif isinstance(value, list) and value and all(isinstance(v, list) for v in value):
            if not all(_is_ids(v) for v in value):
                raise fields.invalid("input", "Input should be a list of lists of token ids")
            prompts = [ids_prompt(v, max_model_len, limit) for v in value]
        elif _is_ids(value) and value:
            prompts = [ids_prompt(value, max_model_len, limit)]
        elif isinstance(value, list) and not value:
            raise bad_request("You must pass at least one prompt")
        else:
            raise fields.invalid(
                "input",
                "Input should be a string, a list of strings, a list of token ids or a list "
                "of lists of token ids",
                "union_type",
            )
    encoding = fields.one_of(
        body, "encoding_format", ("float", "base64", "bytes", "bytes_only"), "float"
    )
    if encoding in ("bytes", "bytes_only"):
        raise bad_request(f"encoding_format {encoding!r} is not supported by the simulator")
    dtype = fields.one_of(
        body, "embed_dtype", ("float32", "float16", "bfloat16", "fp8_e4m3", "fp8_e5m2"), "float32"
    )
    if dtype.startswith("fp8"):
        raise bad_request(f"embed_dtype {dtype!r} is not supported by the simulator")
    return EmbeddingsRequest(
        model=body.get("model"),
        prompts=prompts,
        encoding_format=encoding,
        embed_dtype=dtype,
        endianness=fields.one_of(body, "endianness", ("native", "big", "little"), "native"),
        dimensions=_dimensions(fields.integer(body, "dimensions"), model),
    )


def encode_base64(
    values: Sequence[float], dtype: str = "float32", endianness: str = "native"
) -> str:
    """vLLM's `tensor2binary` then base64 (native order is little-endian here)."""
    order = ">" if endianness == "big" else "<"
    if dtype == "float16":
        data = struct.pack(f"{order}{len(values)}e", *values)
    elif dtype == "bfloat16":
        words = struct.unpack(f"<{len(values)}I", struct.pack(f"<{len(values)}f", *values))
        data = struct.pack(f"{order}{len(values)}H", *(w >> 16 for w in words))
    else:
        data = struct.pack(f"{order}{len(values)}f", *values)
    return base64.b64encode(data).decode()


def usage(prompt_tokens: int) -> dict[str, Any]:
    """vLLM's UsageInfo of a pooling answer, dumped whole."""
    return {
        "prompt_tokens": prompt_tokens,
        "total_tokens": prompt_tokens,
        "completion_tokens": 0,
        "prompt_tokens_details": None,
        "completion_tokens_details": None,
    }


def embeddings_response(req: EmbeddingsRequest, request_id: str, model: str) -> dict[str, Any]:
    dim = req.dimensions or embedding.EMBEDDING_DIM
    data = []
    for i, prompt in enumerate(req.prompts):
        vec = prompt.embed(dim)
        value: Any = vec
        if req.encoding_format == "base64":
            value = encode_base64(vec, req.embed_dtype, req.endianness)
        data.append({"index": i, "object": "embedding", "embedding": value})
    return {
        "id": request_id,
        "object": "list",
        "created": int(time.time()),
        "model": model,
        "data": data,
        "usage": usage(sum(p.tokens for p in req.prompts)),
    }


# -- /v2/embed (Cohere) ------------------------------------------------------------------


@dataclass(slots=True)
class CohereRequest:
    model: Any
    prompts: list[Prompt]
    texts: list[str] | None
    embedding_types: list[str]
    dimensions: int | None


COHERE_TYPES = ("float", "binary", "ubinary", "base64")


def parse_cohere(body: dict[str, Any], *, model: str, max_model_len: int) -> CohereRequest:
    given = [body.get(k) for k in ("texts", "images", "inputs") if body.get(k) is not None]
    if len(given) != 1 or not given[0]:
        raise fields.invalid_value(
            "texts",
            "Exactly one of texts, images, or inputs must be provided, and it must be non-empty",
        )
    if body.get("images") is not None:
        raise bad_request("image inputs are not supported by the simulator")
    truncate = fields.one_of(body, "truncate", ("NONE", "START", "END"), "END")
    max_tokens = fields.integer(body, "max_tokens", minimum=1)
    limit: int | None = None
    if truncate != "NONE":
        limit = max_tokens if max_tokens is not None else -1
    texts: list[str] = []
    if body.get("texts") is not None:
        raw = body["texts"]
        if not isinstance(raw, list) or not all(isinstance(t, str) for t in raw):
            raise fields.invalid("texts", "Input should be a list of strings", "list_type")
        texts = raw
    else:
        inputs = body["inputs"]
        if not isinstance(inputs, list):
            raise fields.invalid("inputs", "Input should be a valid list", "list_type")
        for i, item in enumerate(inputs):
            content = item.get("content") if isinstance(item, dict) else None
            if not isinstance(content, list):
                raise fields.invalid(f"inputs.{i}.content", "Field required", "missing")
            parts = []
            for part in content:
                if not isinstance(part, dict) or part.get("type") != "text":
                    raise bad_request("image inputs are not supported by the simulator")
                parts.append(str(part.get("text") or ""))
            texts.append(" ".join(parts))
    prompts = [text_prompt(t, max_model_len, limit, left=truncate == "START") for t in texts]
    if truncate == "NONE" and max_tokens is not None:
        for p in prompts:
            if p.tokens > max_tokens:
                raise bad_request(
                    f"Input of {p.tokens} tokens exceeds max_tokens={max_tokens} with "
                    "truncate=NONE. Set truncate to END or START to allow truncation."
                )
    types = body.get("embedding_types") or ["float"]
    if not isinstance(types, list) or any(t not in COHERE_TYPES for t in types):
        raise fields.invalid(
            "embedding_types", "Input should be 'float', 'binary', 'ubinary' or 'base64'"
        )
    return CohereRequest(
        model=body.get("model"),
        prompts=prompts,
        texts=body.get("texts"),
        embedding_types=types,
        dimensions=_dimensions(fields.integer(body, "output_dimension"), model),
    )


def _pack_bits(vec: Sequence[float], signed: bool) -> list[int]:
    if len(vec) % 8:
        raise bad_request(
            "binary and ubinary embedding types need a dimension that is a multiple of 8, "
            f"but got {len(vec)}."
        )
    out = []
    for i in range(0, len(vec), 8):
        byte = 0
        for v in vec[i : i + 8]:
            byte = byte << 1 | (v >= 0)
        out.append(byte - 128 if signed else byte)
    return out


def cohere_response(req: CohereRequest, request_id: str) -> dict[str, Any]:
    dim = req.dimensions or embedding.EMBEDDING_DIM
    vectors = [p.embed(dim) for p in req.prompts]
    by_type: dict[str, Any] = {}
    for kind in req.embedding_types:
        if kind == "float":
            by_type["float"] = vectors
        elif kind == "binary":
            by_type["binary"] = [_pack_bits(v, True) for v in vectors]
        elif kind == "ubinary":
            by_type["ubinary"] = [_pack_bits(v, False) for v in vectors]
        else:
            by_type["base64"] = [encode_base64(v) for v in vectors]
    ordered = {k: by_type[k] for k in COHERE_TYPES if k in by_type}  # pydantic's field order
    out: dict[str, Any] = {"id": request_id, "embeddings": ordered}
    if req.texts is not None:
        out["texts"] = req.texts
    out["meta"] = {
        "api_version": {"version": "2"},
        "billed_units": {"input_tokens": sum(p.tokens for p in req.prompts), "image_tokens": 0},
    }
    out["response_type"] = "embeddings_by_type"
    return out


# -- rerank and score --------------------------------------------------------------------


@dataclass(slots=True)
class ScoringRequest:
    model: Any
    queries: list[Prompt]
    documents: list[Prompt]
    document_texts: list[str]
    top_n: int  # rerank only; 0 keeps all

    @property
    def prompts(self) -> list[Prompt]:
        """The engine requests: every query and every document once (bi-encoder)."""
        return [*self.queries, *self.documents]

    def scores(self) -> list[float]:
        queries = [q.embed(embedding.EMBEDDING_DIM) for q in self.queries]
        docs = [d.embed(embedding.EMBEDDING_DIM) for d in self.documents]
        if len(queries) == 1:
            queries = queries * len(docs)
        return [embedding.cosine(q, d) for q, d in zip(queries, docs, strict=True)]


def _score_texts(value: Any, loc: str) -> list[str]:
    items = value if isinstance(value, list) else [value]
    for i, item in enumerate(items):
        if isinstance(item, dict):
            raise bad_request("multimodal score inputs are not supported by the simulator")
        if not isinstance(item, str):
            raise fields.invalid(f"{loc}.{i}", "Input should be a valid string", "string_type")
    return items


def _scoring(
    body: dict[str, Any], first: Any, second: Any, locs: tuple[str, str], max_model_len: int
) -> tuple[list[Prompt], list[Prompt], list[str]]:
    a = _score_texts(first, locs[0])
    b = _score_texts(second, locs[1])
    if len(a) > 1 and len(a) != len(b):
        raise fields.invalid_value(locs[0], "Input lengths must be either 1:1, 1:N or N:N")
    if not a:
        raise fields.invalid_value(locs[0], "At least one text element must be given")
    if not b:
        raise fields.invalid_value(locs[1], "At least one text_pair element must be given")
    q_limit = fields.integer(body, "max_tokens_per_query", minimum=0, default=0) or None
    d_limit = fields.integer(body, "max_tokens_per_doc", minimum=0, default=0) or None
    for name, lim in (("max_tokens_per_query", q_limit), ("max_tokens_per_doc", d_limit)):
        if lim is not None and lim >= max_model_len:
            raise bad_request(f"{name} ({lim}) must be less than max_model_len ({max_model_len}).")
    queries = [text_prompt(t, max_model_len, q_limit) for t in a]
    docs = [text_prompt(t, max_model_len, d_limit) for t in b]
    return queries, docs, b


def parse_rerank(body: dict[str, Any], *, max_model_len: int) -> ScoringRequest:
    query = fields.required(body, "query")
    documents = fields.required(body, "documents")
    if isinstance(query, list):
        raise fields.invalid("query", "Input should be a valid string", "string_type")
    queries, docs, texts = _scoring(body, query, documents, ("query", "documents"), max_model_len)
    top_n = fields.integer(body, "top_n", minimum=0, default=0) or 0
    return ScoringRequest(body.get("model"), queries, docs, texts, top_n)


_SCORE_FIELDS = (
    ("queries", "documents"),
    ("queries", "items"),
    ("data_1", "data_2"),
    ("text_1", "text_2"),
)


def parse_score(body: dict[str, Any], *, max_model_len: int) -> ScoringRequest:
    for a, b in _SCORE_FIELDS:
        if a in body and b in body:
            queries, docs, texts = _scoring(body, body[a], body[b], (a, b), max_model_len)
            return ScoringRequest(body.get("model"), queries, docs, texts, 0)
    raise fields.invalid("text_1", "Field required", "missing")


def rerank_response(req: ScoringRequest, request_id: str, model: str) -> dict[str, Any]:
    results: list[dict[str, Any]] = [
        {"index": i, "document": {"text": text, "multi_modal": None}, "relevance_score": score}
        for i, (text, score) in enumerate(zip(req.document_texts, req.scores(), strict=True))
    ]
    results.sort(key=lambda r: r["relevance_score"], reverse=True)  # stable, like vLLM's
    if 0 < req.top_n < len(results):
        results = results[: req.top_n]
    n = sum(p.tokens for p in req.prompts)
    return {
        "id": request_id,
        "model": model,
        "usage": {"prompt_tokens": n, "total_tokens": n},
        "results": results,
    }


def score_response(req: ScoringRequest, request_id: str, model: str) -> dict[str, Any]:
    return {
        "id": request_id,
        "object": "list",
        "created": int(time.time()),
        "model": model,
        "data": [{"index": i, "object": "score", "score": s} for i, s in enumerate(req.scores())],
        "usage": usage(sum(p.tokens for p in req.prompts)),
    }
