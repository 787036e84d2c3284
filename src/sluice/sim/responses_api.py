"""The OpenAI Responses API as vLLM 0.32 serves it, without I/O: request validation and
the bytes of the response object and of its SSE events.

Read from vLLM 0.32.0: vllm/entrypoints/openai/responses/protocol.py (`ResponsesRequest`,
its validators, `ResponsesResponse.from_request`, `ResponseUsage`), serving.py
(`_validate_create_responses_input`, `_validate_generator_input`, `create_responses`,
`responses_full_generator`, `responses_stream_generator`, the store and background
paths) and streaming_events.py (`SimpleStreamingEventProcessor`, `emit_simple_content_*`):
the simple (non-harmony, no reasoning or tool parser) path a Llama-style model takes.

A stream is, with its `sequence_number`s:
0 `response.created` and 1 `response.in_progress` (status "in_progress", output []), sent
at once; with the first token 2 `response.output_item.added` (a message, status
"in_progress") and 3 `response.content_part.added` (an empty output_text); one
`response.output_text.delta` per token; then `response.output_text.done`,
`response.content_part.done`, `response.output_item.done` and `response.completed`, whose
response carries the output and `usage`. Each event is `event: TYPE\\ndata: JSON\\n\\n`, as
vLLM's `_convert_stream_to_sse_events` writes it (no `[DONE]`). The JSON keys are in the
order pydantic dumps vLLM's models. Status is "incomplete" (with
`incomplete_details.reason` "max_output_tokens") when the answer stopped at its token
limit, "completed" otherwise.
"""

from __future__ import annotations

import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import orjson

from sluice.sim import fields, tokens
from sluice.sim.openai_api import ApiError, new_id

INVALID_REQUEST = "invalid_request_error"  # the err_type vLLM's responses handler uses
STORE_DISABLED = (
    "This vLLM engine does not support `store=True` and therefore does not support the "
    "background mode. To enable these features, set the environment variable "
    "`VLLM_ENABLE_RESPONSES_API_STORE=1` when launching the vLLM server."
)
_INCLUDE_LOGPROBS = "message.output_text.logprobs"


def not_found(response_id: str) -> ApiError:
    return ApiError(
        404, f"Response with id '{response_id}' not found.", INVALID_REQUEST, "response_id"
    )


@dataclass(slots=True)
class ResponsesRequest:
    request_id: str
    model: str
    messages: list[dict[str, Any]]  # the prompt, as chat messages (kept for follow-ups)
    prompt_tokens: int
    max_tokens: int
    ignore_eos: bool
    stream: bool
    store: bool
    background: bool
    sample_key: int | None
    echo: dict[str, Any] = field(default_factory=dict)  # fields the response object repeats


def _item_message(item: Any, index: int) -> dict[str, Any]:
    """One `input` item as a chat message (what vLLM's renderer feeds the template)."""
    loc = f"input.{index}"
    if not isinstance(item, dict):
        raise fields.invalid(loc, "Input should be a valid dictionary", "dict_type")
    kind = item.get("type")
    if kind == "function_call":
        call = {"function": {"name": item.get("name", ""), "arguments": item.get("arguments", "")}}
        return {"role": "assistant", "content": None, "tool_calls": [call]}
    if kind == "function_call_output":
        output = item.get("output")
        return {"role": "tool", "content": output if isinstance(output, str | list) else ""}
    if kind == "reasoning":
        parts = [*(item.get("summary") or []), *(item.get("content") or [])]
        return {"role": "assistant", "content": [p for p in parts if isinstance(p, dict)]}
    if kind not in (None, "message"):
        return {"role": "assistant", "content": None}  # a tool call's record: no text
    role = item.get("role")
    if role not in ("user", "assistant", "system", "developer"):
        raise fields.invalid(
            f"{loc}.role", "Input should be 'user', 'assistant', 'system' or 'developer'"
        )
    content = item.get("content")
    if not isinstance(content, str | list):
        raise fields.invalid(f"{loc}.content", "Input should be a valid string or list")
    return {"role": role, "content": content}


def prompt_messages(
    body: dict[str, Any], previous: list[dict[str, Any]] | None
) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = list(previous or [])
    instructions = fields.string(body, "instructions")
    if instructions:
        messages.insert(0, {"role": "system", "content": instructions})
    value = fields.required(body, "input")
    if isinstance(value, str):
        messages.append({"role": "user", "content": value})
    elif isinstance(value, list):
        messages.extend(_item_message(item, i) for i, item in enumerate(value))
    else:
        raise fields.invalid("input", "Input should be a valid string or list", "union_type")
    return messages


def parse_request(
    body: dict[str, Any],
    *,
    resolve_model: Callable[[Any], str],
    max_model_len: int,
    store_enabled: bool,
    previous_messages: Callable[[str], list[dict[str, Any]] | None],
) -> ResponsesRequest:
    """Validate a create request as vLLM does; raise ApiError (vLLM's status and shape)."""
    # model validators first (pydantic), then the handler's checks, in vLLM's order
    if body.get("prompt") is not None:
        raise fields.invalid_value("prompt", "prompt template is not supported")
    background = fields.boolean(body, "background")
    store = fields.boolean(body, "store", default=True)
    if background and not store:
        raise fields.invalid_value("background", "background can only be used when `store` is true")
    tools = body.get("tools") or []
    if not isinstance(tools, list):
        raise fields.invalid("tools", "Input should be a valid list", "list_type")
    tool_choice = body.get("tool_choice", "auto")
    if not tools:
        if tool_choice in ("auto", "none"):
            tool_choice = "none"
        elif tool_choice == "required":
            raise fields.invalid_value(
                "tool_choice", "Tool choice 'required' must be specified with 'tools' parameter."
            )
        elif isinstance(tool_choice, dict):
            raise fields.invalid_value(
                "tool_choice", "Tool choice 'function' not found in 'tools' parameter."
            )
    max_output = fields.integer(body, "max_output_tokens")
    temperature = fields.number(body, "temperature")
    top_p = fields.number(body, "top_p")
    seed = fields.integer(body, "seed")
    stream = fields.boolean(body, "stream")
    ignore_eos = fields.boolean(body, "ignore_eos")
    include = body.get("include") or []
    top_logprobs = fields.integer(body, "top_logprobs", minimum=0, default=0)
    request_id = fields.string(body, "request_id") or new_id("resp_")

    model = resolve_model(body.get("model"))
    if store and not store_enabled and background:
        raise ApiError(400, STORE_DISABLED, INVALID_REQUEST, "background")
    if store and not store_enabled:
        store = False  # vLLM silently serves it unstored
    previous_id = fields.string(body, "previous_response_id")
    previous = None
    if previous_id is not None:
        previous = previous_messages(previous_id)
        if previous is None:
            raise not_found(previous_id)
    messages = prompt_messages(body, previous)
    try:
        prompt_tokens = max(1, tokens.count_chat_tokens(messages))
    except ValueError as exc:
        raise fields.invalid("input", str(exc)) from None
    if prompt_tokens >= max_model_len:
        raise ApiError(
            400,
            f"The engine prompt length {prompt_tokens} exceeds the max_model_len "
            f"{max_model_len}. Please reduce prompt.",
            INVALID_REQUEST,
            "input",
        )
    max_tokens = max_model_len - prompt_tokens  # vLLM's get_max_tokens
    if max_output is not None:
        max_tokens = min(max_output, max_tokens)
    if max_tokens < 1:
        raise ApiError(400, f"max_tokens must be at least 1, got {max_tokens}.", "BadRequestError")
    sample_key = None
    if seed is not None or temperature == 0:
        canonical = orjson.dumps([seed, messages], option=orjson.OPT_SORT_KEYS)
        sample_key = zlib.crc32(canonical)
    echo = {
        "instructions": body.get("instructions"),
        "metadata": body.get("metadata"),
        "parallel_tool_calls": body.get("parallel_tool_calls", True) is not False,
        "temperature": 1.0 if temperature is None else temperature,
        "tool_choice": tool_choice,
        "tools": tools,
        "top_p": 1.0 if top_p is None else top_p,
        "background": background,
        "max_output_tokens": max_tokens,
        "max_tool_calls": body.get("max_tool_calls"),
        "previous_response_id": previous_id,
        "prompt": None,
        "reasoning": body.get("reasoning"),
        "service_tier": body.get("service_tier") or "auto",
        "text": body.get("text"),
        "top_logprobs": top_logprobs if _INCLUDE_LOGPROBS in include else None,
        "truncation": body.get("truncation") or "disabled",
        "user": body.get("user"),
        "presence_penalty": fields.number(body, "presence_penalty") or 0.0,
        "frequency_penalty": fields.number(body, "frequency_penalty") or 0.0,
    }
    return ResponsesRequest(
        request_id=request_id,
        model=model,
        messages=messages,
        prompt_tokens=prompt_tokens,
        max_tokens=max_tokens,
        ignore_eos=ignore_eos,
        stream=stream,
        store=store,
        background=background,
        sample_key=sample_key,
        echo=echo,
    )


def usage(prompt_tokens: int, output_tokens: int) -> dict[str, Any]:
    return {
        "input_tokens": prompt_tokens,
        "input_tokens_details": {
            "cached_tokens": 0,
            "cache_write_tokens": 0,
            "input_tokens_per_turn": [],
            "cached_tokens_per_turn": [],
        },
        "output_tokens": output_tokens,
        "output_tokens_details": {
            "reasoning_tokens": 0,
            "tool_output_tokens": 0,
            "output_tokens_per_turn": [],
            "tool_output_tokens_per_turn": [],
        },
        "total_tokens": prompt_tokens + output_tokens,
    }


def _text_part(text: str, logprobs: list[Any] | None) -> dict[str, Any]:
    return {"annotations": [], "text": text, "type": "output_text", "logprobs": logprobs}


def message_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    content = [_text_part(text, None)] if text else []
    return {
        "id": item_id,
        "content": content,
        "role": "assistant",
        "status": status,
        "type": "message",
        "phase": None,
    }


def status_of(finish_reason: str | None) -> str:
    return "incomplete" if finish_reason == "length" else "completed"


class ResponseWriter:
    """One response's objects and stream events (`created_at` is fixed at creation)."""

    def __init__(self, req: ResponsesRequest) -> None:
        self.req = req
        self.created_at = int(time.time())
        key = zlib.crc32(req.request_id.encode()) if req.sample_key is None else req.sample_key
        self.offset = key % len(tokens.WORDS)
        self.item_id = new_id("msg_")
        self._delta_head = b'event: response.output_text.delta\ndata: {"content_index":0,"delta":"'
        self._delta_tail = (
            f'","item_id":"{self.item_id}","logprobs":[],"output_index":0,"sequence_number":'
        ).encode()

    def text(self, n: int) -> str:
        words = tokens.WORDS
        return "".join(words[(self.offset + i) % len(words)] for i in range(n))

    def response(
        self,
        status: str,
        output: list[dict[str, Any]],
        usage_obj: dict[str, Any] | None,
    ) -> dict[str, Any]:
        r = self.req
        incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
        return {
            "id": r.request_id,
            "created_at": self.created_at,
            "incomplete_details": incomplete,
            "instructions": r.echo["instructions"],
            "metadata": r.echo["metadata"],
            "model": r.model,
            "object": "response",
            "output": output,
            **{k: r.echo[k] for k in _ECHO_MIDDLE},
            "status": status,
            "text": r.echo["text"],
            "top_logprobs": r.echo["top_logprobs"],
            "truncation": r.echo["truncation"],
            "usage": usage_obj,
            "user": r.echo["user"],
            "presence_penalty": r.echo["presence_penalty"],
            "frequency_penalty": r.echo["frequency_penalty"],
            "kv_transfer_params": None,
            "ec_transfer_params": None,
            "input_messages": None,
            "output_messages": None,
        }

    def final(self, generated: int, finish_reason: str | None, item_id: str) -> dict[str, Any]:
        """The finished response: its message, status and usage."""
        item = message_item(item_id, self.text(generated), "completed")
        return self.response(
            status_of(finish_reason), [item], usage(self.req.prompt_tokens, generated)
        )

    def queued(self) -> dict[str, Any]:
        return self.response("queued", [], None)

    # -- stream events ------------------------------------------------------------------

    @staticmethod
    def event(kind: str, payload: dict[str, Any]) -> bytes:
        return b"event: " + kind.encode() + b"\ndata: " + orjson.dumps(payload) + b"\n\n"

    def opening_events(self) -> list[bytes]:
        initial = self.response("in_progress", [], None)
        return [
            self.event(
                "response.created",
                {"response": initial, "sequence_number": 0, "type": "response.created"},
            ),
            self.event(
                "response.in_progress",
                {"response": initial, "sequence_number": 1, "type": "response.in_progress"},
            ),
        ]

    def first_events(self) -> list[bytes]:
        item = message_item(self.item_id, "", "in_progress")
        return [
            self.event(
                "response.output_item.added",
                {
                    "item": item,
                    "output_index": 0,
                    "sequence_number": 2,
                    "type": "response.output_item.added",
                },
            ),
            self.event(
                "response.content_part.added",
                {
                    "content_index": 0,
                    "item_id": self.item_id,
                    "output_index": 0,
                    "part": _text_part("", []),
                    "sequence_number": 3,
                    "type": "response.content_part.added",
                },
            ),
        ]

    def first(self) -> bytes:
        return b"".join(self.first_events())

    def delta(self, index: int, finish_reason: str | None) -> bytes:
        word = tokens.WORD_BYTES[(self.offset + index) % len(tokens.WORD_BYTES)]
        return (
            self._delta_head
            + word
            + self._delta_tail
            + str(4 + index).encode()
            + b',"type":"response.output_text.delta"}\n\n'
        )

    def closing_events(self, generated: int, finish_reason: str | None) -> list[bytes]:
        text = self.text(generated)
        seq = 4 + generated
        final = self.final(generated, finish_reason, self.item_id)
        return [
            self.event(
                "response.output_text.done",
                {
                    "content_index": 0,
                    "item_id": self.item_id,
                    "logprobs": [],
                    "output_index": 0,
                    "sequence_number": seq,
                    "text": text,
                    "type": "response.output_text.done",
                },
            ),
            self.event(
                "response.content_part.done",
                {
                    "content_index": 0,
                    "item_id": self.item_id,
                    "output_index": 0,
                    "part": _text_part(text, None),
                    "sequence_number": seq + 1,
                    "type": "response.content_part.done",
                },
            ),
            self.event(
                "response.output_item.done",
                {
                    "item": message_item(self.item_id, text, "completed"),
                    "output_index": 0,
                    "sequence_number": seq + 2,
                    "type": "response.output_item.done",
                },
            ),
            self.event(
                "response.completed",
                {"response": final, "sequence_number": seq + 3, "type": "response.completed"},
            ),
        ]


_ECHO_MIDDLE = (
    "parallel_tool_calls",
    "temperature",
    "tool_choice",
    "tools",
    "top_p",
    "background",
    "max_output_tokens",
    "max_tool_calls",
    "previous_response_id",
    "prompt",
    "reasoning",
    "service_tier",
)
