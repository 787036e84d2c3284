"""Token counting without a tokenizer, and the words the simulator "generates".

Prompt tokens are estimated as one token per 4 bytes of UTF-8 text, rounded up: about
right for English with Llama-3's tokenizer (~4 characters per token) and deterministic
and cheap. A chat prompt adds a fixed overhead like Llama-3's chat template does:
`<|start_header_id|>role<|end_header_id|>\\n\\n ... <|eot_id|>` is 5 tokens per message,
plus `<|begin_of_text|>` and the assistant header that opens the reply (5 tokens).
"""

from __future__ import annotations

from typing import Any

BYTES_PER_TOKEN = 4
CHAT_TOKENS_PER_MESSAGE = 5
CHAT_TOKENS_PER_PROMPT = 5


def count_text_tokens(text: str) -> int:
    if not text:
        return 0
    size = len(text) if text.isascii() else len(text.encode("utf-8", "replace"))
    return -(-size // BYTES_PER_TOKEN)


def _content_tokens(content: Any) -> int:
    """`content` as a string, or as a list of parts ({"type": "text", "text": ...});
    parts without text (images, audio) count nothing here."""
    if content is None:
        return 0
    if isinstance(content, str):
        return count_text_tokens(content)
    if isinstance(content, list):
        total = 0
        for part in content:
            if isinstance(part, str):
                total += count_text_tokens(part)
            elif isinstance(part, dict):
                text = part.get("text")
                if isinstance(text, str):
                    total += count_text_tokens(text)
        return total
    raise ValueError("message content must be a string or a list of content parts")


def count_chat_tokens(messages: list[dict[str, Any]]) -> int:
    """Prompt tokens of a chat request after the chat template."""
    total = CHAT_TOKENS_PER_PROMPT
    for message in messages:
        total += CHAT_TOKENS_PER_MESSAGE + _content_tokens(message.get("content"))
        name = message.get("name")
        if isinstance(name, str):
            total += count_text_tokens(name)
        calls = message.get("tool_calls")
        for call in calls if isinstance(calls, list) else ():
            function = call.get("function") if isinstance(call, dict) else None
            if isinstance(function, dict):
                total += count_text_tokens(str(function.get("name", "")))
                total += count_text_tokens(str(function.get("arguments", "")))
    return total


# Output text: one word per token, cycling through this list from a per-request offset.
# All plain ASCII, so they go into JSON strings without escaping.
_TEXT = (
    "the quick brown fox jumps over a lazy dog while seven wizards quietly "
    "pack their boxes with five dozen liquor jugs and the river keeps flowing "
    "under an old stone bridge toward the distant sea where ships wait for "
    "morning light to carry their cargo across calm water"
)
WORDS: tuple[str, ...] = tuple(" " + w for w in _TEXT.split(" "))
WORD_BYTES: tuple[bytes, ...] = tuple(w.encode() for w in WORDS)


def word(offset: int, index: int) -> str:
    return WORDS[(offset + index) % len(WORDS)]
