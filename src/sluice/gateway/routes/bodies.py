"""What the routes' parsers share: the model and stream flags, and token counts of any
input (text at request_body's characters per token, token ids one each, images at a
floor). The body itself is read by request_body.json_object, and the chat and completions
parsers are request_body.py's."""

from __future__ import annotations

from typing import Any

from sluice.gateway.request_body import (
    _NON_TEXT_PART_TOKENS,
    BadRequest,
    ParsedRequest,
    _int_field,
    _text_tokens,
)

# The template tokens a chat-style message adds (role markers, separators).
MESSAGE_TOKENS = 4
# Keys of a structured input whose values are not prompt text.
_NOT_TEXT = frozenset({"type", "role", "id", "call_id", "status", "cache_control"})
_IMAGE_TYPES = frozenset({"image", "image_url", "input_image", "input_file", "input_audio"})


class Unsupported(BadRequest):
    """A valid request the gateway does not serve; `code` names why (the error's code)."""

    def __init__(self, message: str, code: str) -> None:
        super().__init__(message)
        self.code = code


def model_of(body: dict[str, Any], required: bool = True) -> str:
    """The model the request names ("" when it names none and need not: any backend)."""
    model = body.get("model")
    if model is None and not required:
        return ""
    if not isinstance(model, str) or not model:
        raise BadRequest("'model' is required and must be a string")
    return model


def stream_of(body: dict[str, Any]) -> bool:
    stream = body.get("stream", False)
    if stream is None:
        return False
    if not isinstance(stream, bool):
        raise BadRequest("'stream' must be a boolean")
    return stream


def positive_int(body: dict[str, Any], name: str) -> int | None:
    return _int_field(body, name)


def input_tokens(value: Any) -> int:
    """Prompt tokens of any input: a string, token ids, lists of either, or structured
    content (messages, parts, documents): every string counted as text, every id as one
    token, an image or file part at a floor, keys such as `type` and `role` not at all."""
    if value is None or isinstance(value, bool):
        return 0
    if isinstance(value, str):
        return _text_tokens(value)
    if isinstance(value, (int, float)):
        return 1
    if isinstance(value, list):
        return sum(input_tokens(v) for v in value)
    if isinstance(value, dict):
        if value.get("type") in _IMAGE_TYPES:
            return _NON_TEXT_PART_TOKENS
        return sum(input_tokens(v) for k, v in value.items() if k not in _NOT_TEXT)
    return 0


def messages_tokens(messages: Any, name: str = "messages") -> int:
    """A chat-style list of messages: the template's tokens for each, and its content."""
    if not isinstance(messages, list) or not messages:
        raise BadRequest(f"'{name}' must be a non-empty list")
    total = 0
    for m in messages:
        if not isinstance(m, dict):
            raise BadRequest(f"each of '{name}' must be an object")
        total += MESSAGE_TOKENS + input_tokens(m)
    return total


def parsed(
    body: dict[str, Any],
    model: str,
    prompt_tokens: int,
    *,
    stream: bool = False,
    max_tokens: int | None = None,
    sequences: int = 1,
) -> ParsedRequest:
    return ParsedRequest(
        body=body,
        model=model,
        stream=stream,
        include_usage=False,
        max_tokens=max_tokens,
        prompt_tokens_est=max(1, prompt_tokens),
        sequences=sequences,
    )
