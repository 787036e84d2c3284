"""The peer arms as real proxies (`python -m sluice.bench.peers.proxy`, issue 16), in front
of a real `sluice sim`, seen by the `openai` SDK as their users' clients see the peers:
LiteLLM's 429 with Retry-After 60 over its cap, Envoy's 503 over its limit, streams relayed
whole, and the proxy's /metrics under the names the bench samples."""

from __future__ import annotations

import asyncio
import re
import subprocess
import sys
import threading
from collections.abc import Iterator

import httpx
import openai
import pytest
from tests.integration.conftest import SimProcess

from sluice.bench.prom_text import parse_metrics

pytestmark = pytest.mark.integration

_PORT = re.compile(r"http://127\.0\.0\.1:(\d+)")


def _start_proxy(*args: str) -> tuple[subprocess.Popen[str], str]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "sluice.bench.peers.proxy", "--port", "0", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    found: list[str] = []
    ready = threading.Event()

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            found.append(line)
            if _PORT.search(line):
                ready.set()

    threading.Thread(target=read, daemon=True).start()
    if not ready.wait(20):
        proc.kill()
        raise RuntimeError("the peer proxy did not start: " + "".join(found))
    m = _PORT.search(next(x for x in found if _PORT.search(x)))
    assert m is not None
    return proc, f"http://127.0.0.1:{m.group(1)}"


@pytest.fixture
def proxy_factory() -> Iterator:  # type: ignore[type-arg]
    procs: list[subprocess.Popen[str]] = []

    def start(*args: str) -> str:
        proc, url = _start_proxy(*args)
        procs.append(proc)
        return url

    yield start
    for p in procs:
        p.terminate()
        try:
            p.wait(10)
        except subprocess.TimeoutExpired:
            p.kill()


def _client(url: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=30)


async def _stream(
    client: openai.AsyncOpenAI, tokens: int, started: asyncio.Event | None = None
) -> int:
    stream = await client.completions.create(
        model="sluice-sim",
        prompt="hello " * 50,
        max_tokens=tokens,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    n = 0
    async for chunk in stream:
        n += sum(1 for c in chunk.choices if c.text)
        if started is not None:
            started.set()
    return n


async def _metrics(url: str) -> dict[str, float]:
    async with httpx.AsyncClient() as http:
        return parse_metrics((await http.get(f"{url}/metrics")).text)


async def test_litellm_proxy_refuses_over_its_cap_with_retry_after_60(
    sim: SimProcess, proxy_factory
) -> None:  # type: ignore[no-untyped-def]
    url = proxy_factory("--arm", "litellm", "--cap", "1", "--backend", sim.url)
    client = _client(url)
    started = asyncio.Event()
    first = asyncio.create_task(_stream(client, 200, started))
    await started.wait()  # it streams: it holds the one slot
    with pytest.raises(openai.RateLimitError) as err:
        await _stream(client, 5)
    assert err.value.response.headers["retry-after"] == "60"
    assert err.value.body["code"] == "max_parallel_requests"  # type: ignore[index]
    assert await first == 200  # the stream relayed whole
    m = await _metrics(url)
    assert m['sluice_backend_limit{backend="b0"}'] == 1.0
    assert m['sluice_backend_inflight{backend="b0"}'] == 0.0
    await client.close()


async def test_envoy_proxy_answers_503_without_retry_after_over_its_limit(
    sim: SimProcess, proxy_factory
) -> None:  # type: ignore[no-untyped-def]
    url = proxy_factory("--arm", "envoy", "--backend", sim.url)
    client = _client(url)
    # the filter starts measuring its minRTT with the limit pinned at 3
    started = [asyncio.Event() for _ in range(3)]
    held = [asyncio.create_task(_stream(client, 300, e)) for e in started]
    for e in started:
        await e.wait()
    with pytest.raises(openai.InternalServerError) as err:
        await _stream(client, 5)
    assert err.value.status_code == 503
    assert "retry-after" not in err.value.response.headers
    assert await asyncio.gather(*held) == [300, 300, 300]
    await client.close()
