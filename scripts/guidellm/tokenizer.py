"""A small WordPiece tokenizer trained here, offline, and saved as a Hugging Face
tokenizer folder: what guidellm needs to make prompts of a given token length and to
count output tokens, with no model hub at run time. Its counts are its own (not a real
model's); the comparison between arms uses the same one for both."""

from __future__ import annotations

import sys

from tokenizers import Tokenizer, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

TEXT = (
    "the quick brown fox jumps over a lazy dog while seven wizards quietly judge every box "
    "of liquor and many other things happen in the gateway today"
)
WORDS = TEXT.split(" ")


def main(out: str) -> None:
    text = [" ".join(WORDS[(i * 7 + j) % len(WORDS)] for j in range(40)) for i in range(200)]
    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    specials = ["[UNK]", "[PAD]", "[BOS]", "[EOS]"]
    trainer = trainers.WordPieceTrainer(vocab_size=500, special_tokens=specials)
    tok.train_from_iterator(text, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="[UNK]",
        pad_token="[PAD]",
        bos_token="[BOS]",
        eos_token="[EOS]",
    )
    fast.save_pretrained(out)
    print(f"tokenizer saved in {out} ({len(fast)} tokens)")


if __name__ == "__main__":
    main(sys.argv[1])
