"""vLLM's OpenAI surface, without I/O: request validation (with vLLM's error messages and
status codes) and the bytes of responses and SSE chunks, pre-encoded per request so that
a streaming token costs one bytes concatenation."""

from __future__ import annotations

import itertools
import os
import time
import zlib
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

import orjson

from sluice.sim import tokens

CHAT = "chat"
COMPLETION = "completion"

_ids = itertools.count()
_ID_PREFIX = os.urandom(4).hex()


class ApiError(Exception):
    """An error answer in OpenAI's shape, like vLLM's ErrorResponse."""

    def __init__(self, status: int, message: str, err_type: str, param: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.err_type = err_type
        self.param = param

    def body(self) -> bytes:
        return error_body(self.status, self.message, self.err_type, self.param)


def error_body(status: int, message: str, err_type: str, param: str | None = None) -> bytes:
    return orjson.dumps(
        {"error": {"message": message, "type": err_type, "param": param, "code": status}}
    )


def bad_request(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, message, "BadRequestError", param)


@dataclass(slots=True)
class GenerationRequest:
    kind: str  # CHAT or COMPLETION
    model: str
    prompt_tokens: int
    max_tokens: int
    ignore_eos: bool
    min_tokens: int
    stream: bool
    include_usage: bool
    continuous_usage: bool
    # set for greedy (temperature 0) or seeded requests: the same prompt and seed give the
    # same answer, as on a real engine
    sample_key: int | None = None


def _int_field(body: dict[str, Any], name: str, minimum: int) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, float) and value.is_integer():
        value = int(value)  # 5.0 is fine, as in vLLM's (pydantic) validation
    if isinstance(value, bool) or not isinstance(value, int):
        raise bad_request(f"{name} must be an integer", name)
    if value < minimum:
        raise bad_request(f"{name} must be at least {minimum}, got {value}.", name)
    return value


def _bool_field(body: dict[str, Any], name: str) -> bool:
    value = body.get(name, False)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise bad_request(f"{name} must be a boolean", name)
    return value


def _completion_prompt_tokens(prompt: Any) -> int:
    if isinstance(prompt, str):
        return tokens.count_text_tokens(prompt)
    if isinstance(prompt, list) and prompt:
        if all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            return len(prompt)  # already token ids
        if len(prompt) == 1:
            return _completion_prompt_tokens(prompt[0])
        raise bad_request("batched prompts (more than one prompt) are not supported", "prompt")
    raise bad_request("prompt must be a string, a list of token ids, or a list of one", "prompt")


def parse_request(
    kind: str,
    raw: bytes,
    *,
    served_model: str,
    max_model_len: int,
    adapters: Collection[str] = (),
) -> GenerationRequest:
    """Validate a request body the way vLLM does; raise ApiError on bad input."""
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise bad_request(f"Invalid JSON in request body: {exc}") from None
    if not isinstance(body, dict):
        raise bad_request("Request body must be a JSON object")

    model = body.get("model")
    if model is None:
        model = served_model
    elif not isinstance(model, str):
        raise bad_request("model must be a string", "model")
    elif model != served_model and model not in adapters:
        raise ApiError(404, f"The model `{model}` does not exist.", "NotFoundError", "model")

    if kind == CHAT:
        messages = body.get("messages")
        if messages is None:
            raise bad_request("Field required: messages", "messages")
        if not isinstance(messages, list) or not messages:
            raise bad_request("messages must be a non-empty list", "messages")
        for m in messages:
            if not isinstance(m, dict) or not isinstance(m.get("role"), str):
                raise bad_request("each message must be an object with a role", "messages")
        try:
            prompt_tokens = tokens.count_chat_tokens(messages)
        except ValueError as exc:
            raise bad_request(str(exc), "messages") from None
        max_tokens = _int_field(body, "max_completion_tokens", 1)
        if max_tokens is None:
            max_tokens = _int_field(body, "max_tokens", 1)
    else:
        if "prompt" not in body:
            raise bad_request("Field required: prompt", "prompt")
        prompt_tokens = _completion_prompt_tokens(body["prompt"])
        max_tokens = _int_field(body, "max_tokens", 1)
        if max_tokens is None:
            max_tokens = 16  # the OpenAI completions default, which vLLM keeps
    prompt_tokens = max(1, prompt_tokens)

    n = _int_field(body, "n", 1)
    if n is not None and n > 1:
        raise bad_request("n > 1 is not supported by the simulator", "n")

    # vLLM's _validate_input
    if max_tokens is None:
        if prompt_tokens >= max_model_len:
            raise bad_request(
                f"This model's maximum context length is {max_model_len} tokens. However, "
                f"your request has {prompt_tokens} input tokens. Please reduce the length "
                "of the input messages.",
                "messages" if kind == CHAT else "prompt",
            )
        max_tokens = max_model_len - prompt_tokens
    elif prompt_tokens + max_tokens > max_model_len:
        raise bad_request(
            f"This model's maximum context length is {max_model_len} tokens. However, you "
            f"requested {prompt_tokens + max_tokens} tokens ({prompt_tokens} in the "
            f"messages, {max_tokens} in the completion). Please reduce the length of the "
            "messages or completion.",
            "max_tokens",
        )

    stream = _bool_field(body, "stream")
    options = body.get("stream_options")
    include_usage = continuous = False
    if options is not None:
        if not isinstance(options, dict):
            raise bad_request("stream_options must be an object", "stream_options")
        if not stream:
            raise bad_request(
                "Stream options can only be defined when `stream=True`.", "stream_options"
            )
        include_usage = _bool_field(options, "include_usage")
        continuous = include_usage and _bool_field(options, "continuous_usage_stats")
    min_tokens = _int_field(body, "min_tokens", 0) or 0
    seed = _int_field(body, "seed", -(2**63))
    temperature = body.get("temperature")
    sample_key = None
    if seed is not None or temperature == 0:
        prompt = body.get("messages") if kind == CHAT else body.get("prompt")
        canonical = orjson.dumps([seed, prompt], option=orjson.OPT_SORT_KEYS)
        sample_key = zlib.crc32(canonical)
    return GenerationRequest(
        kind=kind,
        model=model,
        prompt_tokens=prompt_tokens,
        max_tokens=max_tokens,
        ignore_eos=_bool_field(body, "ignore_eos"),
        min_tokens=min(min_tokens, max_tokens),
        stream=stream,
        include_usage=include_usage,
        continuous_usage=continuous,
        sample_key=sample_key,
    )


def new_id(prefix: str) -> str:
    """`prefix` and 16 hex digits, like vLLM's `random_uuid()` ids; unique per process."""
    return f"{prefix}{_ID_PREFIX}{next(_ids):08x}"


def new_request_id(kind: str) -> str:
    return new_id("chatcmpl-" if kind == CHAT else "cmpl-")


class ResponseFormatter:
    """The bytes of one request's answer: SSE chunks (stream) or the JSON body."""

    __slots__ = (
        "_base",
        "_head",
        "_tail",
        "_tail_final",
        "created",
        "kind",
        "model",
        "offset",
        "prompt_tokens",
        "request_id",
    )

    def __init__(
        self,
        kind: str,
        request_id: str,
        model: str,
        prompt_tokens: int,
        sample_key: int | None = None,
    ) -> None:
        self.kind = kind
        self.request_id = request_id
        self.model = model
        self.prompt_tokens = prompt_tokens
        self.created = int(time.time())
        key = zlib.crc32(request_id.encode()) if sample_key is None else sample_key
        self.offset = key % len(tokens.WORDS)
        obj = "chat.completion.chunk" if kind == CHAT else "text_completion"
        head = (
            f'data: {{"id":"{request_id}","object":"{obj}","created":{self.created},'
            f'"model":{orjson.dumps(model).decode()},"choices":[{{"index":0,'
        )
        self._base = head.encode()
        if kind == CHAT:
            self._head = (head + '"delta":{"content":"').encode()
            self._tail = b'"},"logprobs":null,"finish_reason":null}]}\n\n'
            self._tail_final = (
                '"}},"logprobs":null,"finish_reason":"{}","stop_reason":null}}]}}\n\n'
            )
        else:
            self._head = (head + '"text":"').encode()
            self._tail = b'","logprobs":null,"finish_reason":null,"stop_reason":null}]}\n\n'
            self._tail_final = '","logprobs":null,"finish_reason":"{}","stop_reason":null}}]}}\n\n'

    def _usage(self, completion_tokens: int) -> dict[str, int]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "total_tokens": self.prompt_tokens + completion_tokens,
            "completion_tokens": completion_tokens,
        }

    def role_chunk(self) -> bytes:
        """vLLM opens a chat stream with the assistant role, sent with the first token."""
        if self.kind != CHAT:
            return b""
        return (
            self._base
            + b'"delta":{"role":"assistant","content":""},'
            + b'"logprobs":null,"finish_reason":null}]}\n\n'
        )

    def token_chunk(self, index: int, finish_reason: str | None) -> bytes:
        word = tokens.WORD_BYTES[(self.offset + index) % len(tokens.WORD_BYTES)]
        if finish_reason is None:
            return self._head + word + self._tail
        return self._head + word + self._tail_final.format(finish_reason).encode()

    def token_chunk_with_usage(self, index: int, finish_reason: str | None) -> bytes:
        """A chunk carrying running usage (stream_options.continuous_usage_stats)."""
        chunk = self.token_chunk(index, finish_reason)
        usage = orjson.dumps(self._usage(index + 1))
        return chunk[: -len(b"}\n\n")] + b',"usage":' + usage + b"}\n\n"

    def usage_chunk(self, completion_tokens: int) -> bytes:
        obj = "chat.completion.chunk" if self.kind == CHAT else "text_completion"
        payload = {
            "id": self.request_id,
            "object": obj,
            "created": self.created,
            "model": self.model,
            "choices": [],
            "usage": self._usage(completion_tokens),
        }
        return b"data: " + orjson.dumps(payload) + b"\n\n"

    def text(self, completion_tokens: int) -> str:
        n = len(tokens.WORDS)
        return "".join(tokens.WORDS[(self.offset + i) % n] for i in range(completion_tokens))

    def full_response(self, completion_tokens: int, finish_reason: str) -> bytes:
        text = self.text(completion_tokens)
        if self.kind == CHAT:
            choice: dict[str, Any] = {
                "index": 0,
                "message": {
                    "role": "assistant",
                    "content": text,
                    "refusal": None,
                    "tool_calls": [],
                },
                "logprobs": None,
                "finish_reason": finish_reason,
                "stop_reason": None,
            }
            obj = "chat.completion"
        else:
            choice = {
                "index": 0,
                "text": text,
                "logprobs": None,
                "finish_reason": finish_reason,
                "stop_reason": None,
                "prompt_logprobs": None,
            }
            obj = "text_completion"
        return orjson.dumps(
            {
                "id": self.request_id,
                "object": obj,
                "created": self.created,
                "model": self.model,
                "choices": [choice],
                "usage": self._usage(completion_tokens),
                "prompt_logprobs": None,
            }
        )


DONE_CHUNK = b"data: [DONE]\n\n"


def stream_error_chunk(message: str, err_type: str, status: int) -> bytes:
    """vLLM reports an error inside an open stream as a data chunk with an error object."""
    return b"data: " + error_body(status, message, err_type) + b"\n\n"
