"""Reading what the gateway needs from an OpenAI request body, leaving the rest untouched.

The body is forwarded as the client sent it (fields the gateway does not use pass through);
it is only rewritten when the gateway must ask the backend for usage in a stream.

The cost estimate counts every field that becomes prompt tokens and every sequence the
engine will run, since the KV budgets and the token quotas are only as good as it is:
`chat_prompt_tokens` (messages with their content, names and tool calls; `tools`,
`functions` and `documents`, which the chat template renders into the prompt),
`completion_prompt_tokens` (`prompt` in any of its forms, `suffix`), and `sequences`
(`n`, `best_of`, and for completions one per prompt of a list). Text is counted at
`_CHARS_PER_TOKEN` characters a token (the core corrects it per model from the usage the
backends report); a structured field at the length of its JSON. Each route's parser
calls the ones that apply to it."""

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


def json_tokens(value: Any) -> int:
    """A structured field that becomes prompt text (a tool's JSON schema, tool calls)."""
    if value is None:
        return 0
    if isinstance(value, str):
        return _text_tokens(value)
    try:
        return _text_tokens(orjson.dumps(value).decode())
    except TypeError:  # orjson refuses some values (ints over 64 bits): count the text
        return _text_tokens(str(value))


# Top-level chat fields a chat template renders into the prompt.
_CHAT_PROMPT_FIELDS = ("tools", "functions", "documents")


def chat_prompt_tokens(body: dict[str, Any]) -> int:
    """Prompt tokens of a chat request: each message (the template's few tokens, its
    content, and its other fields: name, tool calls, ...), plus the tools, functions and
    documents the template renders."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest("'messages' must be a non-empty list")
    total = 0
    for m in messages:
        if not isinstance(m, dict):
            raise BadRequest("each message must be an object")
        total += _TEMPLATE_TOKENS_PER_MESSAGE
        for key, value in m.items():
            if key == "content":
                total += _content_tokens(value)
            elif key != "role":
                total += json_tokens(value)
    for key in _CHAT_PROMPT_FIELDS:
        total += json_tokens(body.get(key))
    return total


def completion_prompt_tokens(body: dict[str, Any]) -> int:
    """Prompt tokens of a completions request: every prompt of it, and its `suffix`."""
    prompt = body.get("prompt")
    suffix = body.get("suffix")
    extra = _text_tokens(suffix) if isinstance(suffix, str) else 0
    if isinstance(prompt, str):
        return max(1, _text_tokens(prompt)) + extra
    if isinstance(prompt, list) and prompt:
        if all(isinstance(p, str) for p in prompt):
            return sum(_text_tokens(p) for p in prompt) + extra
        if all(isinstance(p, int) for p in prompt):  # token ids
            return len(prompt) + extra
        if all(isinstance(p, list) for p in prompt):
            return sum(len(p) for p in prompt) + extra
    raise BadRequest("'prompt' must be a string, a list of strings or a list of token ids")


def sequences(body: dict[str, Any], chat: bool) -> int:
    """The sequences the engine runs for the request, each up to max_tokens: the larger of
    `n` and `best_of`, times the prompts of a completions list."""
    per_prompt = max(_int_field(body, "n") or 1, _int_field(body, "best_of") or 1)
    if not chat:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
            per_prompt *= len(prompt)  # a list of prompts (or of token-id lists)
    return per_prompt


def _int_field(body: dict[str, Any], name: str) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise BadRequest(f"'{name}' must be a positive integer")
    return value


def json_object(raw: bytes) -> dict[str, Any]:
    """The body as a JSON object (every route's parser starts here)."""
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise BadRequest(f"the body is not valid JSON ({exc})") from None
    if not isinstance(body, dict):
        raise BadRequest("the body must be a JSON object")
    return body


def parse_request(raw: bytes, chat: bool) -> ParsedRequest:
    body = json_object(raw)
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
        prompt_tokens_est=chat_prompt_tokens(body) if chat else completion_prompt_tokens(body),
        sequences=sequences(body, chat),
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
