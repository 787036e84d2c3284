"""Build the tiny random-weight Llama-style model that the real vLLM serves in tests.

    python build_model.py OUT_DIR        (run with the vLLM venv's python: it needs
                                          torch, transformers and tokenizers)

Nothing is downloaded (HF_HUB_OFFLINE=1): a byte-level BPE tokenizer is trained on this
interpreter's own standard-library sources, and the model (2 layers, hidden 256, 4 heads)
gets seeded random weights. Its output is random text, so callers pass `ignore_eos: true`
when they need answers of a known length.

KV footprint: 2 (K, V) x 2 layers x 4 KV heads x 64 dims x 2 bytes (bf16) = 2,048 bytes
per token, so vLLM's `--kv-cache-memory-bytes 8388608` holds 4,096 tokens."""

from __future__ import annotations

import json
import os
import sys
import sysconfig
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

VOCAB_SIZE = 4096
HIDDEN = 256
LAYERS = 2
HEADS = 4
INTERMEDIATE = 688
MAX_POSITIONS = 2048
SEED = 1234
# The name the launcher serves it under (`--served-model-name`).
MODEL_NAME = "sluice-tiny-llama"
SPECIAL = ["<unk>", "<s>", "</s>"]
# A minimal Llama-2-like template: every message on its own line behind its role.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] }}{{ eos_token }}\n"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
_TRAINING_BYTES = 6_000_000  # enough for a 4k vocabulary; trains in a few seconds


def training_files() -> list[str]:
    """This interpreter's standard-library sources, in a fixed order."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files, total = [], 0
    for path in sorted(stdlib.rglob("*.py")):
        if "site-packages" in path.parts or "test" in path.parts:
            continue
        files.append(str(path))
        total += path.stat().st_size
        if total >= _TRAINING_BYTES:
            break
    if not files:
        raise SystemExit(f"no Python sources found under {stdlib} to train the tokenizer on")
    return files


def build_tokenizer(out: Path) -> int:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train(training_files(), trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="</s>",
        pad_token="</s>",
        model_max_length=MAX_POSITIONS,
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out)
    return tok.get_vocab_size()


def build_model(out: Path, vocab_size: int) -> None:
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(SEED)
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=HIDDEN,
        intermediate_size=INTERMEDIATE,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=HEADS,
        max_position_embeddings=MAX_POSITIONS,
        bos_token_id=SPECIAL.index("<s>"),
        eos_token_id=SPECIAL.index("</s>"),
        pad_token_id=SPECIAL.index("</s>"),
        tie_word_embeddings=False,
        torch_dtype="bfloat16",
    )
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(out, safe_serialization=True)
    GenerationConfig(
        bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id
    ).save_pretrained(out)


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    out = Path(argv[1])
    out.mkdir(parents=True, exist_ok=True)
    vocab = build_tokenizer(out)
    build_model(out, vocab)
    (out / "sluice-model.json").write_text(
        json.dumps(
            {
                "name": MODEL_NAME,
                "vocab_size": vocab,
                "hidden": HIDDEN,
                "layers": LAYERS,
                "heads": HEADS,
                "max_positions": MAX_POSITIONS,
                "seed": SEED,
            },
            indent=1,
        )
        + "\n"
    )
    print(f"built {out}: vocab {vocab}, {LAYERS} layers, hidden {HIDDEN}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
