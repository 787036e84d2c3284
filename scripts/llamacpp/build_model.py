"""Write a tiny random-weight Llama-architecture model, with its vocabulary, as one GGUF
file that llama.cpp's llama-server loads (no download: the `gguf` package writes it).

    python build_model.py OUT.gguf

The vocabulary is a SentencePiece-style one (llama.cpp's "llama" tokenizer): the three
special tokens, the 256 byte tokens every SPM vocabulary falls back on, and word pieces
(letters, common English words with and without the leading "▁"), so any text tokenizes
and the answers decode to text. The weights are seeded: every build is the same model, so
greedy answers are the same from run to run. Sizes (below) are chosen so that one decode
step of a few slots costs milliseconds on one core: enough for the server, not the
Python clients, to be the bottleneck in the overload tests."""

from __future__ import annotations

import sys

import numpy as np
from gguf import GGUFWriter, TokenType

N_EMBD = 384
N_LAYER = 4
N_HEAD = 6
N_FF = 1024
N_CTX = 2048
# a paragraph of words reads better than a column of strings
WORDS = (  # noqa: SIM905
    "the of and to in is it you that he was for on are as with his they at be this have "
    "from or one had by word but not what all were we when your can said there use an each "
    "which she do how their if will up other about out many then them these so some her "
    "would make like him into time has look two more write go see number no way could "
    "people my than first water been call who oil its now find long down day did get come "
    "made may part over new sound take only little work know place year live me back give "
    "most very after thing our just name good sentence man think say great where help "
    "through much before line right too mean old any same tell boy follow came want show"
).split()
CHATML = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + "
    "message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def vocabulary() -> tuple[list[bytes], list[float], list[int]]:
    tokens: list[bytes] = [b"<unk>", b"<s>", b"</s>"]
    types = [TokenType.UNKNOWN, TokenType.CONTROL, TokenType.CONTROL]
    for b in range(256):
        tokens.append(f"<0x{b:02X}>".encode())
        types.append(TokenType.BYTE)
    pieces = ["\u2581", *"abcdefghijklmnopqrstuvwxyz.,!?'"]
    pieces += [f"\u2581{c}" for c in "abcdefghijklmnopqrstuvwxyz"]
    pieces += [f"\u2581{w}" for w in WORDS] + WORDS
    seen = set()
    for p in pieces:
        if p not in seen:
            seen.add(p)
            tokens.append(p.encode())
            types.append(TokenType.NORMAL)
    # SPM scores: longer pieces first (the tokenizer merges by score)
    scores = [0.0] * 259 + [-1000.0 + 10.0 * len(t.decode()) for t in tokens[259:]]
    return tokens, scores, [int(t) for t in types]


def main(out: str) -> None:
    rng = np.random.default_rng(20261201)
    tokens, scores, types = vocabulary()
    n_vocab = len(tokens)
    w = GGUFWriter(out, "llama")
    w.add_name("sluice-tiny-llama")
    w.add_context_length(N_CTX)
    w.add_embedding_length(N_EMBD)
    w.add_block_count(N_LAYER)
    w.add_feed_forward_length(N_FF)
    w.add_head_count(N_HEAD)
    w.add_head_count_kv(N_HEAD)
    w.add_rope_dimension_count(N_EMBD // N_HEAD)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_file_type(0)  # all F32
    w.add_vocab_size(n_vocab)
    w.add_tokenizer_model("llama")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_add_bos_token(True)
    w.add_add_eos_token(False)
    w.add_chat_template(CHATML)

    def tensor(name: str, *shape: int, scale: float = 0.02) -> None:
        w.add_tensor(name, (rng.standard_normal(shape) * scale).astype(np.float32))

    def ones(name: str) -> None:
        w.add_tensor(name, np.ones(N_EMBD, dtype=np.float32))

    tensor("token_embd.weight", n_vocab, N_EMBD, scale=1.0)
    for i in range(N_LAYER):
        ones(f"blk.{i}.attn_norm.weight")
        for part in ("q", "k", "v", "output"):
            tensor(f"blk.{i}.attn_{part}.weight", N_EMBD, N_EMBD)
        ones(f"blk.{i}.ffn_norm.weight")
        tensor(f"blk.{i}.ffn_gate.weight", N_FF, N_EMBD)
        tensor(f"blk.{i}.ffn_up.weight", N_FF, N_EMBD)
        tensor(f"blk.{i}.ffn_down.weight", N_EMBD, N_FF)
    ones("output_norm.weight")
    tensor("output.weight", n_vocab, N_EMBD, scale=0.5)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    print(f"wrote {out}: {n_vocab} tokens, {N_LAYER} layers x {N_EMBD}", file=sys.stderr)


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: build_model.py OUT.gguf")
    main(sys.argv[1])
