"""The gateway as a drop-in proxy: real `sluice sim` and `sluice serve` processes on
loopback, driven by the official openai SDK and raw HTTP."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Iterator

import httpx
import openai
import pytest
from abort_timing import abort_delays
from conftest import SimFactory, SimProcess
from gateway_proc import GatewayProcess, start_gateway

import sluice

pytestmark = pytest.mark.integration

PROMPT = [{"role": "user", "content": "Tell me about rivers and bridges."}]
# The simulator's answer depends only on the prompt and the seed, like a real engine at
# temperature 0, so a direct answer and one through the gateway can be compared.
DETERMINISTIC = {"seed": 7, "temperature": 0}


@pytest.fixture
def backend(sim_factory: SimFactory) -> SimProcess:
    return sim_factory("--profile", "tiny", "--seed", "1")


@pytest.fixture
def gateway(backend: SimProcess) -> Iterator[GatewayProcess]:
    gw = start_gateway([backend.url])
    yield gw
    gw.stop()


def _model(sim: SimProcess) -> str:
    return httpx.get(sim.url + "/v1/models").json()["data"][0]["id"]


def _collect(stream: openai.Stream) -> str:  # type: ignore[type-arg]
    return "".join((c.choices[0].delta.content or "") for c in stream if c.choices)


def test_openai_sdk_sync_same_content_as_direct(
    backend: SimProcess, gateway: GatewayProcess
) -> None:
    model = _model(backend)
    direct = openai.OpenAI(base_url=backend.url + "/v1", api_key="x")
    via = openai.OpenAI(base_url=gateway.url + "/v1", api_key="sk-demo-p0")
    kw = {"model": model, "messages": PROMPT, "max_tokens": 24, **DETERMINISTIC}
    a = direct.chat.completions.create(**kw)  # type: ignore[call-overload]
    b = via.chat.completions.create(**kw)  # type: ignore[call-overload]
    assert b.choices[0].message.content == a.choices[0].message.content
    assert b.usage is not None and a.usage is not None
    assert b.usage.completion_tokens == a.usage.completion_tokens

    sa = _collect(direct.chat.completions.create(stream=True, **kw))  # type: ignore[call-overload]
    sb = _collect(via.chat.completions.create(stream=True, **kw))  # type: ignore[call-overload]
    assert sb == sa == a.choices[0].message.content

    ca = direct.completions.create(
        model=model, prompt="Once upon a time", max_tokens=12, **DETERMINISTIC
    )
    cb = via.completions.create(
        model=model, prompt="Once upon a time", max_tokens=12, **DETERMINISTIC
    )
    assert cb.choices[0].text == ca.choices[0].text


async def test_openai_sdk_async_same_content_as_direct(
    backend: SimProcess, gateway: GatewayProcess
) -> None:
    model = _model(backend)
    direct = openai.AsyncOpenAI(base_url=backend.url + "/v1", api_key="x")
    via = openai.AsyncOpenAI(base_url=gateway.url + "/v1", api_key="sk-demo-p1")
    kw = {"model": model, "messages": PROMPT, "max_tokens": 20, **DETERMINISTIC}
    a, b = await asyncio.gather(
        direct.chat.completions.create(**kw),  # type: ignore[call-overload]
        via.chat.completions.create(**kw),
    )  # type: ignore[call-overload]
    assert b.choices[0].message.content == a.choices[0].message.content

    async def collect(client: openai.AsyncOpenAI) -> tuple[str, int | None]:
        stream = await client.chat.completions.create(  # type: ignore[call-overload]
            stream=True, stream_options={"include_usage": True}, **kw
        )
        text, usage = "", None
        async for chunk in stream:
            if chunk.choices:
                text += chunk.choices[0].delta.content or ""
            if chunk.usage:
                usage = chunk.usage.completion_tokens
        return text, usage

    (ta, ua), (tb, ub) = await asyncio.gather(collect(direct), collect(via))
    assert tb == ta and ub == ua == 20


def test_stream_without_usage_gets_no_usage_chunk(
    backend: SimProcess, gateway: GatewayProcess
) -> None:
    """The gateway asks the backend for usage; a client that did not ask must not see it."""
    with httpx.stream(
        "POST",
        gateway.url + "/v1/chat/completions",
        headers={"Authorization": "Bearer sk-demo-p0"},
        json={"model": _model(backend), "messages": PROMPT, "max_tokens": 5, "stream": True},
    ) as r:
        body = r.read().decode()
    assert r.status_code == 200
    assert '"usage"' not in body
    assert body.rstrip().endswith("data: [DONE]")


def test_models_auth_and_errors(backend: SimProcess, gateway: GatewayProcess) -> None:
    url = gateway.url
    model = _model(backend)
    chat = url + "/v1/chat/completions"
    body = {"model": model, "messages": PROMPT, "max_tokens": 2}

    models = httpx.get(url + "/v1/models", headers={"Authorization": "Bearer sk-demo-p2"})
    assert [m["id"] for m in models.json()["data"]] == [model]

    def check(r: httpx.Response, status: int, code: str) -> None:
        assert r.status_code == status, r.text
        assert r.json()["error"]["code"] == code
        assert set(r.json()["error"]) >= {"message", "type", "code"}

    check(httpx.post(chat, json=body), 401, "invalid_api_key")
    check(
        httpx.post(chat, json=body, headers={"Authorization": "Bearer nope"}),
        401,
        "invalid_api_key",
    )
    p1 = {"Authorization": "Bearer sk-demo-p1"}
    r = httpx.post(chat, json=body, headers={**p1, "X-Priority": "0"})
    check(r, 403, "priority_not_allowed")
    assert r.headers["X-Sluice-Priority"] == "1"
    r = httpx.post(chat, json=body, headers={**p1, "X-Priority": "2"})
    assert r.status_code == 200 and r.headers["X-Sluice-Priority"] == "2"
    assert "X-Sluice-Queue-Ms" in r.headers
    check(httpx.post(chat, json={**body, "model": "nope"}, headers=p1), 404, "model_not_found")
    check(httpx.post(chat, content=b"{bad", headers=p1), 400, "invalid_request")
    check(httpx.post(chat, json={"model": model}, headers=p1), 400, "invalid_request")
    big = {**body, "messages": [{"role": "user", "content": "x" * (5 * 1024 * 1024)}]}
    check(httpx.post(chat, json=big, headers=p1), 413, "body_too_large")
    # The backend's own refusal of a prompt too long is relayed as the client's error.
    long = {**body, "messages": [{"role": "user", "content": "word " * 40000}]}
    assert httpx.post(chat, json=long, headers=p1, timeout=10).status_code == 400


def test_upstream_failure_mid_stream_is_an_error_event(sim_factory: SimFactory) -> None:
    slow = sim_factory("--profile", "tiny", "--speed", "0.05")
    gw = start_gateway([slow.url])
    try:
        client = openai.OpenAI(base_url=gw.url + "/v1", api_key="sk-demo-p0", max_retries=0)
        stream = client.chat.completions.create(
            model=_model(slow),
            messages=PROMPT,
            max_tokens=200,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        it = iter(stream)
        next(it)  # streaming has begun
        slow.kill()
        with pytest.raises(openai.APIError):
            for _ in it:
                pass
    finally:
        gw.stop()


def test_client_deadline_bounds_the_upstream_call(sim_factory: SimFactory) -> None:
    slow = sim_factory("--profile", "tiny", "--speed", "0.05")
    gw = start_gateway([slow.url])
    try:
        t0 = time.monotonic()
        r = httpx.post(
            gw.url + "/v1/chat/completions",
            headers={"Authorization": "Bearer sk-demo-p0", "X-Request-Timeout": "0.5"},
            json={"model": _model(slow), "messages": PROMPT, "max_tokens": 300, "ignore_eos": True},
            timeout=10,
        )
        assert r.status_code == 504 and r.json()["error"]["code"] == "upstream_timeout"
        assert time.monotonic() - t0 < 2.0
    finally:
        gw.stop()


async def test_abort_reaches_the_backend_within_100ms(sim_factory: SimFactory) -> None:
    """50 streaming clients close after their first token; every one of their backend
    requests is aborted (KV blocks freed) within 100 ms of its client's close."""
    sim = sim_factory(
        "--profile", "tiny", "--kv-blocks", "4096", "--max-num-seqs", "128", "--speed", "1"
    )
    gw = start_gateway([sim.url], POLICY_BIG_LIMIT)
    body = {
        "model": _model(sim),
        "messages": PROMPT,
        "max_tokens": 2000,
        "ignore_eos": True,
        "stream": True,
    }
    delays = await abort_delays(
        sim,
        gw,
        "/v1/chat/completions",
        body,
        {"Authorization": "Bearer sk-demo-p0"},
        lambda line: line.startswith("data: {") and '"content":"' in line,
    )
    gw.stop()
    assert delays[-1] <= 0.100, f"an abort came {delays[-1] * 1000:.0f} ms after its close"


POLICY_BIG_LIMIT = """
tenants:
  - {name: chat-app, apiKeys: [sk-demo-p0], priority: 0}
limiter: {algorithm: fixed, fixedLimit: 200, maxLimit: 256}
"""


def test_sigterm_lets_open_streams_finish(sim_factory: SimFactory) -> None:
    sim = sim_factory("--profile", "tiny", "--speed", "0.5")
    gw = start_gateway([sim.url])
    with httpx.stream(
        "POST",
        gw.url + "/v1/chat/completions",
        headers={"Authorization": "Bearer sk-demo-p0"},
        json={
            "model": _model(sim),
            "messages": PROMPT,
            "max_tokens": 40,
            "ignore_eos": True,
            "stream": True,
        },
        timeout=20,
    ) as r:
        lines = r.iter_lines()
        next(line for line in lines if line.startswith("data: {"))
        os.kill(gw.proc.pid, signal.SIGTERM)
        rest = list(lines)
    assert rest[-1] == "data: [DONE]" or rest[-2] == "data: [DONE]"
    assert gw.proc.wait(10) == 0


POLICY_ONE_SLOT = """
tenants:
  - {name: chat-app, apiKeys: [sk-demo-p0], priority: 0}
limiter: {algorithm: fixed, fixedLimit: 1, initialLimit: 1, maxLimit: 1}
dispatcher: {reserved: {p0: 0.0}}
"""


def test_sigterm_hands_queued_requests_back_and_lets_open_streams_finish(
    sim_factory: SimFactory,
) -> None:
    """A queued request is not kept until the grace period cuts it: at SIGTERM it gets
    503 `shutting_down` with a short retry-after-ms (another replica takes it)."""
    sim = sim_factory("--profile", "tiny", "--speed", "0.5")
    gw = start_gateway([sim.url], POLICY_ONE_SLOT)
    auth = {"Authorization": "Bearer sk-demo-p0"}
    body = {"model": _model(sim), "messages": PROMPT, "max_tokens": 40, "ignore_eos": True}

    async def queued_then_sigterm() -> httpx.Response:
        async with httpx.AsyncClient(timeout=20) as client:
            waiting = asyncio.create_task(
                client.post(gw.url + "/v1/chat/completions", headers=auth, json=body)
            )
            deadline = time.monotonic() + 20
            while gw.metrics().get('sluice_queue_depth{priority="0"}') != 1.0:
                assert time.monotonic() < deadline, "the second request never queued"
                await asyncio.sleep(0.05)
            os.kill(gw.proc.pid, signal.SIGTERM)
            return await waiting

    with httpx.stream(
        "POST",
        gw.url + "/v1/chat/completions",
        headers=auth,
        json={**body, "max_tokens": 400, "stream": True},  # it runs while the other waits
        timeout=60,
    ) as r:
        lines = r.iter_lines()
        next(line for line in lines if line.startswith("data: {"))
        handed_back = asyncio.run(queued_then_sigterm())
        rest = list(lines)
    assert handed_back.status_code == 503
    assert handed_back.json()["error"]["code"] == "shutting_down"
    assert handed_back.headers["retry-after-ms"] == "100"
    assert rest[-1] == "data: [DONE]" or rest[-2] == "data: [DONE]"
    assert gw.proc.wait(60) == 0


def test_metrics_say_which_version_runs(gateway: GatewayProcess) -> None:
    """An operator can tell replicas of different versions apart mid-rollout."""
    key = f'sluice_build_info{{version="{sluice.__version__}"}}'
    assert gateway.metrics().get(key) == 1.0
