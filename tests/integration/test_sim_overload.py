"""A real `sluice sim --profile tiny` under overload: queueing, a full KV cache, preemption,
and aborts when clients disconnect."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import aiohttp
import pytest
from tests.integration.conftest import SimFactory, SimProcess

from sluice.bench.prom_text import parse_metrics

pytestmark = pytest.mark.integration

RUNNING = "vllm:num_requests_running"
WAITING = "vllm:num_requests_waiting"
KV = "vllm:kv_cache_usage_perc"
PREEMPTIONS = "vllm:num_preemptions_total"
ABORTED = 'vllm:request_success_total{finished_reason="abort"}'


async def scrape(session: aiohttp.ClientSession, sim: SimProcess) -> dict[str, float]:
    async with session.get(sim.url + "/metrics") as response:
        return parse_metrics(await response.text())


async def wait_for(
    session: aiohttp.ClientSession,
    sim: SimProcess,
    condition: Callable[[dict[str, float]], bool],
    within: float,
) -> dict[str, float]:
    """Scrape until `condition(metrics)` holds; fail after `within` seconds."""
    deadline = time.monotonic() + within
    while True:
        m = await scrape(session, sim)
        if condition(m):
            return m
        assert time.monotonic() < deadline, f"metrics never got there: {m}"
        await asyncio.sleep(0.005)


async def stream_to_end(session: aiohttp.ClientSession, sim: SimProcess, body: Any) -> int:
    """Stream a chat completion to [DONE]; return the number of content chunks."""
    chunks = 0
    async with session.post(sim.url + "/v1/chat/completions", json=body) as response:
        assert response.status == 200
        async for line in response.content:
            if line.startswith(b"data: {") and b'"content":"' in line and b'"role"' not in line:
                chunks += 1
            if line.startswith(b"data: [DONE]"):
                break
    return chunks


async def test_a_flood_of_long_streams_fills_the_kv_cache_and_preempts(
    sim_factory: SimFactory,
) -> None:
    sim = sim_factory("--profile", "tiny", "--speed", "4")
    # 30 requests of ~210 prompt tokens growing by 250: 30 x 29 blocks at the end, against
    # 256 blocks, so the queue builds up, the cache fills and decoding has to preempt
    body = {
        "messages": [{"role": "user", "content": "p" * 800}],
        "max_tokens": 250,
        "ignore_eos": True,
        "stream": True,
    }
    peak = {WAITING: 0.0, KV: 0.0}
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=100)) as session:
        flood = [asyncio.create_task(stream_to_end(session, sim, body)) for _ in range(30)]
        while not all(t.done() for t in flood):
            m = await scrape(session, sim)
            peak = {k: max(v, m[k]) for k, v in peak.items()}
            await asyncio.sleep(0.02)
        assert [t.result() for t in flood] == [250] * 30  # preempted streams still complete
        final = await scrape(session, sim)
    print(f"peaks {peak}, preemptions {final[PREEMPTIONS]:g}")
    assert peak[WAITING] > 0
    assert peak[KV] >= 0.9
    assert final[PREEMPTIONS] > 0
    assert (final[RUNNING], final[WAITING], final[KV]) == (0.0, 0.0, 0.0)
    assert final["vllm:generation_tokens_total"] >= 30 * 250


async def _until_first_token(response: aiohttp.ClientResponse) -> None:
    async for line in response.content:
        if b'"content":"' in line and b'"role"' not in line:
            return
    raise AssertionError("the stream ended before its first token")


async def test_clients_that_disconnect_are_aborted_and_free_their_blocks(
    sim_factory: SimFactory,
) -> None:
    sim = sim_factory("--profile", "tiny", "--kv-blocks", "2048")
    body = {
        "messages": [{"role": "user", "content": "q" * 200}],
        "max_tokens": 1500,
        "ignore_eos": True,
        "stream": True,
    }
    async with aiohttp.ClientSession() as control:
        # each client on its own connection, so that closing it is a real disconnect
        clients = [aiohttp.ClientSession() for _ in range(20)]
        try:
            responses = await asyncio.gather(
                *(c.post(sim.url + "/v1/chat/completions", json=body) for c in clients)
            )
            await asyncio.gather(*(_until_first_token(r) for r in responses))
            before = await scrape(control, sim)
            assert before[RUNNING] == 20
            assert before[KV] > 0
            for response in responses:
                response.close()
            closed_at = time.monotonic()
            after = before
            while time.monotonic() - closed_at < 0.1:
                after = await scrape(control, sim)
                if after[RUNNING] == before[RUNNING] - 20:
                    break
            elapsed = time.monotonic() - closed_at
        finally:
            await asyncio.gather(*(c.close() for c in clients))
        print(f"running 20 -> {after[RUNNING]:g} in {elapsed * 1000:.1f} ms")
        assert after[RUNNING] == before[RUNNING] - 20, f"still running after {elapsed:.3f} s"
        assert elapsed < 0.1
        assert after[KV] < before[KV]
        assert after[KV] == 0.0
        success = (
            'vllm:request_success_total{{engine="0",finished_reason="{}",model_name="sluice-sim"}}'
        )
        assert after[success.format("abort")] == 20


async def test_a_client_that_leaves_while_queued_is_aborted(sim_factory: SimFactory) -> None:
    # one request at a time: the second waits in the queue, then its client leaves
    sim = sim_factory("--profile", "tiny", "--max-num-seqs", "1")
    long = {"messages": [{"role": "user", "content": "a"}], "max_tokens": 1000, "ignore_eos": True}
    async with aiohttp.ClientSession() as control, aiohttp.ClientSession() as leaver:
        first = asyncio.create_task(control.post(sim.url + "/v1/chat/completions", json=long))
        await wait_for(control, sim, lambda m: m[RUNNING] == 1, within=5)
        queued = asyncio.create_task(leaver.post(sim.url + "/v1/chat/completions", json=long))
        await wait_for(control, sim, lambda m: m[WAITING] == 1, within=5)
        queued.cancel()
        await leaver.close()  # drop the connection of the queued request
        m = await wait_for(control, sim, lambda m: m[WAITING] == 0, within=1)
        assert m[RUNNING] == 1
        assert m[ABORTED] == 1
        first.cancel()
