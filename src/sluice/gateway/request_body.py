"""Reading what the gateway needs from an OpenAI request body, leaving the rest untouched.

The body is forwarded as the client sent it (fields the gateway does not use pass through);
it is only rewritten when the gateway must ask the backend for usage in a stream."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import orjson

# A chat template adds a few tokens per message (role markers, separators).
_TEMPLATE_TOKENS_PER_MESSAGE = 4
_CHARS_PER_TOKEN = 4
# A non-text part (an image, audio) costs far more than its JSON; a rough floor.
_NON_TEXT_PART_TOKENS = 256


class BadRequest(Exception):
    """The body cannot be served; the message is for the client."""


@dataclass(slots=True)
class ParsedRequest:
    body: dict[str, Any]
    model: str
    stream: bool
    include_usage: bool  # the client asked for the usage chunk
    max_tokens: int | None
    prompt_tokens_est: int
    sequences: int = 1  # each generates up to max_tokens (n, best_of, a list of prompts)


def _text_tokens(text: str) -> int:
    return (len(text) + _CHARS_PER_TOKEN - 1) // _CHARS_PER_TOKEN


def _content_tokens(content: Any) -> int:
    if content is None:
        return 0
    if isinstance(content, str):
        return _text_tokens(content)
    if isinstance(content, list):
        total = 0
        for part in content:
            if not isinstance(part, dict):
                raise BadRequest("each part of a message's content must be an object")
            if part.get("type") == "text":
                text = part.get("text")
                if not isinstance(text, str):
                    raise BadRequest("a text part needs a string 'text'")
                total += _text_tokens(text)
            else:
                total += _NON_TEXT_PART_TOKENS
        return total
    raise BadRequest("a message's content must be a string or a list of parts")


def _prompt_tokens(body: dict[str, Any], chat: bool) -> int:
    if chat:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise BadRequest("'messages' must be a non-empty list")
        total = 0
        for m in messages:
            if not isinstance(m, dict):
                raise BadRequest("each message must be an object")
            total += _TEMPLATE_TOKENS_PER_MESSAGE + _content_tokens(m.get("content"))
        return total
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return max(1, _text_tokens(prompt))
    if isinstance(prompt, list) and prompt:
        if all(isinstance(p, str) for p in prompt):
            return sum(_text_tokens(p) for p in prompt)
        if all(isinstance(p, int) for p in prompt):  # token ids
            return len(prompt)
        if all(isinstance(p, list) for p in prompt):
            return sum(len(p) for p in prompt)
    raise BadRequest("'prompt' must be a string, a list of strings or a list of token ids")


def _int_field(body: dict[str, Any], name: str) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise BadRequest(f"'{name}' must be a positive integer")
    return value


def parse_request(raw: bytes, chat: bool) -> ParsedRequest:
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise BadRequest(f"the body is not valid JSON ({exc})") from None
    if not isinstance(body, dict):
        raise BadRequest("the body must be a JSON object")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise BadRequest("'model' is required and must be a string")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise BadRequest("'stream' must be a boolean")
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise BadRequest("'stream_options' must be an object")
    include_usage = bool(options and options.get("include_usage"))
    max_tokens = _int_field(body, "max_completion_tokens") or _int_field(body, "max_tokens")
    return ParsedRequest(
        body=body,
        model=model,
        stream=stream,
        include_usage=include_usage,
        max_tokens=max_tokens,
        prompt_tokens_est=_prompt_tokens(body, chat),
    )


def upstream_body(req: ParsedRequest, raw: bytes) -> bytes:
    """The bytes to send upstream: the client's own, except that a stream always asks for
    usage (the gateway needs completion token counts; the extra chunk is filtered out for a
    client that did not ask for it)."""
    if not req.stream or req.include_usage:
        return raw
    body = dict(req.body)
    body["stream_options"] = {**(body.get("stream_options") or {}), "include_usage": True}
    return orjson.dumps(body)
