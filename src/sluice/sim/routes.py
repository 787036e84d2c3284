"""The simulator's routes besides chat, completions, models, health, version and metrics
(those are in `sim.server`): each family in its own module."""

from __future__ import annotations

from typing import TYPE_CHECKING

from aiohttp import web

from sluice.sim.routes_audio import AudioRoutes
from sluice.sim.routes_batch import BatchRoutes
from sluice.sim.routes_lora import LoraRoutes
from sluice.sim.routes_messages import MessagesRoutes
from sluice.sim.routes_pooling import PoolingRoutes
from sluice.sim.routes_responses import ResponsesRoutes
from sluice.sim.routes_tokenize import TokenizeRoutes

if TYPE_CHECKING:
    from sluice.sim.server import SimServer


def add_routes(app: web.Application, server: SimServer, *, responses_store: bool) -> None:
    ResponsesRoutes(server, store_enabled=responses_store).register(app)
    MessagesRoutes(server).register(app)
    PoolingRoutes(server).register(app)
    TokenizeRoutes(server).register(app)
    AudioRoutes(server).register(app)
    BatchRoutes(server).register(app)
    LoraRoutes(server).register(app)
