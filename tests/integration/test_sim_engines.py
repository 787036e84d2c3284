"""`sluice sim --engine NAME`, in process: each engine's routes, health and models
answers, its metrics read back by the gateway's adapter for that engine, and the refusal
behaviour where it differs (llama.cpp defers beyond its slots, TGI answers 429)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

import aiohttp
import pytest
from aiohttp import web

from sluice.gateway.engines import adapter, detect_from_metrics, detect_from_models
from sluice.sim.profiles import PROFILES
from sluice.sim.server import create_sim_app

pytestmark = pytest.mark.integration

Start = Callable[..., "asyncio.Future[str]"]


@pytest.fixture
async def start() -> AsyncIterator[Callable[..., object]]:
    runners: list[web.AppRunner] = []

    async def run(engine: str, **kwargs: object) -> str:
        profile = kwargs.pop("profile", PROFILES["tiny"])
        app = create_sim_app(profile, engine=engine, speed=4.0, **kwargs)  # type: ignore[arg-type]
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        runners.append(runner)
        return f"http://127.0.0.1:{runner.addresses[0][1]}"

    yield run
    for runner in runners:
        await runner.cleanup()


async def _read(session: aiohttp.ClientSession, url: str) -> tuple[str | None, object]:
    """What the gateway does: detect the engine, then read it with its adapter."""
    async with session.get(url + "/metrics") as r:
        engine = detect_from_metrics(r.status, await r.text())
    if engine is None:
        async with session.get(url + "/v1/models") as r:
            engine = detect_from_models(await r.json())
    assert engine is not None
    a = adapter(engine)
    pages = {}
    for route in a.routes:
        async with session.get(url + route.path) as r:
            if r.status == 200:
                pages[route.path] = await r.text()
    return engine, a.read(pages, 0.0)


EXPECTED_MISSING = {
    "vllm": set(),
    "sglang": set(),
    "trtllm": set(),
    "llamacpp": {"preemptions", "ttft_p95", "tpot_p95"},
    "tgi": {"preemptions", "ttft_p95"},
}
OWNED_BY = {"vllm": "vllm", "sglang": "sglang", "trtllm": "tensorrt_llm", "llamacpp": "llamacpp"}


@pytest.mark.parametrize("engine", list(EXPECTED_MISSING))
async def test_each_surface_is_detected_and_read_by_its_adapter(start, engine: str) -> None:
    url = await start(engine, model_name="m")
    body = {"model": "m", "prompt": "hello " * 30, "max_tokens": 8, "ignore_eos": True}
    async with aiohttp.ClientSession() as session:
        async with session.post(url + "/v1/completions", json=body) as r:
            assert r.status == 200
            assert (await r.json())["usage"]["completion_tokens"] == 8
        async with session.get(url + "/health") as r:
            assert r.status == 200
            if engine == "llamacpp":
                assert await r.json() == {"status": "ok"}
        async with session.get(url + "/v1/models") as r:
            card = (await r.json())["data"][0]
        assert card["id"] == "m" and card["owned_by"] == OWNED_BY.get(engine, "m")
        detected, m = await _read(session, url)
    assert detected == engine
    assert m.engine == engine  # type: ignore[attr-defined]
    from sluice.core.types import SIGNALS

    assert set(SIGNALS) - set(m.signals) == EXPECTED_MISSING[engine]  # type: ignore[attr-defined]
    assert m.running == 0.0 and m.kv_capacity == PROFILES["tiny"].kv_capacity_tokens  # type: ignore[attr-defined]


async def test_llamacpp_defers_requests_beyond_its_slots(start) -> None:
    url = await start("llamacpp", model_name="m")  # tiny: 4096 tokens, 2 slots of 2048
    body = {"model": "m", "prompt": "x " * 50, "max_tokens": 1800, "ignore_eos": True}
    async with aiohttp.ClientSession() as session:
        posts = [
            asyncio.create_task(session.post(url + "/v1/completions", json=body)) for _ in range(5)
        ]
        try:
            for _ in range(200):  # until all five arrived (each step is ~1 ms)
                engine, m = await _read(session, url)
                if (m.running or 0) + (m.waiting or 0) == 5:  # type: ignore[attr-defined]
                    break
                await asyncio.sleep(0.01)
            async with session.get(url + "/slots") as r:
                slots = await r.json()
            async with session.get(url + "/props") as r:
                assert (await r.json())["total_slots"] == 2
        finally:
            for p in posts:
                p.cancel()
    assert engine == "llamacpp"
    assert (m.running, m.waiting) == (2.0, 3.0)  # type: ignore[attr-defined]
    assert [s["is_processing"] for s in slots] == [True, True]
    assert all(s["n_ctx"] == 2048 for s in slots)


async def test_tgi_answers_429_once_its_router_is_full(start) -> None:
    url = await start("tgi", model_name="m")
    body = {"model": "m", "prompt": "x", "max_tokens": 2000, "ignore_eos": True, "stream": True}
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        streams = [await session.post(url + "/v1/completions", json=body) for _ in range(128)]
        try:
            assert {s.status for s in streams} == {200}
            async with session.post(url + "/v1/completions", json=body) as r:
                assert r.status == 429
                assert await r.json() == {
                    "error": "Model is overloaded",
                    "error_type": "overloaded",
                }
            async with session.get(url + "/info") as r:
                assert (await r.json())["max_concurrent_requests"] == 128
        finally:
            for s in streams:
                s.close()


async def test_trtllm_metrics_drain_the_iterations_since_the_last_call(start) -> None:
    url = await start("trtllm", model_name="m")
    body = {"model": "m", "prompt": "x " * 10, "max_tokens": 4, "ignore_eos": True}
    async with aiohttp.ClientSession() as session:
        async with session.post(url + "/v1/completions", json=body) as r:
            assert r.status == 200
        async with session.get(url + "/metrics") as r:
            first = await r.json()
        async with session.get(url + "/metrics") as r:
            second = await r.json()
    assert len(first) >= 4 and first[-1]["kvCacheStats"]["maxNumBlocks"] == 256
    assert second == []  # idle since: nothing new
