"""The simulator's HTTP surface: vLLM's OpenAI-compatible API on top of an Engine.

`create_sim_app(profile, seed=, speed=, model_name=)` returns an aiohttp Application that
owns one engine, its real-time driver (started and stopped with the app) and its own
Prometheus registry, so several can run in one process. Routes: POST /v1/chat/completions,
POST /v1/completions, GET /v1/models, GET /health, GET /version, GET /metrics here, the
rest of vLLM's surface (responses, messages, pooling, tokenize, audio, batch, LoRA) from
`sim.routes`, and what another engine's surface adds or changes (`engine=`:
sluice.sim.surfaces; vLLM's by default).

The application turns on aiohttp's handler cancellation: when a client disconnects, its
handler is cancelled wherever it waits (queued or streaming) and the engine request is
aborted, so its KV blocks are freed at the next engine step."""

from __future__ import annotations

import time
from typing import Any

import orjson
from aiohttp import web

from sluice.sim.driver import EngineDriver, RequestHandle
from sluice.sim.engine import FINISH_ABORT, Engine, EngineRequest
from sluice.sim.model_registry import ModelRegistry
from sluice.sim.openai_api import (
    CHAT,
    COMPLETION,
    DONE_CHUNK,
    ApiError,
    GenerationRequest,
    ResponseFormatter,
    error_body,
    new_request_id,
    parse_request,
    stream_error_chunk,
)
from sluice.sim.profiles import Profile
from sluice.sim.routes import add_routes
from sluice.sim.routes_lora import runtime_updates_by_env
from sluice.sim.routes_responses import store_enabled_by_env
from sluice.sim.surfaces import DEFAULT_SURFACE, Surface, get_surface

DEFAULT_MODEL_NAME = "sluice-sim"
SIM_VERSION = "sluice-sim"
_MAX_BODY = 64 * 1024 * 1024
_SSE_HEADERS = {
    "Content-Type": "text/event-stream; charset=utf-8",
    "Cache-Control": "no-cache",
}


class SimServer:
    """The state behind one simulator app: engine, driver, metrics, served model."""

    def __init__(
        self,
        profile: Profile,
        *,
        seed: int,
        model_name: str,
        lora_modules: dict[str, str] | None = None,
        allow_lora_updating: bool = False,
        surface: Surface | None = None,
    ) -> None:
        self.surface = surface or get_surface(DEFAULT_SURFACE)
        self.profile = profile
        self.model_name = model_name
        self.models_registry = ModelRegistry(model_name, allow_runtime_updates=allow_lora_updating)
        for name, path in (lora_modules or {}).items():
            self.models_registry.load(name, path)
        self.engine = Engine(profile, seed=seed)
        self.metrics = self.surface.metrics(self.engine, model_name, self.engine.snapshot)
        engine, observe = self.engine, self.metrics.observe_step
        self.driver = EngineDriver(engine, on_step=lambda r: observe(r, engine.snapshot()))
        self.created = int(time.time())
        self.in_flight = 0  # generation requests being served

    # -- lifecycle ------------------------------------------------------------------

    async def on_startup(self, app: web.Application) -> None:
        self.driver.start()

    async def on_cleanup(self, app: web.Application) -> None:
        await self.driver.stop()

    # -- generation -----------------------------------------------------------------

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(CHAT, request)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(COMPLETION, request)

    async def _generate(self, kind: str, request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        try:
            g = parse_request(
                kind,
                raw,
                served_model=self.model_name,
                max_model_len=self.profile.max_model_len,
                adapters=self.models_registry.adapters,
            )
        except ApiError as err:
            return _json(err.body(), err.status)
        refused = self.surface.refusal(self.in_flight)
        if refused is not None:
            return _json(refused[1], refused[0])
        self.in_flight += 1
        try:
            return await self._generate_admitted(kind, request, g)
        finally:
            self.in_flight -= 1

    async def _generate_admitted(
        self, kind: str, request: web.Request, g: GenerationRequest
    ) -> web.StreamResponse:
        request_id = new_request_id(kind)
        fmt = ResponseFormatter(kind, request_id, g.model, g.prompt_tokens, sample_key=g.sample_key)
        engine_req = self.engine.make_request(
            request_id,
            g.prompt_tokens,
            g.max_tokens,
            ignore_eos=g.ignore_eos,
            min_tokens=g.min_tokens,
            sample_key=g.sample_key,
        )
        if not g.stream:
            return await self._answer_whole(request_id, engine_req, fmt)
        render = fmt.token_chunk_with_usage if g.continuous_usage else fmt.token_chunk
        handle = RequestHandle(render)
        response = web.StreamResponse(headers=_SSE_HEADERS)
        self.driver.submit(engine_req, handle)
        completed = False
        try:
            await response.prepare(request)
            data = await _next(handle)
            data = fmt.role_chunk() + data
            while True:
                if handle.done:
                    if handle.finish_reason == FINISH_ABORT:
                        data += stream_error_chunk("request aborted", "InternalServerError", 500)
                    elif g.include_usage:
                        data += fmt.usage_chunk(handle.generated)
                    completed = True
                    await response.write(data + DONE_CHUNK)
                    break
                await response.write(data)
                data = await _next(handle)
        except ConnectionError:
            return response  # the client went away mid-stream; aborted below
        finally:
            if not completed:
                self.driver.abort(request_id)
        return response

    async def _answer_whole(
        self, request_id: str, engine_req: EngineRequest, fmt: ResponseFormatter
    ) -> web.Response:
        handle = RequestHandle(None)
        self.driver.submit(engine_req, handle)
        try:
            while not handle.done:
                await handle.wait()
        finally:
            if not handle.done:
                self.driver.abort(request_id)
        if handle.finish_reason == FINISH_ABORT:
            return _json(error_body(500, "request aborted", "InternalServerError"), 500)
        body = fmt.full_response(handle.generated, handle.finish_reason or "stop")
        return _json(body, 200)

    # -- the rest -------------------------------------------------------------------

    async def models(self, request: web.Request) -> web.Response:
        if self.surface.name != DEFAULT_SURFACE:
            card = self.surface.model_card(self.model_name, self.profile, self.created)
            return _json(orjson.dumps({"object": "list", "data": [card]}), 200)
        card = {
            "id": self.model_name,
            "object": "model",
            "created": self.created,
            "owned_by": "vllm",
            "root": self.model_name,
            "parent": None,
            "max_model_len": self.profile.max_model_len,
            "permission": [],
        }
        cards = [card, *self.models_registry.adapter_cards()]
        return _json(orjson.dumps({"object": "list", "data": cards}), 200)

    async def health(self, request: web.Request) -> web.Response:
        status, body, content_type = self.surface.health()
        return web.Response(status=status, body=body, content_type=content_type)

    async def version(self, request: web.Request) -> web.Response:
        return _json(orjson.dumps({"version": SIM_VERSION}), 200)

    async def metrics_endpoint(self, request: web.Request) -> web.Response:
        body, content_type = self.metrics.render(request.path)
        response = web.Response(body=body)
        response.headers["Content-Type"] = content_type
        return response


async def _next(handle: RequestHandle) -> bytes:
    await handle.wait()
    return handle.take()


def _json(body: bytes, status: int) -> web.Response:
    return web.Response(body=body, status=status, content_type="application/json")


@web.middleware
async def _json_errors(request: web.Request, handler: Any) -> web.StreamResponse:
    """Unknown routes and wrong methods answer in OpenAI's error shape too."""
    try:
        return await handler(request)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        err_type = "NotFoundError" if exc.status == 404 else "BadRequestError"
        return _json(error_body(exc.status, exc.reason, err_type), exc.status)


SIM_SERVER_KEY = web.AppKey("sluice_sim_server", SimServer)


def create_sim_app(
    profile: Profile,
    *,
    seed: int = 0,
    speed: float = 1.0,
    model_name: str = DEFAULT_MODEL_NAME,
    responses_store: bool | None = None,
    lora_modules: dict[str, str] | None = None,
    allow_lora_updating: bool | None = None,
    engine: str = DEFAULT_SURFACE,
) -> web.Application:
    """A simulator application; `app[SIM_SERVER_KEY]` gives access to its engine.

    `responses_store` and `allow_lora_updating` default to vLLM's environment variables
    (VLLM_ENABLE_RESPONSES_API_STORE, VLLM_ALLOW_RUNTIME_LORA_UPDATING); `lora_modules`
    maps adapter names to paths, loaded at start like vLLM's --lora-modules. `engine`
    names the surface it presents (ValueError if unknown)."""
    if responses_store is None:
        responses_store = store_enabled_by_env()
    if allow_lora_updating is None:
        allow_lora_updating = runtime_updates_by_env()
    surface = get_surface(engine)
    server = SimServer(
        surface.profile(profile.scaled(speed)),
        seed=seed,
        model_name=model_name,
        lora_modules=lora_modules,
        allow_lora_updating=allow_lora_updating,
        surface=surface,
    )
    app = web.Application(
        middlewares=[_json_errors],
        client_max_size=_MAX_BODY,
        # cancel a handler when its client disconnects, so that its request is aborted
        handler_args={"handler_cancellation": True},
    )
    app[SIM_SERVER_KEY] = server
    app.on_startup.append(server.on_startup)
    app.on_cleanup.append(server.on_cleanup)
    app.router.add_post("/v1/chat/completions", server.chat_completions)
    app.router.add_post("/v1/completions", server.completions)
    app.router.add_get("/v1/models", server.models)
    app.router.add_get("/health", server.health)
    app.router.add_get("/version", server.version)
    for path in surface.metric_paths:
        app.router.add_get(path, server.metrics_endpoint)
    for path, value in surface.static(model_name, server.profile).items():
        app.router.add_get(path, _static(orjson.dumps(value)))
    add_routes(app, server, responses_store=responses_store)
    return app


def _static(body: bytes) -> Any:
    async def handler(_request: web.Request) -> web.Response:
        return _json(body, 200)

    return handler
