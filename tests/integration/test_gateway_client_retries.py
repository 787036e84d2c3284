"""The openai SDK against the gateway under overload, with and without Sluice's
RetryTransport: refused requests come back after their Retry-After and succeed, every
retry shows in the gateway's metrics, and the retry budget caps the retries."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
from conftest import SimFactory, SimProcess
from gateway_proc import GatewayProcess, start_gateway

from sluice.client import AsyncRetryTransport, RetryBudget, RetryPolicy

pytestmark = pytest.mark.integration

# One backend slot and a queue of 2 for P1: a burst of 24 is mostly refused at once. A
# refused client is told to come back within 3 s (the operator's cap on Retry-After).
POLICY = """
queues:
  - {priority: 0, name: realtime-interactive, maxQueueSize: 200, timeout: 8s, dropPolicy: tail}
  - {priority: 1, name: agent-workflow, maxQueueSize: 2, timeout: 15s, dropPolicy: tail}
  - {priority: 2, name: batch-extraction, maxQueueSize: 1000, timeout: 60s,
     dropPolicy: fast-reject}
tenants:
  - {name: agents, apiKeys: [sk-demo-p1], priority: 1}
limiter: {algorithm: fixed, fixedLimit: 2}
dispatcher: {reserved: {p0: 0.0}}
pressure: {maxRetryAfter: 3s}
"""
MESSAGES = [{"role": "user", "content": "hi"}]


@pytest.fixture
def overloaded(sim_factory: SimFactory) -> Iterator[tuple[SimProcess, GatewayProcess]]:
    sim = sim_factory("--profile", "tiny", "--speed", "4")
    gw = start_gateway([sim.url], POLICY)
    yield sim, gw
    gw.stop()


def _retries(gw: GatewayProcess, client: str) -> float:
    return gw.metrics().get(f'sluice_client_retries_total{{client="{client}",priority="1"}}', 0.0)


def _sdk_client(gw: GatewayProcess, transport: AsyncRetryTransport) -> openai.AsyncOpenAI:
    """The openai SDK over Sluice's retry transport, with the SDK's own retries off."""
    return openai.AsyncOpenAI(
        base_url=gw.url + "/v1",
        api_key="sk-demo-p1",
        http_client=httpx.AsyncClient(transport=transport),
        max_retries=0,
        timeout=60,
    )


async def test_retry_transport_succeeds_after_back_off(
    overloaded: tuple[SimProcess, GatewayProcess],
) -> None:
    _, gw = overloaded
    transport = AsyncRetryTransport(
        policy=RetryPolicy(max_attempts=8), budget=RetryBudget(ratio=1.0, initial=200, capacity=200)
    )
    client = _sdk_client(gw, transport)
    answers = await asyncio.gather(
        *(
            client.chat.completions.create(
                model="sluice-sim",
                messages=MESSAGES,  # type: ignore[arg-type]
                max_tokens=8,
            )
            for _ in range(24)
        )
    )
    assert len(answers) == 24 and all(a.choices[0].message.content for a in answers)
    stats = transport.stats
    assert stats.retries > 0
    m = gw.metrics()
    assert (
        m.get('sluice_rejections_total{code="queue_full",priority="1",route="chat"}', 0)
        >= stats.retries
    )
    assert _retries(gw, "sluice-sdk") == stats.retries


async def test_retry_budget_caps_retries(overloaded: tuple[SimProcess, GatewayProcess]) -> None:
    _, gw = overloaded
    budget = RetryBudget(ratio=0.1, initial=2, capacity=2)
    transport = AsyncRetryTransport(policy=RetryPolicy(max_attempts=8), budget=budget)
    client = _sdk_client(gw, transport)

    async def one() -> int:
        try:
            await client.chat.completions.create(
                model="sluice-sim",
                messages=MESSAGES,  # type: ignore[arg-type]
                max_tokens=8,
            )
            return 200
        except openai.RateLimitError:
            return 429

    statuses = await asyncio.gather(*(one() for _ in range(40)))
    # 2 retries to start with, plus 0.1 per request: at most 6 in all.
    assert transport.stats.retries <= 2 + 0.1 * 40
    assert statuses.count(429) > 0  # the budget gave up on some rather than amplify
    assert _retries(gw, "sluice-sdk") == transport.stats.retries


def test_openai_sdk_own_retries_are_counted(overloaded: tuple[SimProcess, GatewayProcess]) -> None:
    _, gw = overloaded
    client = openai.OpenAI(base_url=gw.url + "/v1", api_key="sk-demo-p1", max_retries=3, timeout=60)

    def one() -> None:
        with contextlib.suppress(openai.RateLimitError):
            client.chat.completions.create(
                model="sluice-sim",
                messages=MESSAGES,  # type: ignore[arg-type]
                max_tokens=8,
            )

    with ThreadPoolExecutor(16) as pool:
        list(pool.map(lambda _: one(), range(16)))
    assert _retries(gw, "openai-sdk") > 0
