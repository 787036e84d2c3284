"""Deterministic embeddings and similarity scores for the simulator's pooling routes.

An embedding is a bag of words: each lower-cased word of the text stands for a dense
pseudo-random vector (its SHAKE-256 digest, one signed byte per dimension); the text's
vector is their sum, L2-normalised and rounded to float32 (what vLLM returns). The same
text always gives the same vector, in any process; texts that share words have a clearly
positive cosine similarity and unrelated texts one near 0, so a rerank or score answer
ranks relevant documents first like a real model would. A text with no word (empty, or
only punctuation) gets the vector of its whole string. A list of token ids embeds like the
text of its ids.

Scores follow vLLM's bi-encoder scoring (vllm/entrypoints/pooling/scoring/io_processor.py,
`BiEncoderIOProcessor._post_process`): the cosine similarity of the two embeddings, in
float32. `dimensions` keeps the first `d` values and normalises again (a Matryoshka
model: every prefix of the vector is itself a fair embedding).
"""

from __future__ import annotations

import functools
import hashlib
import math
import re
import struct
from collections.abc import Sequence

EMBEDDING_DIM = 384  # all-MiniLM-L6-v2's size: a common small embedding model
_WORD = re.compile(r"\w+")


_FIELD = 4  # bytes per dimension in a packed sum: room for 16M words of 255 each


@functools.lru_cache(maxsize=65536)
def _word_packed(word: str) -> int:
    """The word's vector (bytes 0..255, standing for -128..127) packed into one integer, a
    4-byte field per dimension, so that summing a text's words is integer additions."""
    digest = hashlib.shake_256(word.encode("utf-8", "replace")).digest(EMBEDDING_DIM)
    spread = bytearray(_FIELD * EMBEDDING_DIM)
    spread[::_FIELD] = digest
    return int.from_bytes(spread, "little")


def _sum_words(words: list[str]) -> list[int]:
    total = sum(_word_packed(w) for w in words)
    fields = struct.unpack(f"<{EMBEDDING_DIM}I", total.to_bytes(_FIELD * EMBEDDING_DIM, "little"))
    bias = 128 * len(words)
    return [f - bias for f in fields]


def _to_float32(values: Sequence[float]) -> list[float]:
    packed = struct.pack(f"<{len(values)}f", *values)
    return list(struct.unpack(f"<{len(values)}f", packed))


def _normalised(vec: Sequence[float]) -> list[float]:
    norm = math.sqrt(sum(v * v for v in vec))
    if norm == 0.0:  # the words cancelled out exactly: a fixed unit vector instead
        return [1.0] + [0.0] * (len(vec) - 1)
    return _to_float32([v / norm for v in vec])


def embed_text(text: str, dim: int = EMBEDDING_DIM) -> list[float]:
    words = _WORD.findall(text.lower()) or [text]
    return _normalised(_sum_words(words)[:dim])


def embed_tokens(ids: Sequence[int], dim: int = EMBEDDING_DIM) -> list[float]:
    return embed_text(" ".join(str(i) for i in ids), dim)


def cosine(a: Sequence[float], b: Sequence[float]) -> float:
    dot = sum(x * y for x, y in zip(a, b, strict=True))
    na = math.sqrt(sum(x * x for x in a))
    nb = math.sqrt(sum(y * y for y in b))
    if na == 0.0 or nb == 0.0:
        return 0.0
    return _to_float32([dot / (na * nb)])[0]  # vLLM computes it in float32
