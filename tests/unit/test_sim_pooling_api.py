"""The simulator's deterministic embeddings and scores, its reversible token ids, and its
audio cost rule: pure functions, exact expectations."""

from __future__ import annotations

import base64
import io
import math
import struct
import wave
from typing import Any

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from sluice.sim import audio, embedding, pooling_api, tokenizer, tokens
from sluice.sim.openai_api import ApiError


def test_embeddings_are_unit_vectors_of_float32s_and_deterministic() -> None:
    vec = embedding.embed_text("The quick brown fox")
    assert len(vec) == embedding.EMBEDDING_DIM
    assert math.fsum(v * v for v in vec) == pytest.approx(1.0, abs=1e-6)
    assert vec == list(struct.unpack("<384f", struct.pack("<384f", *vec)))
    assert vec == embedding.embed_text("the QUICK brown fox!")  # words, lower-cased
    assert vec != embedding.embed_text("the quick brown dog")
    assert embedding.embed_text("") == embedding.embed_text("")  # no word: its own vector
    short = embedding.embed_text("The quick brown fox", 32)
    assert len(short) == 32 and math.fsum(v * v for v in short) == pytest.approx(1.0, abs=1e-6)


def test_texts_that_share_words_score_higher() -> None:
    q = embedding.embed_text("how do I bake sourdough bread")
    near = embedding.embed_text("sourdough bread: how to bake it")
    far = embedding.embed_text("the stock market fell on tuesday")
    assert embedding.cosine(q, near) > 0.5
    assert abs(embedding.cosine(q, far)) < 0.2
    assert embedding.cosine(q, q) == pytest.approx(1.0)


def test_base64_is_vllms_layout() -> None:
    values = [0.5, -0.25, 1.0]
    assert base64.b64decode(pooling_api.encode_base64(values)) == struct.pack("<3f", *values)
    assert base64.b64decode(pooling_api.encode_base64(values, "float32", "big")) == struct.pack(
        ">3f", *values
    )
    assert base64.b64decode(pooling_api.encode_base64(values, "float16")) == struct.pack(
        "<3e", *values
    )
    # bfloat16: the top half of each float32
    assert base64.b64decode(pooling_api.encode_base64([1.0], "bfloat16")) == b"\x80\x3f"


def test_cohere_binary_packing_matches_vllms() -> None:
    # vLLM packs signs MSB first, eight per byte; "binary" is the byte less 128
    req = pooling_api.CohereRequest(None, [], None, ["binary", "ubinary"], None)
    vec = [0.5, -0.5, 0.0, 0.0, 0.0, 0.0, 0.0, 0.1]
    assert pooling_api._pack_bits(vec, signed=True) == [63]  # what vLLM answers
    assert pooling_api._pack_bits(vec, signed=False) == [191]
    assert req.embedding_types == ["binary", "ubinary"]


def parse(body: dict[str, Any], max_model_len: int = 100) -> pooling_api.EmbeddingsRequest:
    return pooling_api.parse_embeddings(body, model="m", max_model_len=max_model_len)


def test_embedding_inputs_become_one_prompt_each() -> None:
    assert [p.tokens for p in parse({"input": ["abcd", "abcdefgh", ""]}).prompts] == [1, 2, 1]
    assert [p.tokens for p in parse({"input": [[1, 2], [3]]}).prompts] == [2, 1]
    assert [p.tokens for p in parse({"input": [5, 6, 7]}).prompts] == [3]
    assert parse({"input": "x" * 400}).prompts[0].tokens == 100  # fills the context exactly
    assert parse({"input": "x" * 4000, "truncate_prompt_tokens": 7}).prompts[0].tokens == 7
    assert parse({"input": "x" * 4000, "truncate_prompt_tokens": -1}).prompts[0].tokens == 100


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"input": "x" * 404}, "maximum context length is 100 tokens"),
        ({"input": []}, "at least one prompt"),
        ({"input": {"a": 1}}, "Input should be a string"),
        ({"input": "x", "encoding_format": "bytes"}, "not supported by the simulator"),
        ({"input": "x", "dimensions": 385}, "dimensions in range [1, 384], got 385"),
        ({"input": "x", "normalize": True}, "`normalize` was removed"),
    ],
)
def test_embedding_errors(body: dict[str, Any], message: str) -> None:
    with pytest.raises(ApiError) as err:
        parse(body)
    assert err.value.status == 400 and message in err.value.message


def test_rerank_sorts_keeps_top_n_and_counts_every_text_once() -> None:
    docs = ["red apples", "green apples and red apples", "blue sky"]
    req = pooling_api.parse_rerank(
        {"query": "red apples", "documents": docs, "top_n": 2}, max_model_len=100
    )
    out = pooling_api.rerank_response(req, "score-1", "m")
    assert [r["index"] for r in out["results"]] == [0, 1]
    assert out["results"][0]["relevance_score"] == pytest.approx(1.0)
    n = sum(tokens.count_text_tokens(t) for t in ["red apples", *docs])
    assert out["usage"] == {"prompt_tokens": n, "total_tokens": n}
    everything = pooling_api.parse_rerank({"query": "q", "documents": docs}, max_model_len=100)
    assert len(pooling_api.rerank_response(everything, "s", "m")["results"]) == 3


def test_score_pairs_one_to_n_and_n_to_n() -> None:
    one = pooling_api.parse_score({"text_1": "a b", "text_2": ["a b", "c d"]}, max_model_len=100)
    assert [round(s, 5) for s in one.scores()][:1] == [1.0]
    assert len(one.prompts) == 3
    pairs = pooling_api.parse_score({"queries": ["a", "b"], "items": ["b", "a"]}, max_model_len=100)
    assert pairs.scores()[0] == pytest.approx(
        embedding.cosine(embedding.embed_text("a"), embedding.embed_text("b"))
    )
    with pytest.raises(ApiError, match="1:1, 1:N or N:N"):
        pooling_api.parse_score({"text_1": ["a", "b"], "text_2": ["a"]}, max_model_len=100)
    with pytest.raises(ApiError, match="Field required"):
        pooling_api.parse_score({"text_1": "a"}, max_model_len=100)
    with pytest.raises(ApiError, match="multimodal"):
        pooling_api.parse_score({"text_1": "a", "text_2": {"content": []}}, max_model_len=100)


@given(st.text())
@example("\x0f")  # once id 271, the special "\n\n"
@example("1o")  # once id 78191, the role "assistant"
def test_token_ids_round_trip_and_count_as_the_token_rule(text: str) -> None:
    ids = tokenizer.encode_text(text)
    assert len(ids) == tokens.count_text_tokens(text)
    assert tokenizer.decode(ids) == text.encode("utf-8", "replace").decode("utf-8", "replace")


@given(
    st.lists(
        st.fixed_dictionaries(
            {"role": st.sampled_from(["user", "assistant", "system", "tool"]), "content": st.text()}
        ),
        min_size=1,
        max_size=4,
    )
)
def test_a_chat_prompts_ids_are_as_many_as_the_chat_rule_counts(
    messages: list[dict[str, Any]],
) -> None:
    assert len(tokenizer.encode_chat(messages)) == tokens.count_chat_tokens(messages)
    without = tokenizer.encode_chat(messages, add_generation_prompt=False)
    assert len(without) == tokens.count_chat_tokens(messages) - 4


def test_unknown_token_ids_are_refused() -> None:
    with pytest.raises(ValueError, match="vocabulary"):
        tokenizer.decode([12345])
    assert tokenizer.decode([tokenizer.BEGIN_OF_TEXT, *tokenizer.encode_text("hi")]) == (
        "<|begin_of_text|>hi"
    )


def pcm_wav(seconds: float, rate: int = 8000, channels: int = 2) -> bytes:
    out = io.BytesIO()
    with wave.open(out, "wb") as w:
        w.setnchannels(channels)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(b"\x00\x00" * channels * int(seconds * rate))
    return out.getvalue()


def test_audio_duration_is_exact_for_wav_and_estimated_otherwise() -> None:
    assert audio.wav_duration(pcm_wav(2.5)) == pytest.approx(2.5)
    assert audio.wav_duration(b"ID3 not a wav") is None
    assert audio.duration_of(b"\xff" * 32_000) == pytest.approx(2.0)  # 16 kB a second


def test_audio_costs_one_engine_request_per_30_second_window() -> None:
    cost = audio.cost(pcm_wav(65.0))
    assert [w.seconds for w in cost.windows] == [30.0, 30.0, pytest.approx(5.0)]
    assert [w.prompt_tokens for w in cost.windows] == [1504] * 3
    assert [w.output_tokens for w in cost.windows] == [90, 90, 15]
    assert cost.usage_seconds == 65
    assert cost.stream_prompt_tokens == 4 + 6500
    prompted = audio.cost(pcm_wav(1.0), prompt="abcdefgh")  # <|prev|> and 2 tokens
    assert prompted.windows[0].prompt_tokens == 1500 + 4 + 1 + 2
    assert audio.cost(pcm_wav(1.0)).offset == audio.cost(pcm_wav(1.0)).offset
