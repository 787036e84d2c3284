"""Real mode's time series stay one value per sample time when a scrape of the gateway
fails (a starved gateway misses the bench's 2 s timeout): the sample repeats the gateway's
last answer, so the plots and results.json keep aligned columns (a failed scrape once
left the limit column one short and `sluice bench --mode real` died plotting it)."""

from __future__ import annotations

import aiohttp
from aiohttp import web

from sluice.bench.arms import sluice_policy
from sluice.bench.harness import ArmSpec
from sluice.bench.real import _ArmRunner
from sluice.bench.scenario import load_scenario

SIM_METRICS = """vllm:num_requests_running{model_name="m"} 3
vllm:num_requests_waiting{model_name="m"} 1
vllm:kv_cache_usage_perc{model_name="m"} 0.5
vllm:num_preemptions_total{model_name="m"} 0
"""
GATEWAY_METRICS = """sluice_backend_limit{backend="b0"} 7
sluice_backend_inflight{backend="b0"} 4
sluice_queue_depth{priority="0"} 2
sluice_pressure 0.25
"""


async def test_a_failed_gateway_scrape_repeats_its_last_answer() -> None:
    calls = {"n": 0}

    async def sim(_: web.Request) -> web.Response:
        return web.Response(text=SIM_METRICS)

    async def gateway(_: web.Request) -> web.Response:
        calls["n"] += 1
        if calls["n"] == 2:
            return web.Response(status=503)
        return web.Response(text=GATEWAY_METRICS)

    app = web.Application()
    app.router.add_get("/sim/metrics", sim)
    app.router.add_get("/gw/metrics", gateway)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    base = f"http://127.0.0.1:{port}"
    try:
        scenario = load_scenario("flood").for_real_mode()
        arm = ArmSpec("sluice", sluice_policy(scenario, 16))
        arm_runner = _ArmRunner(
            scenario, arm, [], [f"{base}/sim"], f"{base}/gw", "m", 1, 1.0, {}, None
        )
        async with aiohttp.ClientSession() as session:
            arm_runner.session = session
            for _ in range(3):
                await arm_runner._sample()
    finally:
        await runner.cleanup()
    s = arm_runner.series
    assert calls["n"] == 3
    assert len(s["t"]) == 3
    assert s["limit"] == [[7.0, 7.0, 7.0]]
    assert s["inflight"] == [[4, 4, 4]]
    assert s["pressure"] == [0.25, 0.25, 0.25]
    assert s["queued"]["P0"] == [2, 2, 2]
    assert s["running"] == [[3, 3, 3]]
