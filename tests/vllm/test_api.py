"""Sluice in front of a real vLLM: the OpenAI API through the gateway with the official
SDK, and the gateway reading vLLM's real metrics."""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Iterator

import aiohttp
import openai
import pytest
from conftest import wait_idle
from gateway_proc import GatewayProcess, start_gateway
from loadgen import client_session, completion_body, token_prompt
from vllm_server import VllmServer

from sluice.bench.prom_text import gauge_values, parse_metrics
from sluice.gateway.engines.vllm import VllmAdapter

pytestmark = pytest.mark.integration

MESSAGES = [{"role": "user", "content": "Tell me about rivers and the bridges over them."}]
# Random weights: without ignore_eos an answer may stop at any token.
FULL_LENGTH = {"ignore_eos": True}
_ENGINE = (
    "vllm:kv_cache_usage_perc",
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
)
STREAMS = 24


@pytest.fixture
def gateway(vllm: VllmServer) -> Iterator[GatewayProcess]:
    wait_idle(vllm)
    gw = start_gateway([vllm.url])
    yield gw
    gw.stop()


def test_chat_and_completions_through_sluice(vllm: VllmServer, gateway: GatewayProcess) -> None:
    client = openai.OpenAI(base_url=gateway.url + "/v1", api_key="sk-demo-p0", max_retries=0)

    chat = client.chat.completions.create(
        model=vllm.model,
        messages=MESSAGES,  # type: ignore[arg-type]
        max_tokens=12,
        extra_body=FULL_LENGTH,
    )
    assert chat.model == vllm.model
    assert chat.choices[0].finish_reason == "length"
    assert chat.choices[0].message.content
    assert chat.usage is not None and chat.usage.completion_tokens == 12
    assert chat.usage.prompt_tokens > 10  # the chat template's markers + the message

    stream = client.chat.completions.create(
        model=vllm.model,
        messages=MESSAGES,  # type: ignore[arg-type]
        max_tokens=12,
        stream=True,
        stream_options={"include_usage": True},
        extra_body=FULL_LENGTH,
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 12

    done = client.completions.create(
        model=vllm.model, prompt="def main():", max_tokens=9, extra_body=FULL_LENGTH
    )
    assert done.choices[0].text and done.choices[0].finish_reason == "length"
    assert done.usage is not None and done.usage.completion_tokens == 9

    pieces = list(
        client.completions.create(
            model=vllm.model, prompt="import os", max_tokens=9, stream=True, extra_body=FULL_LENGTH
        )
    )
    assert "".join(p.choices[0].text for p in pieces if p.choices)
    # the gateway asked vLLM for usage (it counts tokens); this client did not: no usage chunk
    assert all(p.usage is None for p in pieces)
    assert [p.choices[0].finish_reason for p in pieces if p.choices][-1] == "length"


def test_vllm_takes_the_gateways_request_id(vllm: VllmServer, gateway: GatewayProcess) -> None:
    """The gateway sends its request id upstream (X-Request-Id); vLLM uses it as its own, so
    vLLM's logs and answer ids name the request the gateway's access log names."""
    client = openai.OpenAI(base_url=gateway.url + "/v1", api_key="sk-demo-p0", max_retries=0)
    raw = client.chat.completions.with_raw_response.create(
        model=vllm.model,
        messages=MESSAGES,
        max_tokens=2,  # type: ignore[arg-type]
    )
    gateway_id = raw.headers["X-Request-Id"]
    assert gateway_id in raw.parse().id, (gateway_id, raw.parse().id)


async def test_async_sdk_concurrent_streams(vllm: VllmServer, gateway: GatewayProcess) -> None:
    client = openai.AsyncOpenAI(base_url=gateway.url + "/v1", api_key="sk-demo-p1", max_retries=0)

    async def one(i: int) -> int | None:
        stream = await client.completions.create(
            model=vllm.model,
            prompt=f"class Thing{i}:",
            max_tokens=20,
            stream=True,
            stream_options={"include_usage": True},
            extra_body=FULL_LENGTH,
        )
        usage = None
        async for chunk in stream:
            if chunk.usage:
                usage = chunk.usage.completion_tokens
        return usage

    assert await asyncio.gather(*(one(i) for i in range(6))) == [20] * 6


def test_models_and_errors_through_sluice(vllm: VllmServer, gateway: GatewayProcess) -> None:
    client = openai.OpenAI(base_url=gateway.url + "/v1", api_key="sk-demo-p2", max_retries=0)
    assert [m.id for m in client.models.list()] == [vllm.model]

    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="no-such-model", prompt="x", max_tokens=2)
    # vLLM's own 400 (prompt + max_tokens over max_model_len) is the client's mistake:
    # relayed as vLLM gave it, not counted as an overload
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=vllm.model, prompt="x", max_tokens=4000)
    assert "max" in str(err.value).lower()


# A fixed cap: all the streams below run at once (the adaptive limiter may hold some back).
FIXED_POLICY = """
tenants:
  - {name: agents, apiKeys: [sk-demo-p1], priority: 1}
limiter: {algorithm: fixed, fixedLimit: 32}
"""


async def test_gateway_reads_vllm_metrics_under_their_real_names(vllm: VllmServer) -> None:
    # Every figure the gateway's scraper looks for is in vLLM's exposition.
    wait_idle(vllm)
    parsed = VllmAdapter().read({"/metrics": vllm.metrics_text()}, at=0.0)
    assert parsed.running == 0 and parsed.waiting == 0 and parsed.kv_usage == 0
    assert parsed.preemptions_total is not None
    # vllm:cache_config_info: 8 MiB of KV = 4,096 tokens of this model, in blocks of 128
    assert (parsed.num_gpu_blocks, parsed.block_size) == (32, 128)

    gateway = start_gateway([vllm.url], FIXED_POLICY)
    rng = random.Random(16)
    try:
        async with client_session() as s:

            async def engine() -> dict[str, float]:
                async with s.get(vllm.url + "/metrics") as r:
                    return gauge_values(await r.text(), _ENGINE)  # a cheap read

            async def gateway_view() -> dict[str, float]:
                async with s.get(gateway.url + "/metrics") as r:
                    return parse_metrics(await r.text())

            async def open_stream() -> aiohttp.ClientResponse:
                # 16-token prompts: one KV block each until ~110 tokens are out, seconds at
                # this batch size (long answers: none ends before that)
                r = await s.post(
                    gateway.url + "/v1/completions",
                    json=completion_body(vllm.model, token_prompt(rng, 16), 2000),
                    headers={"Authorization": "Bearer sk-demo-p1"},
                )
                assert r.status == 200
                first_lines.append(await r.content.readline())
                return r

            first_lines: list[bytes] = []
            streams = await asyncio.gather(*(open_stream() for _ in range(STREAMS)))
            try:
                # the gateway's own count, whatever vLLM runs or has preempted (read at
                # once: the longest wait below outlasts some of the streams)
                opened = await gateway_view()
                inflight = opened['sluice_backend_inflight{backend="backend-0"}']
                # (on a busy 2-core VM vLLM may finish the first before it starts the last)
                ended = opened.get(
                    'sluice_requests_total{outcome="ok",priority="1",route="completions"}', 0.0
                )
                assert inflight + ended == STREAMS and inflight >= STREAMS / 2, (
                    inflight,
                    ended,
                    [line[:120] for line in first_lines if b'"text"' not in line],
                    "\n".join(gateway.output[-40:]),
                )
                # While they run, the gateway's scraper (every 250 ms) reports vLLM's KV
                # usage and queue exactly as vLLM exposes them, under the gateway's own
                # names: a value the engine showed within the last seconds (how long one
                # value lasts depends on the machine's speed: the streams grow a block every
                # ~110 tokens, and outgrow the cache soon after; on a slow machine one read
                # of vLLM's /metrics takes most of a second, so each engine value is stamped
                # when its read ended).
                engine_seen: list[tuple[float, dict[str, float]]] = []
                deadline = time.monotonic() + 20
                while True:
                    value = await engine()
                    engine_seen.append((time.monotonic(), value))
                    asked = time.monotonic()
                    seen = await gateway_view()
                    got = seen.get('sluice_backend_kv_usage{backend="backend-0"}')
                    fresh = seen.get('sluice_backend_metrics_fresh{backend="backend-0"}')
                    waiting = seen.get('sluice_backend_waiting{backend="backend-0"}')
                    recent = [v for t, v in engine_seen if t > asked - 2.0]
                    if got and any(
                        v["vllm:kv_cache_usage_perc"] == got
                        and v["vllm:num_requests_waiting"] == waiting
                        for v in recent
                    ):
                        break
                    assert time.monotonic() < deadline, (engine_seen[-3:], got, waiting, fresh)
                assert fresh == 1.0
            finally:
                for r in streams:
                    r.close()
    finally:
        gateway.stop()
