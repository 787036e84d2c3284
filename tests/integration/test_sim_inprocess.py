"""Two simulator apps in one process (as the gateway's embedded default runs them): each
has its own engine and its own metrics."""

from __future__ import annotations

from collections.abc import AsyncIterator

import aiohttp
import pytest
from aiohttp import web

from sluice.bench.prom_text import parse_metrics
from sluice.sim.profiles import PROFILES
from sluice.sim.server import SIM_SERVER_KEY, create_sim_app

pytestmark = pytest.mark.integration


@pytest.fixture
async def two_sims() -> AsyncIterator[list[str]]:
    runners = []
    urls = []
    for name in ("sim-a", "sim-b"):
        app = create_sim_app(PROFILES["tiny"], seed=1, speed=2.0, model_name=name)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        runners.append(runner)
        urls.append(f"http://127.0.0.1:{runner.addresses[0][1]}")
    yield urls
    for runner in runners:
        await runner.cleanup()


async def test_two_apps_in_one_process_keep_separate_state(two_sims: list[str]) -> None:
    a, b = two_sims
    body = {"model": "sim-a", "prompt": "x" * 40, "max_tokens": 5, "ignore_eos": True}
    async with aiohttp.ClientSession() as session:
        async with session.post(a + "/v1/completions", json=body) as response:
            assert response.status == 200
            assert (await response.json())["usage"]["completion_tokens"] == 5
        async with session.post(b + "/v1/completions", json=body) as response:
            assert response.status == 404  # b serves sim-b
        async with session.get(a + "/metrics") as response:
            ma = parse_metrics(await response.text())
        async with session.get(b + "/metrics") as response:
            text_b = await response.text()
            mb = parse_metrics(text_b)
    assert ma["vllm:generation_tokens_total"] == 5
    assert mb["vllm:generation_tokens_total"] == 0
    assert 'model_name="sim-b"' in text_b and "sim-a" not in text_b


def test_the_app_exposes_its_engine() -> None:
    app = create_sim_app(PROFILES["tiny"], speed=4.0)
    server = app[SIM_SERVER_KEY]
    assert server.model_name == "sluice-sim"
    assert server.engine.profile.step_overhead_s == PROFILES["tiny"].step_overhead_s / 4
    assert server.engine.num_gpu_blocks == 256
