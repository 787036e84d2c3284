"""Real mode's time series stay one value per sample time when a scrape of the gateway
fails (a starved gateway misses the bench's 2 s timeout: the sample repeats the gateway's
last answer) and when the run ends during a sample (the monitor is cancelled while it
waits for the gateway: nothing of that sample is kept). Either once left a column one
short, and `sluice bench --mode real` died plotting it."""

from __future__ import annotations

import asyncio

import aiohttp
from aiohttp import web
from aiohttp.test_utils import TestServer

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


async def test_every_column_keeps_one_value_per_sample_through_failures_and_the_end() -> None:
    calls = {"n": 0}
    state_asked = asyncio.Event()
    hold = asyncio.Event()

    async def sim(_: web.Request) -> web.Response:
        return web.Response(text=SIM_METRICS)

    async def gateway(_: web.Request) -> web.Response:
        calls["n"] += 1
        if calls["n"] == 2:
            return web.Response(status=503)
        return web.Response(text=GATEWAY_METRICS)

    async def admin_state(_: web.Request) -> web.Response:
        if calls["n"] == 4:  # the fourth sample: the run ends while it waits
            state_asked.set()
            await hold.wait()
        return web.Response(status=404)

    app = web.Application()
    app.router.add_get("/sim/metrics", sim)
    app.router.add_get("/gw/metrics", gateway)
    app.router.add_get("/gw/admin/state", admin_state)
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    base = str(server.make_url("")).rstrip("/")
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
            cut = asyncio.create_task(arm_runner._sample())
            await asyncio.wait_for(state_asked.wait(), 10)
            cut.cancel()
            await asyncio.gather(cut, return_exceptions=True)
    finally:
        hold.set()
        await server.close()
    s = arm_runner.series
    assert calls["n"] == 4
    assert len(s["t"]) == 3
    assert s["limit"] == [[7.0, 7.0, 7.0]]
    assert s["inflight"] == [[4, 4, 4]]
    assert s["pressure"] == [0.25, 0.25, 0.25]
    assert s["queued"]["P0"] == [2, 2, 2]
    assert s["running"] == [[3, 3, 3]]
