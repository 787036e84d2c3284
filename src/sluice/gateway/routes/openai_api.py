"""The OpenAI routes of a vLLM server that generate: chat completions, completions, and
vLLM's /v1/chat/completions/batch (several conversations in one request, not streamed;
vllm/entrypoints/openai/chat_completion/protocol.py BatchChatCompletionRequest)."""

from __future__ import annotations

from typing import Any

from multidict import CIMultiDictProxy

from sluice.gateway.fallback import static_fallback
from sluice.gateway.request_body import ParsedRequest, _int_field, json_object, parse_request
from sluice.gateway.routes import bodies
from sluice.gateway.routes.spec import RouteSpec, StreamShape

# A chat or completions stream: usage in its own event, `"choices":[]` (which the gateway
# asks for and cuts out when the client did not); vLLM's own refusal of a stream is an
# HTTP 200 whose first event is an error.
OPENAI_STREAM = StreamShape(
    usage_marker=b'"choices":[]', refusal_prefix=b'data: {"error"', asks_usage=True
)


def parse_chat(raw: bytes, _headers: CIMultiDictProxy[str]) -> ParsedRequest:
    return parse_request(raw, True)


def parse_completion(raw: bytes, _headers: CIMultiDictProxy[str]) -> ParsedRequest:
    return parse_request(raw, False)


def parse_chat_batch(raw: bytes, _headers: CIMultiDictProxy[str]) -> ParsedRequest:
    """Each conversation is a sequence of its own: its prompt, and up to max_tokens."""
    body = json_object(raw)
    conversations: Any = body.get("messages")
    if not isinstance(conversations, list) or not conversations:
        raise bodies.BadRequest("'messages' must be a non-empty list of conversations")
    prompt = 0
    for i, conversation in enumerate(conversations):
        prompt += bodies.messages_tokens(conversation, f"messages[{i}]")
    max_tokens = _int_field(body, "max_completion_tokens") or _int_field(body, "max_tokens")
    return bodies.parsed(
        body,
        bodies.model_of(body),
        prompt,
        stream=bodies.stream_of(body),
        max_tokens=max_tokens,
        sequences=len(conversations),
    )


async def _chat_fallback(request: Any, parsed: ParsedRequest, text: str, headers: Any) -> Any:
    return await static_fallback(request, parsed, text, True, headers)


async def _completion_fallback(request: Any, parsed: ParsedRequest, text: str, headers: Any) -> Any:
    return await static_fallback(request, parsed, text, False, headers)


CHAT = RouteSpec(
    "chat",
    "/v1/chat/completions",
    parse_chat,
    stream=OPENAI_STREAM,
    fallback=_chat_fallback,
)
COMPLETIONS = RouteSpec(
    "completions",
    "/v1/completions",
    parse_completion,
    stream=OPENAI_STREAM,
    fallback=_completion_fallback,
)
CHAT_BATCH = RouteSpec("chat_batch", "/v1/chat/completions/batch", parse_chat_batch)
