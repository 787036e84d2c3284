"""`POST /v1/load_lora_adapter` and `POST /v1/unload_lora_adapter`, served only when
runtime LoRA updating is allowed, as vLLM 0.32 serves them only with
`VLLM_ALLOW_RUNTIME_LORA_UPDATING` (vllm/entrypoints/serve/lora/api_router.py): 200 with
vLLM's plain-text "Success: ..." body, or its error. The adapters they add are listed by
`GET /v1/models` and accepted as `model` by every route (`sim.model_registry`)."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from aiohttp import web

from sluice.sim import fields
from sluice.sim.openai_api import ApiError
from sluice.sim.serving import error_response, read_json

if TYPE_CHECKING:
    from sluice.sim.server import SimServer

LORA_ENV = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"


def runtime_updates_by_env() -> bool:
    return os.environ.get(LORA_ENV, "").strip().lower() in ("1", "true")


class LoraRoutes:
    def __init__(self, server: SimServer) -> None:
        self.server = server

    def register(self, app: web.Application) -> None:
        if not self.server.models_registry.allow_runtime_updates:
            return  # vLLM does not mount them: a 404 like any unknown route
        app.router.add_post("/v1/load_lora_adapter", self.load)
        app.router.add_post("/v1/unload_lora_adapter", self.unload)

    async def load(self, request: web.Request) -> web.Response:
        try:
            body = await read_json(request)
            name = fields.required(body, "lora_name")
            path = fields.required(body, "lora_path")
            inplace = fields.boolean(body, "load_inplace")
            text = self.server.models_registry.load(name, path, load_inplace=inplace)
        except ApiError as err:
            return error_response(err)
        return web.Response(text=text)

    async def unload(self, request: web.Request) -> web.Response:
        try:
            body = await read_json(request)
            name = fields.required(body, "lora_name")
            text = self.server.models_registry.unload(name)
        except ApiError as err:
            return error_response(err)
        return web.Response(text=text)
