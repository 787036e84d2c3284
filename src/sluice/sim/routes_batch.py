"""`POST /v1/chat/completions/batch`: several conversations in one request, one choice
each, never streamed (vllm/entrypoints/openai/chat_completion/batch_serving.py and
`BatchChatCompletionRequest` in protocol.py, vLLM 0.32). Each conversation is its own
engine request, checked as a chat request is; they run concurrently, and the answer has
choice i for conversation i and the summed usage. A client that disconnects aborts them."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import orjson
from aiohttp import web

from sluice.sim import fields
from sluice.sim.engine import FINISH_ABORT
from sluice.sim.openai_api import CHAT, ApiError, ResponseFormatter, new_id, parse_request
from sluice.sim.serving import (
    engine_id,
    error_response,
    header_request_id,
    json_response,
    read_json,
    run_to_end,
)

if TYPE_CHECKING:
    from sluice.sim.server import SimServer


class BatchRoutes:
    def __init__(self, server: SimServer) -> None:
        self.server = server

    def register(self, app: web.Application) -> None:
        app.router.add_post("/v1/chat/completions/batch", self.batch)

    async def batch(self, request: web.Request) -> web.Response:
        server = self.server
        try:
            body = await read_json(request)
            conversations = _conversations(body)
            model = server.models_registry.resolve(body.get("model"))
            single = {k: v for k, v in body.items() if k not in ("messages", "stream", "model")}
            requests = [
                parse_request(
                    CHAT,
                    orjson.dumps({**single, "messages": conv}),
                    served_model="",
                    max_model_len=server.profile.max_model_len,
                )
                for conv in conversations
            ]
        except ApiError as err:
            return error_response(err)
        given = header_request_id(request) or body.get("request_id")
        request_id = (
            f"chatcmpl-{given}" if isinstance(given, str) and given else new_id("chatcmpl-")
        )
        formatters = [
            ResponseFormatter(CHAT, f"{request_id}_{i}", model, g.prompt_tokens, g.sample_key)
            for i, g in enumerate(requests)
        ]
        engine_reqs = [
            server.engine.make_request(
                engine_id(request_id),
                g.prompt_tokens,
                g.max_tokens,
                ignore_eos=g.ignore_eos,
                min_tokens=g.min_tokens,
                sample_key=g.sample_key,
            )
            for g in requests
        ]
        handles = await run_to_end(server.driver, engine_reqs)
        if any(h.finish_reason == FINISH_ABORT for h in handles):
            return error_response(ApiError(500, "request aborted", "InternalServerError"))
        choices: list[dict[str, Any]] = []
        prompt = completion = 0
        created = formatters[0].created
        for i, (fmt, handle) in enumerate(zip(formatters, handles, strict=True)):
            one = orjson.loads(fmt.full_response(handle.generated, handle.finish_reason or "stop"))
            choice = one["choices"][0]
            choice["index"] = i
            choices.append(choice)
            prompt += one["usage"]["prompt_tokens"]
            completion += one["usage"]["completion_tokens"]
        return json_response(
            {
                "id": request_id,
                "object": "chat.completion",
                "created": created,
                "model": model,
                "choices": choices,
                "usage": {
                    "prompt_tokens": prompt,
                    "total_tokens": prompt + completion,
                    "completion_tokens": completion,
                },
                "prompt_logprobs": None,
            }
        )


def _conversations(body: dict[str, Any]) -> list[list[Any]]:
    if body.get("use_beam_search"):
        raise fields.invalid_value(
            "use_beam_search",
            "Batch chat completions do not support beam search. Please set `use_beam_search` "
            "to False.",
        )
    n = body.get("n", 1)
    if n is not None and n != 1:
        raise fields.invalid_value(
            "n", "Batch chat completions do not support `n > 1`. Please set `n` to 1."
        )
    conversations = fields.required(body, "messages")
    if not isinstance(conversations, list) or not conversations:
        raise fields.invalid(
            "messages", "List should have at least 1 item after validation", "too_short"
        )
    for i, conv in enumerate(conversations):
        if not isinstance(conv, list) or not conv:
            raise fields.invalid(
                f"messages.{i}", "List should have at least 1 item after validation", "too_short"
            )
    return conversations
