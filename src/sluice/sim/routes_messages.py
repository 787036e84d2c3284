"""`POST /v1/messages` and `POST /v1/messages/count_tokens`, Anthropic's Messages API as
vLLM 0.32 serves it (vllm/entrypoints/anthropic/api_router.py; shapes in
`sim.messages_api`). A message runs on the engine like a chat completion, streaming or
not; a client that disconnects aborts it, and its KV blocks are freed at the next step.
`count_tokens` costs the engine nothing."""

from __future__ import annotations

from typing import TYPE_CHECKING

from aiohttp import web

from sluice.sim import messages_api
from sluice.sim.engine import FINISH_ABORT
from sluice.sim.messages_api import MessageWriter
from sluice.sim.openai_api import ApiError, new_id
from sluice.sim.serving import (
    StreamShape,
    engine_id,
    header_request_id,
    json_response,
    read_json,
    run_to_end,
    stream_generation,
)

if TYPE_CHECKING:
    from sluice.sim.server import SimServer


def _error(err: ApiError) -> web.Response:
    body = messages_api.anthropic_error_body(err)
    return web.Response(body=body, status=err.status, content_type="application/json")


class MessagesRoutes:
    def __init__(self, server: SimServer) -> None:
        self.server = server

    def register(self, app: web.Application) -> None:
        app.router.add_post("/v1/messages", self.create)
        app.router.add_post("/v1/messages/count_tokens", self.count_tokens)

    async def create(self, request: web.Request) -> web.StreamResponse:
        server = self.server
        try:
            body = await read_json(request)
            model, g = messages_api.parse_messages(body, max_model_len=server.profile.max_model_len)
            model = server.models_registry.resolve(model)
        except ApiError as err:
            return _error(err)
        given = header_request_id(request)
        message_id = f"chatcmpl-{given}" if given else new_id("chatcmpl-")
        writer = MessageWriter(message_id, model, g.prompt_tokens, g.sample_key)
        engine_req = server.engine.make_request(
            engine_id(message_id),
            g.prompt_tokens,
            g.max_tokens,
            ignore_eos=g.ignore_eos,
            min_tokens=g.min_tokens,
            sample_key=g.sample_key,
        )
        if g.stream:
            shape = StreamShape(
                render=writer.delta,
                first=writer.first,
                closing=lambda h: writer.closing(h.generated, h.finish_reason),
                aborted=lambda h: writer.error_event("request aborted"),
            )
            return await stream_generation(request, server.driver, engine_req, shape)
        (handle,) = await run_to_end(server.driver, [engine_req])
        if handle.finish_reason == FINISH_ABORT:
            return _error(ApiError(500, "request aborted", "InternalServerError"))
        return json_response(writer.full(handle.generated, handle.finish_reason))

    async def count_tokens(self, request: web.Request) -> web.Response:
        try:
            body = await read_json(request)
            model, count = messages_api.count_tokens(body)
            self.server.models_registry.resolve(model)
        except ApiError as err:
            return _error(err)
        return web.Response(
            body=messages_api.count_tokens_body(count), content_type="application/json"
        )
