"""Return slots through a real gateway and simulator (issue 17): a refused request is told
when to come back and given a booking; back in its slot with the booking it is served
while fresh requests of its class are still refused; a request whose deadline comes
before any room is told so, without a Retry-After, and neither SDK retries it; Sluice's
SDK, left to itself, brings every refused request back in its slot."""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Iterator

import httpx
import openai
import pytest
from conftest import SimFactory, SimProcess
from gateway_proc import GatewayProcess, start_gateway

from sluice.client import AsyncRetryTransport, RetryBudget, RetryPolicy

pytestmark = pytest.mark.integration

# Two backend slots; P2 is fast-rejected once both are busy and two more are queued.
POLICY = """
queues:
  - {priority: 0, name: realtime-interactive, maxQueueSize: 200, timeout: 8s, dropPolicy: tail}
  - {priority: 1, name: agent-workflow, maxQueueSize: 500, timeout: 15s,
     dropPolicy: early-drop-on-pressure}
  - {priority: 2, name: batch-extraction, maxQueueSize: 1000, timeout: 60s,
     dropPolicy: fast-reject}
tenants:
  - {name: batch, apiKeys: [sk-demo-p2], priority: 2}
  - {name: other, apiKeys: [sk-other-p2], priority: 2}
limiter: {algorithm: fixed, fixedLimit: 2}
dispatcher: {reserved: {p0: 0.0}}
"""
BODY = {"model": "sluice-sim", "prompt": "hi", "max_tokens": 40}
KEY = {"Authorization": "Bearer sk-demo-p2"}


@pytest.fixture
def gateway(sim_factory: SimFactory) -> Iterator[tuple[SimProcess, GatewayProcess]]:
    sim = sim_factory("--profile", "tiny", "--speed", "0.5")
    gw = start_gateway([sim.url], POLICY)
    yield sim, gw
    gw.stop()


async def _load(client: httpx.AsyncClient, url: str, until: float) -> list[httpx.Response]:
    """Fresh P2 requests, 8 at a time, until `until` (monotonic)."""
    answers: list[httpx.Response] = []

    async def one() -> None:
        while time.monotonic() < until:
            r = await client.post(url + "/v1/completions", json=BODY, headers=KEY)
            answers.append(r)
            if r.status_code == 429:
                await asyncio.sleep(0.05)

    await asyncio.gather(*(one() for _ in range(8)))
    return answers


def _p2_returns(gw: GatewayProcess) -> dict[str, int]:
    state = httpx.get(gw.url + "/dashboard/state", timeout=5).json()
    returns: dict[str, int] = state["controller"]["classes"]["P2"]["returns"]
    return returns


async def test_back_in_its_slot_a_refused_request_is_served_while_fresh_ones_are_not(
    gateway: tuple[SimProcess, GatewayProcess],
) -> None:
    _, gw = gateway
    async with httpx.AsyncClient(timeout=30) as client:
        # warm the rates up, then keep the class overloaded for the rest of the test
        load = asyncio.create_task(_load(client, gw.url, time.monotonic() + 12.0))
        refusal = None
        for _ in range(200):
            await asyncio.sleep(0.05)
            r = await client.post(gw.url + "/v1/completions", json=BODY, headers=KEY)
            if r.status_code == 429 and "x-sluice-booking" in r.headers:
                refusal = r
                break
        assert refusal is not None, "no refusal with a booking under overload"
        assert refusal.json()["error"]["code"] == "fast_reject"
        ra_ms = int(refusal.headers["retry-after-ms"])
        assert 1 <= int(refusal.headers["retry-after"]) <= 60
        assert int(refusal.headers["retry-after"]) >= ra_ms / 1000
        assert int(refusal.headers["x-sluice-retry-window-ms"]) >= 0
        token = refusal.headers["x-sluice-booking"]
        # another tenant cannot use it
        stolen = await client.post(
            gw.url + "/v1/completions",
            json=BODY,
            headers={"Authorization": "Bearer sk-other-p2", "X-Sluice-Booking": token},
        )
        await asyncio.sleep(ra_ms / 1000)
        fresh = await client.post(gw.url + "/v1/completions", json=BODY, headers=KEY)
        back = await client.post(
            gw.url + "/v1/completions", json=BODY, headers={**KEY, "X-Sluice-Booking": token}
        )
        answers = await load
    assert back.status_code == 200, back.text
    assert sum(a.status_code == 429 for a in answers) > 10, "the class was not overloaded"
    assert fresh.status_code == 429 or stolen.status_code == 429
    returns = _p2_returns(gw)
    assert returns["booked"] >= 1 and returns["returned_admitted"] >= 1


async def test_a_deadline_before_any_room_is_told_so_and_not_retried(
    gateway: tuple[SimProcess, GatewayProcess],
) -> None:
    _, gw = gateway
    sdk = openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key="sk-demo-p2", max_retries=3)
    async with httpx.AsyncClient(timeout=30) as client:
        load = asyncio.create_task(_load(client, gw.url, time.monotonic() + 8.0))
        told = None
        for _ in range(200):
            await asyncio.sleep(0.05)
            r = await client.post(
                gw.url + "/v1/completions",
                json=BODY,
                headers={**KEY, "X-Request-Timeout": "0.2"},
            )
            if r.status_code == 429 and r.json()["error"]["code"] == "cannot_serve_in_time":
                told = r
                break
        assert told is not None, "a 0.2 s deadline under overload was never told"
        assert "retry-after" not in told.headers and "retry-after-ms" not in told.headers
        assert told.headers["x-should-retry"] == "false"
        with pytest.raises(openai.RateLimitError) as caught:
            for _ in range(200):
                await sdk.completions.create(
                    model="sluice-sim", prompt="hi", max_tokens=40, timeout=0.2
                )
        assert caught.value.code == "cannot_serve_in_time"
        await load
    retries = gw.metrics().get('sluice_client_retries_total{client="openai-sdk",priority="2"}', 0)
    assert retries == 0  # x-should-retry: false kept the openai SDK from retrying


async def test_no_retry_after_points_past_the_clients_deadline(
    gateway: tuple[SimProcess, GatewayProcess],
) -> None:
    # random deadlines in both headers under overload: every 429 either fits its Retry-After
    # (whole seconds and ms) in what the client has left, or says it cannot be served in time
    _, gw = gateway
    rng = random.Random(17)
    answers: list[tuple[float, httpx.Response]] = []
    async with httpx.AsyncClient(timeout=30) as client:
        load = asyncio.create_task(_load(client, gw.url, time.monotonic() + 10.0))
        await asyncio.sleep(2.0)  # the rates warm up
        while not load.done():
            # short deadlines (some cannot be served in time) and long ones (most can)
            left = round(rng.choice([rng.uniform(0.3, 5.0), rng.uniform(20.0, 120.0)]), 2)
            header = rng.choice(["X-Request-Timeout", "X-Stainless-Timeout"])
            r = await client.post(
                gw.url + "/v1/completions", json=BODY, headers={**KEY, header: str(left)}
            )
            answers.append((left, r))
            await asyncio.sleep(0.02)
        await load
    refused = [(left, r) for left, r in answers if r.status_code == 429]
    told = [r for _, r in refused if r.json()["error"]["code"] == "cannot_serve_in_time"]
    given = [(left, r) for left, r in refused if "retry-after" in r.headers]
    assert len(told) + len(given) == len(refused)
    assert given and told, (len(given), len(told))  # both answers were seen
    for left, r in given:
        assert int(r.headers["retry-after"]) <= left, (left, dict(r.headers))
        assert int(r.headers["retry-after-ms"]) <= 1000 * left, (left, dict(r.headers))
    for r in told:
        assert r.headers["x-should-retry"] == "false" and "retry-after-ms" not in r.headers


async def test_the_sdk_brings_refused_requests_back_in_their_slots(
    gateway: tuple[SimProcess, GatewayProcess],
) -> None:
    _, gw = gateway
    transport = AsyncRetryTransport(
        policy=RetryPolicy(max_attempts=6), budget=RetryBudget(ratio=1.0, initial=200, capacity=200)
    )
    async with httpx.AsyncClient(transport=transport, timeout=60) as client:
        # warm-up, so that the gateway's rates give slots rather than the longest answer
        await asyncio.gather(
            *(client.post(gw.url + "/v1/completions", json=BODY, headers=KEY) for _ in range(8))
        )
        answers = await asyncio.gather(
            *(client.post(gw.url + "/v1/completions", json=BODY, headers=KEY) for _ in range(40))
        )
    assert all(a.status_code == 200 for a in answers), [a.status_code for a in answers]
    assert transport.stats.retries > 0
    returns = _p2_returns(gw)
    # most retries came back with their booking in its slot, and every such one got in
    assert returns["returned"] >= 0.8 * transport.stats.retries, (returns, transport.stats)
    assert returns["returned_admitted"] == returns["returned"]


async def test_replicas_sharing_the_key_recognise_each_others_returns(
    sim_factory: SimFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    sim = sim_factory("--profile", "tiny", "--speed", "0.5")
    shared = POLICY + "retryAfter: {rule: booking, secretEnv: TEST_BOOKING_KEY}\n"
    monkeypatch.setenv("TEST_BOOKING_KEY", "one key for the replicas")
    a = start_gateway([sim.url], shared)
    b = start_gateway([sim.url], shared)
    monkeypatch.setenv("TEST_BOOKING_KEY", "another key")
    c = start_gateway([sim.url], shared)
    try:
        async with httpx.AsyncClient(timeout=30) as client:
            load = asyncio.create_task(_load(client, a.url, time.monotonic() + 8.0))
            refusal = None
            for _ in range(200):
                await asyncio.sleep(0.05)
                r = await client.post(a.url + "/v1/completions", json=BODY, headers=KEY)
                if r.status_code == 429 and "x-sluice-booking" in r.headers:
                    refusal = r
                    break
            assert refusal is not None
            token = refusal.headers["x-sluice-booking"]
            await asyncio.sleep(int(refusal.headers["retry-after-ms"]) / 1000)
            back = {**KEY, "X-Sluice-Booking": token}
            on_b, on_c = await asyncio.gather(
                client.post(b.url + "/v1/completions", json=BODY, headers=back),
                client.post(c.url + "/v1/completions", json=BODY, headers=back),
            )
            await load
        assert on_b.status_code == 200 and on_c.status_code == 200  # both idle: both serve
        assert _p2_returns(b)["returned"] == 1  # B knew it for a return...
        assert _p2_returns(c)["returned"] == 0  # ...C, with another key, for a fresh one
    finally:
        for gw in (a, b, c):
            gw.stop()


# The same booking and deadline answers on the routes with their own error shapes: the
# Responses API (OpenAI's shape, 429) and Anthropic's Messages API (529 overloaded_error).
SHAPED_ROUTES = {
    "responses": (
        "/v1/responses",
        {"model": "sluice-sim", "input": "hi", "max_output_tokens": 40},
        KEY,
        429,
    ),
    "messages": (
        "/v1/messages",
        {"model": "sluice-sim", "max_tokens": 40, "messages": [{"role": "user", "content": "hi"}]},
        {"x-api-key": "sk-demo-p2", "anthropic-version": "2023-06-01"},
        529,
    ),
}


def _code(r: httpx.Response) -> str:
    """Sluice's code in either shape (Anthropic's keeps it in the message)."""
    error = r.json()["error"]
    return str(error.get("code") or error["message"])


@pytest.mark.parametrize("route", sorted(SHAPED_ROUTES))
async def test_every_route_books_its_return_and_tells_a_deadline_it_cannot_meet(
    gateway: tuple[SimProcess, GatewayProcess], route: str
) -> None:
    _, gw = gateway
    path, body, headers, status = SHAPED_ROUTES[route]
    async with httpx.AsyncClient(timeout=30) as client:
        load = asyncio.create_task(_load(client, gw.url, time.monotonic() + 12.0))
        refusal = told = None
        for _ in range(200):
            await asyncio.sleep(0.05)
            if refusal is None:
                r = await client.post(gw.url + path, json=body, headers=headers)
                if r.status_code == status and "x-sluice-booking" in r.headers:
                    refusal = r
            if told is None:
                r = await client.post(
                    gw.url + path, json=body, headers={**headers, "X-Request-Timeout": "0.2"}
                )
                if r.status_code == status and "cannot_serve_in_time" in _code(r):
                    told = r
            if refusal is not None and told is not None:
                break
        assert refusal is not None, "no refusal with a booking under overload"
        assert told is not None, "a 0.2 s deadline under overload was never told"
        assert "fast_reject" in _code(refusal)
        assert 1 <= int(refusal.headers["retry-after"]) <= 60
        assert "retry-after" not in told.headers and told.headers["x-should-retry"] == "false"
        await asyncio.sleep(int(refusal.headers["retry-after-ms"]) / 1000)
        back = await client.post(
            gw.url + path,
            json=body,
            headers={**headers, "X-Sluice-Booking": refusal.headers["x-sluice-booking"]},
        )
        await load
    assert back.status_code == 200, back.text
    assert _p2_returns(gw)["returned_admitted"] >= 1
