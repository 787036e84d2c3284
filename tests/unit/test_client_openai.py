"""The SDK as users run it: the real `openai` client with RetryTransport as its httpx
transport and max_retries=0, a scripted server behind httpx.MockTransport, fake sleep."""

from __future__ import annotations

import json
import random

import httpx
import openai
import pytest

from sluice.client import AsyncRetryTransport, RetryPolicy, RetryTransport

BASE_URL = "http://gateway.test/v1"
MESSAGES = [{"role": "user", "content": "hello"}]
COMPLETION = {
    "id": "chatcmpl-1",
    "object": "chat.completion",
    "created": 0,
    "model": "m",
    "choices": [
        {
            "index": 0,
            "message": {"role": "assistant", "content": "hi there"},
            "finish_reason": "stop",
        }
    ],
    "usage": {"prompt_tokens": 1, "completion_tokens": 2, "total_tokens": 3},
}
CHUNK = {
    "id": "chatcmpl-2",
    "object": "chat.completion.chunk",
    "created": 0,
    "model": "m",
    "choices": [{"index": 0, "delta": {"content": "streamed"}, "finish_reason": None}],
}
REJECTED = {
    "error": {
        "message": "The agent-workflow queue is full; retry after the indicated delay.",
        "type": "rate_limit_error",
        "code": "queue_full",
        "param": None,
    }
}


class Gateway:
    """Refuses the first `rejections` attempts like Sluice does, then answers."""

    def __init__(self, rejections: int, retry_after_ms: int = 800) -> None:
        self.rejections = rejections
        self.retry_after_ms = retry_after_ms
        self.seen: list[httpx.Request] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.seen.append(request)
        if len(self.seen) <= self.rejections:
            headers = {
                "Retry-After": str(max(1, -(-self.retry_after_ms // 1000))),
                "retry-after-ms": str(self.retry_after_ms),
            }
            return httpx.Response(429, headers=headers, json=REJECTED)
        if json.loads(request.content).get("stream"):
            sse = f"data: {json.dumps(CHUNK)}\n\ndata: [DONE]\n\n".encode()
            return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=sse)
        return httpx.Response(200, json=COMPLETION)

    def header(self, name: str) -> list[str | None]:
        return [r.headers.get(name) for r in self.seen]


class Sleeps:
    def __init__(self) -> None:
        self.delays: list[float] = []
        self.now = 0.0

    def clock(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.delays.append(seconds)
        self.now += seconds

    async def async_sleep(self, seconds: float) -> None:
        self.sleep(seconds)


def sync_openai(gateway: Gateway, sleeps: Sleeps, seed: int = 7, **kwargs: object) -> openai.OpenAI:
    transport = RetryTransport(
        httpx.MockTransport(gateway),
        rng=random.Random(seed),
        sleep=sleeps.sleep,
        clock=sleeps.clock,
        **kwargs,
    )  # type: ignore[arg-type]
    return openai.OpenAI(
        base_url=BASE_URL,
        api_key="sk-demo-p1",
        http_client=httpx.Client(transport=transport),
        max_retries=0,
    )


def async_openai(
    gateway: Gateway, sleeps: Sleeps, seed: int = 7, **kwargs: object
) -> openai.AsyncOpenAI:
    transport = AsyncRetryTransport(
        httpx.MockTransport(gateway),
        rng=random.Random(seed),
        sleep=sleeps.async_sleep,
        clock=sleeps.clock,
        **kwargs,
    )  # type: ignore[arg-type]
    return openai.AsyncOpenAI(
        base_url=BASE_URL,
        api_key="sk-demo-p1",
        http_client=httpx.AsyncClient(transport=transport),
        max_retries=0,
    )


def expected_delays(seed: int, seconds: float, count: int) -> list[float]:
    reference = random.Random(seed)
    return [seconds * (1 + 0.5 * reference.random()) for _ in range(count)]


def test_openai_call_succeeds_after_two_429s() -> None:
    gateway, sleeps = Gateway(rejections=2), Sleeps()
    client = sync_openai(gateway, sleeps)

    completion = client.chat.completions.create(model="m", messages=MESSAGES)  # type: ignore[arg-type]

    assert completion.choices[0].message.content == "hi there"
    assert sleeps.delays == expected_delays(7, 0.8, 2)
    assert gateway.header("x-sluice-retry") == [None, "1", "2"]
    # The openai SDK made one call; the retries are the transport's, invisible to it.
    assert gateway.header("x-stainless-retry-count") == ["0", "0", "0"]
    assert gateway.header("authorization") == ["Bearer sk-demo-p1"] * 3
    assert len({r.content for r in gateway.seen}) == 1
    assert json.loads(gateway.seen[0].content)["messages"] == MESSAGES


def test_openai_streaming_call_succeeds_after_a_429() -> None:
    gateway, sleeps = Gateway(rejections=1), Sleeps()
    client = sync_openai(gateway, sleeps)

    stream = client.chat.completions.create(model="m", messages=MESSAGES, stream=True)  # type: ignore[arg-type]

    assert [c.choices[0].delta.content for c in stream] == ["streamed"]
    assert len(gateway.seen) == 2


def test_openai_sees_the_gateway_429_when_attempts_run_out() -> None:
    gateway, sleeps = Gateway(rejections=100), Sleeps()
    client = sync_openai(gateway, sleeps, policy=RetryPolicy(max_attempts=3))

    with pytest.raises(openai.RateLimitError) as raised:
        client.chat.completions.create(model="m", messages=MESSAGES)  # type: ignore[arg-type]

    assert raised.value.code == "queue_full"
    assert raised.value.response.headers["retry-after-ms"] == "800"
    assert len(gateway.seen) == 3


def test_openai_timeout_bounds_the_retries() -> None:
    gateway, sleeps = Gateway(rejections=100, retry_after_ms=2000), Sleeps()
    client = sync_openai(gateway, sleeps).with_options(timeout=1.5)

    with pytest.raises(openai.RateLimitError):
        client.chat.completions.create(model="m", messages=MESSAGES)  # type: ignore[arg-type]

    assert len(gateway.seen) == 1 and sleeps.delays == []


async def test_async_openai_call_succeeds_after_two_429s() -> None:
    gateway, sleeps = Gateway(rejections=2), Sleeps()
    client = async_openai(gateway, sleeps)

    completion = await client.chat.completions.create(model="m", messages=MESSAGES)  # type: ignore[arg-type]

    assert completion.choices[0].message.content == "hi there"
    assert sleeps.delays == expected_delays(7, 0.8, 2)
    assert gateway.header("x-sluice-retry") == [None, "1", "2"]
    assert len({r.content for r in gateway.seen}) == 1


async def test_async_openai_streaming_and_exhaustion() -> None:
    gateway, sleeps = Gateway(rejections=1), Sleeps()
    client = async_openai(gateway, sleeps)
    stream = await client.chat.completions.create(model="m", messages=MESSAGES, stream=True)  # type: ignore[arg-type]
    assert [c.choices[0].delta.content async for c in stream] == ["streamed"]

    refusing = Gateway(rejections=100)
    client = async_openai(refusing, Sleeps(), policy=RetryPolicy(max_attempts=2))
    with pytest.raises(openai.RateLimitError) as raised:
        await client.chat.completions.create(model="m", messages=MESSAGES)  # type: ignore[arg-type]
    assert raised.value.code == "queue_full"
    assert len(refusing.seen) == 2
