"""The SDK over real HTTP: the `openai` client with RetryTransport (real httpx transport)
against a separate server process on 127.0.0.1 that refuses like Sluice's gateway."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from sluice.client import AsyncRetryTransport, RetryBudget, RetryPolicy, RetryTransport

pytestmark = pytest.mark.integration

# A stand-in gateway: refuses the first X-Test-Reject-Attempts attempts of a call (it tells
# them apart by X-Sluice-Retry) with Sluice's 429, records what every attempt carried.
SERVER = r"""
import asyncio, math
from aiohttp import web

COMPLETION = {"id": "c1", "object": "chat.completion", "created": 0, "model": "m",
              "choices": [{"index": 0, "message": {"role": "assistant", "content": "hi"},
                           "finish_reason": "stop"}],
              "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}}
seen = []

async def chat(request):
    body = await request.read()
    retry = request.headers.get("X-Sluice-Retry")
    seen.append({"retry": retry, "stainless": request.headers.get("x-stainless-retry-count"),
                 "body": body.decode(), "peer": request.transport.get_extra_info("peername")[1]})
    reject = int(request.headers.get("X-Test-Reject-Attempts", "0"))
    ms = int(request.headers.get("X-Test-Retry-After-Ms", "30"))
    if int(retry or 0) < reject:
        headers = {"Retry-After": str(max(1, math.ceil(ms / 1000))), "retry-after-ms": str(ms)}
        error = {"message": "The agent-workflow queue is full.", "type": "rate_limit_error",
                 "code": "queue_full", "param": None}
        return web.json_response({"error": error}, status=429, headers=headers)
    return web.json_response(COMPLETION)

async def attempts(request):
    return web.json_response(seen)

async def reset(request):
    seen.clear()
    return web.json_response({})

async def main():
    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_get("/test/attempts", attempts)
    app.router.add_post("/test/reset", reset)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    print(site._server.sockets[0].getsockname()[1], flush=True)
    await asyncio.Event().wait()

asyncio.run(main())
"""

MESSAGES: Any = [{"role": "user", "content": "hello"}]


@pytest.fixture(scope="module")
def server_url() -> Iterator[str]:
    process = subprocess.Popen([sys.executable, "-c", SERVER], stdout=subprocess.PIPE, text=True)
    try:
        assert process.stdout is not None
        port = process.stdout.readline().strip()  # the server prints its port once listening
        assert port.isdigit(), f"server did not start (exit code {process.poll()})"
        yield f"http://127.0.0.1:{port}"
    finally:
        process.terminate()
        process.wait(timeout=5)


@pytest.fixture
def server(server_url: str) -> str:
    httpx.post(f"{server_url}/test/reset")
    return server_url


def attempts(server: str) -> list[dict[str, Any]]:
    return httpx.get(f"{server}/test/attempts").json()


def reject(times: int, retry_after_ms: int = 30) -> dict[str, str]:
    return {"X-Test-Reject-Attempts": str(times), "X-Test-Retry-After-Ms": str(retry_after_ms)}


def test_openai_client_succeeds_after_back_off_over_one_connection(server: str) -> None:
    transport = RetryTransport()
    client = openai.OpenAI(
        base_url=f"{server}/v1",
        api_key="sk-demo-p1",
        max_retries=0,
        http_client=httpx.Client(transport=transport),
    )

    completion = client.chat.completions.create(
        model="m", messages=MESSAGES, extra_headers=reject(2)
    )

    assert completion.choices[0].message.content == "hi"
    seen = attempts(server)
    assert [a["retry"] for a in seen] == [None, "1", "2"]
    assert [a["stainless"] for a in seen] == ["0", "0", "0"]
    assert len({a["body"] for a in seen}) == 1 and json.loads(seen[0]["body"])["model"] == "m"
    # Refused answers were read and released: every attempt reused the first connection.
    assert len({a["peer"] for a in seen}) == 1
    assert transport.stats.retries == 2


async def test_async_openai_client_succeeds_after_back_off(server: str) -> None:
    transport = AsyncRetryTransport()
    async with openai.AsyncOpenAI(
        base_url=f"{server}/v1",
        api_key="sk-demo-p1",
        max_retries=0,
        http_client=httpx.AsyncClient(transport=transport),
    ) as client:
        completion = await client.chat.completions.create(
            model="m", messages=MESSAGES, extra_headers=reject(1)
        )
    assert completion.choices[0].message.content == "hi"
    seen = attempts(server)
    assert [a["retry"] for a in seen] == [None, "1"]
    assert len({a["peer"] for a in seen}) == 1


def test_budget_caps_retries_against_a_server_that_keeps_refusing(server: str) -> None:
    transport = RetryTransport(budget=RetryBudget(ratio=0.1, initial=2.0))
    client = openai.OpenAI(
        base_url=f"{server}/v1",
        api_key="sk-demo-p2",
        max_retries=0,
        http_client=httpx.Client(transport=transport),
    )

    for _ in range(50):
        with pytest.raises(openai.RateLimitError):
            client.chat.completions.create(
                model="m", messages=MESSAGES, extra_headers=reject(99, retry_after_ms=10)
            )

    # 2 tokens at the start: the first call deposits 0.1 and spends 2, leaving 0.1; then
    # each call deposits 0.1, so calls 10, 20, 30, 40 and 50 find a whole token. 7 retries
    # for 50 calls, where max_attempts alone would have allowed 150.
    assert transport.stats.retries == 7
    assert transport.stats.gave_up_budget == 50
    assert len(attempts(server)) == 57


def test_no_retry_past_the_openai_timeout(server: str) -> None:
    transport = RetryTransport()
    client = openai.OpenAI(
        base_url=f"{server}/v1",
        api_key="sk-demo-p1",
        max_retries=0,
        timeout=0.5,
        http_client=httpx.Client(transport=transport),
    )
    started = time.monotonic()

    with pytest.raises(openai.RateLimitError) as raised:
        client.chat.completions.create(
            model="m", messages=MESSAGES, extra_headers=reject(1, retry_after_ms=2000)
        )

    assert time.monotonic() - started < 0.5  # answered at once, not after a useless sleep
    assert raised.value.code == "queue_full"
    assert len(attempts(server)) == 1
    assert transport.stats.gave_up_deadline == 1


def test_connection_refused_is_retried_then_reported() -> None:
    with socket.socket() as probe:  # a port with nothing listening
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    transport = RetryTransport(policy=RetryPolicy(max_attempts=3, backoff_base=0.01))
    client = openai.OpenAI(
        base_url=f"http://127.0.0.1:{port}/v1",
        api_key="k",
        max_retries=0,
        http_client=httpx.Client(transport=transport),
    )

    with pytest.raises(openai.APIConnectionError):
        client.chat.completions.create(model="m", messages=MESSAGES)

    assert transport.stats.retries == 2 and transport.stats.gave_up_attempts == 1
