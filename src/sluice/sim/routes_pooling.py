"""The pooling routes: `/v1/embeddings`, `/v2/embed`, `/rerank`, `/v1/rerank`,
`/v2/rerank`, `/score` and `/v1/score` (vllm/entrypoints/pooling/embed/api_router.py and
scoring/api_router.py in vLLM 0.32; shapes in `sim.pooling_api`).

Every prompt is one prefill-only engine request (`Engine.make_pooling_request`): it holds
KV blocks for its prompt only and finishes at the end of the step that computes it. An
answer waits for all of its requests; a client that disconnects aborts those not done.
Ids are "embd-..." for embeddings and "score-..." for rerank and score (vLLM's
`request_id_prefix`), from the client's X-Request-Id or the body's `request_id` when given.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from aiohttp import web

from sluice.sim import pooling_api
from sluice.sim.engine import FINISH_ABORT
from sluice.sim.openai_api import ApiError, new_id
from sluice.sim.pooling_api import Prompt
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

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class PoolingRoutes:
    def __init__(self, server: SimServer) -> None:
        self.server = server

    def register(self, app: web.Application) -> None:
        app.router.add_post("/v1/embeddings", self._route(self.embeddings))
        app.router.add_post("/v2/embed", self._route(self.cohere_embed))
        for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
            app.router.add_post(path, self._route(self.rerank))
        for path in ("/score", "/v1/score"):
            app.router.add_post(path, self._route(self.score))

    def _route(
        self, build: Callable[[dict[str, Any], web.Request], Awaitable[dict[str, Any]]]
    ) -> Handler:
        async def handler(request: web.Request) -> web.StreamResponse:
            try:
                body = await read_json(request)
                return json_response(await build(body, request))
            except ApiError as err:
                return error_response(err)

        return handler

    def _request_id(self, prefix: str, body: dict[str, Any], request: web.Request) -> str:
        given = header_request_id(request) or body.get("request_id")
        return f"{prefix}-{given}" if isinstance(given, str) and given else new_id(prefix + "-")

    async def _run(self, request_id: str, prompts: list[Prompt]) -> None:
        engine = self.server.engine
        reqs = [engine.make_pooling_request(engine_id(request_id), p.tokens) for p in prompts]
        handles = await run_to_end(self.server.driver, reqs)
        if any(h.finish_reason == FINISH_ABORT for h in handles):
            raise ApiError(500, "request aborted", "InternalServerError")

    async def embeddings(self, body: dict[str, Any], request: web.Request) -> dict[str, Any]:
        server = self.server
        req = pooling_api.parse_embeddings(
            body, model=server.model_name, max_model_len=server.profile.max_model_len
        )
        model = server.models_registry.resolve(req.model)
        request_id = self._request_id("embd", body, request)
        await self._run(request_id, req.prompts)
        return pooling_api.embeddings_response(req, request_id, model)

    async def cohere_embed(self, body: dict[str, Any], request: web.Request) -> dict[str, Any]:
        server = self.server
        req = pooling_api.parse_cohere(
            body, model=server.model_name, max_model_len=server.profile.max_model_len
        )
        server.models_registry.resolve(req.model)
        request_id = self._request_id("embd", body, request)
        await self._run(request_id, req.prompts)
        return pooling_api.cohere_response(req, request_id)

    async def rerank(self, body: dict[str, Any], request: web.Request) -> dict[str, Any]:
        server = self.server
        req = pooling_api.parse_rerank(body, max_model_len=server.profile.max_model_len)
        model = server.models_registry.resolve(req.model)
        request_id = self._request_id("score", body, request)
        await self._run(request_id, req.prompts)
        return pooling_api.rerank_response(req, request_id, model)

    async def score(self, body: dict[str, Any], request: web.Request) -> dict[str, Any]:
        server = self.server
        req = pooling_api.parse_score(body, max_model_len=server.profile.max_model_len)
        model = server.models_registry.resolve(req.model)
        request_id = self._request_id("score", body, request)
        await self._run(request_id, req.prompts)
        return pooling_api.score_response(req, request_id, model)
