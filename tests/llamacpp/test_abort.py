"""Abort on client disconnect, on a real llama-server: 20 streaming clients through Sluice
that close after their first token free their llama.cpp slots at once (measured from
llama.cpp's own /slots), where each answer would otherwise hold its slot for seconds."""

from __future__ import annotations

import asyncio
import time

import aiohttp
import pytest
from conftest import LlamaServer, wait_idle
from gateway_proc import start_gateway

from sluice.bench.procfs import CpuSampler

pytestmark = pytest.mark.integration

CLIENTS = 20
MAX_TOKENS = 800  # seconds of decoding per request if nobody aborted it
FREED_WITHIN_S = 0.100


async def _first_token_then_close(session: aiohttp.ClientSession, url: str, model: str) -> float:
    """Stream one chat answer, close the connection after its first token; the time of the
    close."""
    body = {
        "model": model,
        "messages": [{"role": "user", "content": "say the words you know"}],
        "max_tokens": MAX_TOKENS,
        "stream": True,
        "ignore_eos": True,
    }
    headers = {"Authorization": "Bearer sk-demo-p0"}
    async with session.post(url + "/v1/chat/completions", json=body, headers=headers) as r:
        assert r.status == 200, await r.text()
        async for line in r.content:
            if (
                line.startswith(b"data: ")
                and b'"content":"' in line
                and b'"content":""' not in line
            ):
                break
        r.close()  # the client goes away mid-answer
    return time.monotonic()


async def _busy_slots(session: aiohttp.ClientSession, url: str) -> int:
    async with session.get(url + "/slots") as r:
        return sum(bool(s.get("is_processing")) for s in await r.json())


async def test_clients_that_close_after_their_first_token_free_their_slots(
    llama: LlamaServer,
) -> None:
    wait_idle(llama)
    predicted_before = llama.metrics()["llamacpp:tokens_predicted_total"]
    gw = start_gateway([llama.url])
    cpu = CpuSampler()
    try:
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
            closes = await asyncio.gather(
                *(_first_token_then_close(session, gw.url, llama.model) for _ in range(CLIENTS))
            )
            last_close = max(closes)
            async with aiohttp.ClientSession() as probe:
                while (busy := await _busy_slots(probe, llama.url)) > 0:
                    assert time.monotonic() - last_close < 10, f"{busy} slots still busy"
                    await asyncio.sleep(0.002)
                freed_after = time.monotonic() - last_close
                m = llama.metrics()
    finally:
        gw.stop()
        cpu.sample()
    busy_cpu = cpu.samples[-1] if cpu.samples else None
    print(
        f"\n{CLIENTS} clients closed after their first token: every llama.cpp slot free "
        f"{freed_after * 1000:.0f} ms after the last close (CPU busy {busy_cpu:.0%} over the test)"
    )
    assert m["llamacpp:requests_deferred"] == 0
    assert m["llamacpp:requests_processing"] == 0
    assert freed_after <= FREED_WITHIN_S, (
        f"slots freed {freed_after * 1000:.0f} ms after the last client left "
        f"(want <= {FREED_WITHIN_S * 1000:.0f} ms; CPU busy {busy_cpu:.0%})"
    )
    # llama.cpp generated a few tokens per request, not MAX_TOKENS
    predicted = m["llamacpp:tokens_predicted_total"] - predicted_before
    assert predicted < CLIENTS * MAX_TOKENS / 4, predicted
