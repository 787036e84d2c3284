"""Anthropic's Messages API as vLLM 0.32 serves it, without I/O.

Read from vLLM 0.32.0: vllm/entrypoints/anthropic/protocol.py (the request models and
their validators, `AnthropicStreamEvent`, `AnthropicMessagesResponse`), serving.py
(`to_chat_completion_request`, `messages_full_converter`, `message_stream_converter`,
`count_tokens`, `_to_anthropic_stop_reason`, `_build_anthropic_usage`) and api_router.py
(`translate_error_response`).

vLLM turns a Messages request into a chat completion (system prompt first, text blocks as
text, `tool_use` blocks as tool calls, `tool_result` blocks as tool messages) and runs it
as one; so does the simulator (through `openai_api.parse_request`, so counts, limits,
output text and their errors are the chat route's). A stream is what vLLM's converter makes
of the chat stream it asked for with usage on every chunk: with the first token
`message_start` (usage: the prompt, 0 output tokens), `content_block_start` (an empty text
block, index 0) and the first `content_block_delta` (`text_delta`); one delta per token;
then `content_block_stop`, `message_delta` (`stop_reason` "end_turn", or "max_tokens" at
the limit, and the usage) and `message_stop`. Each event is
`event: TYPE\\ndata: JSON\\n\\n` with the JSON dumped `exclude_unset` as vLLM does.
Errors from the handler are in Anthropic's shape, `{"type": "error", "error": {"type",
"message"}}`, with vLLM's error type names (e.g. "NotFoundError") and status; a body that
fails request validation is answered by FastAPI's handler in OpenAI's shape, as vLLM does.

One extension: a top-level `ignore_eos: true` is honoured (vLLM ignores unknown fields),
so benchmarks can fix output lengths on this route as on chat.
"""

from __future__ import annotations

import zlib
from typing import Any

import orjson

from sluice.sim import fields, tokens
from sluice.sim.fields import VALIDATION_TYPE
from sluice.sim.openai_api import CHAT, ApiError, GenerationRequest, parse_request

ROLES = ("user", "assistant", "system")
BLOCK_TYPES = (
    "text",
    "image",
    "tool_use",
    "tool_result",
    "tool_reference",
    "thinking",
    "redacted_thinking",
    "tool_addition",
    "tool_removal",
)
STOP_REASONS = {"length": "max_tokens", "stop": "end_turn"}


def anthropic_error_body(err: ApiError) -> bytes:
    """vLLM's `translate_error_response`; request-validation errors keep OpenAI's shape."""
    if err.err_type == VALIDATION_TYPE:
        return err.body()
    return orjson.dumps({"type": "error", "error": {"type": err.err_type, "message": err.message}})


def _blocks(value: Any, loc: str) -> list[dict[str, Any]]:
    if not isinstance(value, list):
        raise fields.invalid(loc, "Input should be a valid string or list", "union_type")
    for i, block in enumerate(value):
        if not isinstance(block, dict):
            raise fields.invalid(f"{loc}.{i}", "Input should be a valid dictionary", "dict_type")
        if block.get("type") not in BLOCK_TYPES:
            raise fields.invalid(
                f"{loc}.{i}.type", "Input should be one of the content block types", "literal_error"
            )
    return value


def _block_text(block: dict[str, Any]) -> str:
    for key in ("text", "thinking"):
        if isinstance(block.get(key), str):
            return block[key]
    return ""


def _tool_result_content(block: dict[str, Any]) -> Any:
    content = block.get("content")
    if isinstance(content, list):
        return [
            {"type": "text", "text": part["text"]}
            for part in content
            if isinstance(part, dict) and isinstance(part.get("text"), str)
        ]
    return content if isinstance(content, str) else ""


def chat_messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    """The chat messages vLLM's `to_chat_completion_request` would build."""
    out: list[dict[str, Any]] = []
    system = body.get("system")
    if isinstance(system, str):
        if system:
            out.append({"role": "system", "content": system})
    elif system is not None:
        text = "".join(_block_text(b) for b in _blocks(system, "system"))
        out.append({"role": "system", "content": text})
    messages = fields.required(body, "messages")
    if not isinstance(messages, list):
        raise fields.invalid("messages", "Input should be a valid list", "list_type")
    for i, message in enumerate(messages):
        loc = f"messages.{i}"
        if not isinstance(message, dict):
            raise fields.invalid(loc, "Input should be a valid dictionary", "dict_type")
        role = message.get("role")
        if role not in ROLES:
            raise fields.invalid(
                f"{loc}.role", "Input should be 'user', 'assistant' or 'system'", "literal_error"
            )
        content = fields.required(message, "content")
        if isinstance(content, str):
            out.append({"role": role, "content": content})
            continue
        parts: list[dict[str, Any]] = []
        calls: list[dict[str, Any]] = []
        results: list[dict[str, Any]] = []
        for block in _blocks(content, f"{loc}.content"):
            kind = block["type"]
            if kind == "tool_use":
                arguments = orjson.dumps(block.get("input") or {}).decode()
                calls.append(
                    {"function": {"name": str(block.get("name", "")), "arguments": arguments}}
                )
            elif kind == "tool_result":
                results.append({"role": "tool", "content": _tool_result_content(block)})
            elif kind in ("text", "thinking"):
                parts.append({"type": "text", "text": _block_text(block)})
            # images and tool changes carry no text tokens here
        out.extend(results)
        if parts or calls or not results:
            entry: dict[str, Any] = {"role": role, "content": parts}
            if calls:
                entry["tool_calls"] = calls
            out.append(entry)
    return out


def _model(body: dict[str, Any]) -> str:
    model = fields.required(body, "model")
    if not isinstance(model, str):
        raise fields.invalid("model", "Input should be a valid string", "string_type")
    if not model:
        raise fields.invalid_value("model", "Model is required")
    return model


def parse_messages(body: dict[str, Any], *, max_model_len: int) -> tuple[str, GenerationRequest]:
    """The requested model and the chat generation a create request runs (ApiError)."""
    model = _model(body)
    messages = chat_messages(body)
    fields.required(body, "max_tokens")
    max_tokens = fields.integer(body, "max_tokens")
    if max_tokens is None:
        raise fields.invalid("max_tokens", "Input should be a valid integer", "int_type")
    if max_tokens <= 0:
        raise fields.invalid_value("max_tokens", "max_tokens must be positive")
    thinking = body.get("thinking")
    if isinstance(thinking, dict) and thinking.get("type") == "enabled":
        budget = thinking.get("budget_tokens")
        if isinstance(budget, int) and budget >= max_tokens:
            raise fields.invalid_value(
                "thinking", "thinking.budget_tokens must be less than max_tokens"
            )
    stream = fields.boolean(body, "stream")
    chat: dict[str, Any] = {
        "messages": messages,
        "max_tokens": max_tokens,
        "stream": stream,
        "ignore_eos": fields.boolean(body, "ignore_eos"),
    }
    temperature = fields.number(body, "temperature")
    if temperature is not None:
        chat["temperature"] = temperature
    generation = parse_request(
        CHAT, orjson.dumps(chat), served_model="", max_model_len=max_model_len
    )
    return model, generation


def count_tokens(body: dict[str, Any]) -> tuple[str, int]:
    """The requested model and the prompt's tokens (`messages.count_tokens`)."""
    model = _model(body)
    try:
        return model, tokens.count_chat_tokens(chat_messages(body))
    except ValueError as exc:
        raise fields.invalid("messages", str(exc)) from None


def count_tokens_body(input_tokens: int) -> bytes:
    return orjson.dumps(
        {
            "input_tokens": input_tokens,
            "context_management": {"original_input_tokens": input_tokens},
        }
    )


def _event(kind: str, payload: dict[str, Any]) -> bytes:
    return b"event: " + kind.encode() + b"\ndata: " + orjson.dumps(payload) + b"\n\n"


class MessageWriter:
    """One message's answer: the JSON body, or its stream events around the tokens."""

    def __init__(
        self, message_id: str, model: str, prompt_tokens: int, sample_key: int | None
    ) -> None:
        self.message_id = message_id
        self.model = model
        self.prompt_tokens = prompt_tokens
        key = zlib.crc32(message_id.encode()) if sample_key is None else sample_key
        self.offset = key % len(tokens.WORDS)
        self._delta_head = (
            b'event: content_block_delta\ndata: {"type":"content_block_delta",'
            b'"delta":{"type":"text_delta","text":"'
        )
        self._delta_tail = b'"},"index":0}\n\n'

    def text(self, n: int) -> str:
        words = tokens.WORDS
        return "".join(words[(self.offset + i) % len(words)] for i in range(n))

    def full(self, generated: int, finish_reason: str | None) -> dict[str, Any]:
        text = self.text(generated)
        return {
            "id": self.message_id,
            "type": "message",
            "role": "assistant",
            "content": [{"type": "text", "text": text}],
            "model": self.model,
            "stop_reason": STOP_REASONS.get(finish_reason or "stop", "end_turn"),
            "usage": {"input_tokens": self.prompt_tokens, "output_tokens": generated},
        }

    def first(self) -> bytes:
        message: dict[str, Any] = {
            "id": self.message_id,
            "type": "message",
            "role": "assistant",
            "content": [],
            "model": self.model,
            "stop_reason": None,
            "stop_sequence": None,
            "usage": {"input_tokens": self.prompt_tokens, "output_tokens": 0},
        }
        return _event("message_start", {"type": "message_start", "message": message}) + _event(
            "content_block_start",
            {
                "type": "content_block_start",
                "content_block": {"type": "text", "text": ""},
                "index": 0,
            },
        )

    def delta(self, index: int, finish_reason: str | None) -> bytes:
        word = tokens.WORD_BYTES[(self.offset + index) % len(tokens.WORD_BYTES)]
        return self._delta_head + word + self._delta_tail

    def closing(self, generated: int, finish_reason: str | None) -> bytes:
        stop_reason = STOP_REASONS.get(finish_reason or "stop", "end_turn")
        return (
            _event("content_block_stop", {"type": "content_block_stop", "index": 0})
            + _event(
                "message_delta",
                {
                    "type": "message_delta",
                    "delta": {"stop_reason": stop_reason, "stop_sequence": None},
                    "usage": {"input_tokens": self.prompt_tokens, "output_tokens": generated},
                },
            )
            + _event("message_stop", {"type": "message_stop"})
        )

    @staticmethod
    def error_event(message: str) -> bytes:
        return _event(
            "error", {"type": "error", "error": {"type": "internal_error", "message": message}}
        )
