"""Token ids for `/tokenize` and `/detokenize`, consistent with `sim.tokens`' counts.

The simulator has no vocabulary; its rule is one token per 4 bytes of UTF-8 text
(`tokens.count_text_tokens`). The ids here make that rule reversible: each 4-byte chunk of
a text becomes the integer whose big-endian bytes are 0x02 followed by the chunk, so
`detokenize(tokenize(text)) == text` and `len(tokenize(text)) == count_text_tokens(text)`.
(0x02, not 0x01: every such id is then 512 or more and none equals a special or role id
below; with 0x01 the text "\x0f" was id 271, "\n\n", and "1o" was 78191, "assistant".)
A chat prompt is laid out as Llama-3's template, with its special-token ids, so that its
length is `tokens.count_chat_tokens(messages)`:

    <|begin_of_text|>  then per message
    <|start_header_id|> role <|end_header_id|> "\\n\\n" content... <|eot_id|>
    and, with add_generation_prompt, <|start_header_id|> assistant <|end_header_id|> "\\n\\n"
"""

from __future__ import annotations

from typing import Any

from sluice.sim import tokens

BEGIN_OF_TEXT = 128000
START_HEADER = 128006
END_HEADER = 128007
EOT = 128009
_TEXT = b"\x02"  # the first byte of a text chunk's id
NEWLINES = 271  # "\n\n" in Llama-3's vocabulary
UNKNOWN_ROLE = 128255  # a reserved special token
ROLE_IDS = {"system": 9125, "user": 882, "assistant": 78191, "tool": 14506, "ipython": 23799}
SPECIAL = {
    BEGIN_OF_TEXT: "<|begin_of_text|>",
    START_HEADER: "<|start_header_id|>",
    END_HEADER: "<|end_header_id|>",
    EOT: "<|eot_id|>",
    NEWLINES: "\n\n",
    UNKNOWN_ROLE: "<|reserved_special_token_247|>",
    **{v: k for k, v in ROLE_IDS.items()},
}


def encode_text(text: str) -> list[int]:
    data = text.encode("utf-8", "replace")
    step = tokens.BYTES_PER_TOKEN
    return [int.from_bytes(_TEXT + data[i : i + step], "big") for i in range(0, len(data), step)]


def _chunk(token: int) -> bytes:
    raw = token.to_bytes((token.bit_length() + 7) // 8, "big")
    if raw[:1] != _TEXT or not 2 <= len(raw) <= tokens.BYTES_PER_TOKEN + 1:
        raise ValueError(f"token id {token} is not in the simulator's vocabulary")
    return raw[1:]


def decode(ids: list[int]) -> str:
    """The text of `ids`; ValueError for an id that no text encodes to."""
    out = bytearray()
    for token in ids:
        special = SPECIAL.get(token)
        if special is not None:
            out += special.encode()
        else:
            out += _chunk(token)
    return out.decode("utf-8", "replace")


def token_str(token: int) -> str:
    special = SPECIAL.get(token)
    if special is not None:
        return special
    return _chunk(token).decode("utf-8", "replace")


def content_texts(content: Any) -> list[str]:
    if content is None:
        return []
    if isinstance(content, str):
        return [content]
    if isinstance(content, list):
        out = []
        for part in content:
            if isinstance(part, str):
                out.append(part)
            elif isinstance(part, dict) and isinstance(part.get("text"), str):
                out.append(part["text"])
        return out
    raise ValueError("message content must be a string or a list of content parts")


def encode_chat(messages: list[dict[str, Any]], *, add_generation_prompt: bool = True) -> list[int]:
    """The prompt ids of a chat; as long as `tokens.count_chat_tokens` says (less the 4
    tokens of the assistant header without `add_generation_prompt`)."""
    ids = [BEGIN_OF_TEXT]
    for message in messages:
        role = message.get("role")
        role_id = ROLE_IDS.get(role, UNKNOWN_ROLE) if isinstance(role, str) else UNKNOWN_ROLE
        ids += [START_HEADER, role_id, END_HEADER, NEWLINES]
        for text in content_texts(message.get("content")):
            ids += encode_text(text)
        name = message.get("name")
        if isinstance(name, str):
            ids += encode_text(name)
        calls = message.get("tool_calls")
        for call in calls if isinstance(calls, list) else ():
            function = call.get("function") if isinstance(call, dict) else None
            if isinstance(function, dict):
                ids += encode_text(str(function.get("name", "")))
                ids += encode_text(str(function.get("arguments", "")))
        ids.append(EOT)
    if add_generation_prompt:
        ids += [START_HEADER, ROLE_IDS["assistant"], END_HEADER, NEWLINES]
    return ids
