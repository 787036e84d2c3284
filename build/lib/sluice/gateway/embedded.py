"""The embedded default: with no backend configured, `sluice serve` runs two simulated
vLLM backends in its own process, so that the gateway can be tried with nothing else."""

from __future__ import annotations

import dataclasses
import socket

from aiohttp import web

from sluice.config import Backend
from sluice.sim.profiles import PROFILES
from sluice.sim.server import create_sim_app

EMBEDDED_MODEL = "sluice-sim"


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


class EmbeddedBackends:
    def __init__(
        self,
        count: int = 2,
        profile: str = "h100-llama3-8b",
        speed: float = 1.0,
        host: str = "127.0.0.1",
    ) -> None:
        self.count = count
        self.profile = PROFILES[profile]
        self.profile_name = profile
        self.speed = speed
        self.host = host
        self._runners: list[web.AppRunner] = []
        self.backends: list[Backend] = []

    async def start(self) -> list[Backend]:
        for i in range(self.count):
            app = create_sim_app(
                dataclasses.replace(self.profile),
                seed=i,
                speed=self.speed,
                model_name=EMBEDDED_MODEL,
            )
            runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
            await runner.setup()
            port = _free_port(self.host)
            await web.TCPSite(runner, self.host, port).start()
            self._runners.append(runner)
            self.backends.append(Backend(name=f"sim-{i}", url=f"http://{self.host}:{port}"))
        return self.backends

    async def stop(self) -> None:
        for runner in self._runners:
            await runner.cleanup()
        self._runners.clear()
