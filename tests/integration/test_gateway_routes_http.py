"""Every route through the gateway over raw HTTP, against real `sluice sim` processes (and
one fake backend that records what it is sent): the protection each route gets (key,
class, queues, Retry-After in the route's own error shape), what is per route (Anthropic's
headers and errors, stored responses on their own backend, the routes outside the
queues, the pooling and audio routes), and the route labels in metrics and access log."""

from __future__ import annotations

import asyncio
import io
import time
import wave
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import aiohttp
import httpx
import orjson
import pytest
from aiohttp import web
from conftest import SimFactory, SimProcess, start_sim
from gateway_proc import GatewayProcess, start_gateway

pytestmark = pytest.mark.integration

MODEL = "sluice-sim"
P0 = {"Authorization": "Bearer sk-demo-p0"}
P1 = {"Authorization": "Bearer sk-demo-p1"}
ADMIN = {"Authorization": "Bearer sk-demo-admin"}
HI = [{"role": "user", "content": "Tell me about rivers and bridges."}]


@pytest.fixture(scope="module")
def stack() -> Iterator[tuple[SimProcess, GatewayProcess]]:
    sim = start_sim(
        "--profile", "tiny", "--speed", "4", "--seed", "5", "--allow-runtime-lora-updating"
    )
    gw = start_gateway([sim.url])
    yield sim, gw
    gw.stop()
    sim.stop()


def _post(url: str, body: dict[str, object], headers: dict[str, str]) -> httpx.Response:
    return httpx.post(url, json=body, headers=headers, timeout=30)


def _without_ids(value: object) -> object:
    """An answer without the fields that differ from one request to the next."""
    if isinstance(value, dict):
        return {k: _without_ids(v) for k, v in value.items() if k not in ("id", "created")}
    if isinstance(value, list):
        return [_without_ids(v) for v in value]
    return value


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/embeddings", {"model": MODEL, "input": ["a river", "a bridge over it"]}),
        ("/v2/embed", {"model": MODEL, "texts": ["a river"], "embedding_types": ["float"]}),
        ("/v1/rerank", {"model": MODEL, "query": "rivers", "documents": ["a river", "a cat"]}),
        ("/rerank", {"model": MODEL, "query": "rivers", "documents": ["a river", "a cat"]}),
        ("/v2/rerank", {"model": MODEL, "query": "rivers", "documents": ["a river"]}),
        ("/score", {"model": MODEL, "text_1": "rivers", "text_2": ["a river", "a cat"]}),
        ("/v1/score", {"model": MODEL, "text_1": "rivers", "text_2": "a river"}),
        ("/tokenize", {"model": MODEL, "prompt": "Tell me about rivers."}),
        (
            "/v1/chat/completions/batch",
            {"model": MODEL, "max_tokens": 6, "temperature": 0, "messages": [HI, HI[:1]]},
        ),
    ],
)
def test_each_route_answers_as_the_backend_does(
    stack: tuple[SimProcess, GatewayProcess], path: str, body: dict[str, object]
) -> None:
    sim, gw = stack
    direct = _post(sim.url + path, body, {})
    via = _post(gw.url + path, body, P0)
    assert direct.status_code == 200, direct.text
    assert via.status_code == 200, via.text
    assert _without_ids(via.json()) == _without_ids(direct.json())
    assert via.headers["X-Sluice-Priority"] == "0" and "X-Request-Id" in via.headers
    # no key, no answer, on every route
    refused = _post(gw.url + path, body, {})
    assert refused.status_code == 401 and refused.json()["error"]["code"] == "invalid_api_key"


def _wav(seconds: float) -> bytes:
    out = io.BytesIO()
    with wave.open(out, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(16000)
        w.writeframes(b"\0\0" * int(16000 * seconds))
    return out.getvalue()


def test_audio_upload_is_relayed_with_its_form(stack: tuple[SimProcess, GatewayProcess]) -> None:
    sim, gw = stack
    files = {"file": ("speech.wav", _wav(4.0), "audio/wav")}
    for path in ("/v1/audio/transcriptions", "/v1/audio/translations"):
        direct = httpx.post(sim.url + path, data={"model": MODEL}, files=files, timeout=30)
        via = httpx.post(gw.url + path, data={"model": MODEL}, files=files, headers=P0, timeout=30)
        assert via.status_code == direct.status_code == 200, via.text
        assert via.json() == direct.json()
    bad = httpx.post(gw.url + "/v1/audio/transcriptions", data={"model": MODEL}, headers=P0)
    assert bad.status_code == 400 and bad.json()["error"]["code"] == "invalid_request"


def test_anthropic_errors_are_in_anthropics_shape(
    stack: tuple[SimProcess, GatewayProcess],
) -> None:
    _sim, gw = stack
    no_key = httpx.post(gw.url + "/v1/messages", content=b"{}")
    assert no_key.status_code == 401
    assert no_key.json()["type"] == "error"
    assert no_key.json()["error"]["type"] == "authentication_error"
    bad = httpx.post(gw.url + "/v1/messages", content=b"{nope", headers={"x-api-key": "sk-demo-p0"})
    assert bad.status_code == 400
    assert bad.json()["error"]["type"] == "invalid_request_error"
    # an unknown model: Anthropic's not_found_error
    body = {"model": "nope", "max_tokens": 4, "messages": HI}
    missing = httpx.post(gw.url + "/v1/messages", json=body, headers={"x-api-key": "sk-demo-p0"})
    assert missing.status_code == 404 and missing.json()["error"]["type"] == "not_found_error"


def test_realtime_is_refused_with_a_clear_error(stack: tuple[SimProcess, GatewayProcess]) -> None:
    _sim, gw = stack
    answer = httpx.get(gw.url + "/v1/realtime", headers=P0)
    assert answer.status_code == 501
    assert answer.json()["error"]["code"] == "realtime_not_supported"
    assert "/v1/audio/transcriptions" in answer.json()["error"]["message"]


def test_lora_adapters_are_admin_only_and_listed(stack: tuple[SimProcess, GatewayProcess]) -> None:
    _sim, gw = stack
    load = {"lora_name": "river-style", "lora_path": "/adapters/river-style"}
    refused = _post(gw.url + "/v1/load_lora_adapter", load, P0)
    assert refused.status_code == 401 and refused.json()["error"]["code"] == "invalid_admin_key"
    loaded = _post(gw.url + "/v1/load_lora_adapter", load, ADMIN)
    assert loaded.status_code == 200 and loaded.json()["ok"], loaded.text
    cards = {m["id"]: m for m in httpx.get(gw.url + "/v1/models", headers=P0).json()["data"]}
    assert cards["river-style"]["parent"] == MODEL  # the backend's own card, adapter included
    one = httpx.get(gw.url + "/v1/models/river-style", headers=P0)
    assert one.status_code == 200 and one.json()["root"] == "/adapters/river-style"
    # requests for the adapter are routed to the backend that has it
    answer = _post(
        gw.url + "/v1/chat/completions",
        {"model": "river-style", "messages": HI, "max_tokens": 3},
        P0,
    )
    assert answer.status_code == 200 and answer.json()["model"] == "river-style"
    unloaded = _post(gw.url + "/v1/unload_lora_adapter", {"lora_name": "river-style"}, ADMIN)
    assert unloaded.status_code == 200
    assert httpx.get(gw.url + "/v1/models/river-style", headers=P0).status_code == 404


def test_metrics_and_access_log_say_the_route(stack: tuple[SimProcess, GatewayProcess]) -> None:
    _sim, gw = stack
    _post(gw.url + "/v1/embeddings", {"model": MODEL, "input": "x"}, P1)
    _post(
        gw.url + "/v1/messages",
        {"model": MODEL, "max_tokens": 3, "messages": HI},
        {"x-api-key": "sk-demo-p1"},
    )
    m = gw.metrics()
    assert m['sluice_requests_total{outcome="ok",priority="1",route="embeddings"}'] >= 1
    assert m['sluice_requests_total{outcome="ok",priority="1",route="messages"}'] >= 1
    assert m['sluice_request_duration_seconds_count{priority="1",route="messages"}'] >= 1
    deadline = time.monotonic() + 5
    while not any('"route":"messages"' in line for line in gw.output):
        assert time.monotonic() < deadline, "no access record of the messages route"
        time.sleep(0.05)  # the access log is flushed a few times a second


# --- Anthropic's headers, and overload in Anthropic's shape -------------------------------

ANTHROPIC_ANSWER = {
    "id": "msg_1",
    "type": "message",
    "role": "assistant",
    "content": [{"type": "text", "text": "hi"}],
    "model": "fake",
    "stop_reason": "end_turn",
    "usage": {"input_tokens": 3, "output_tokens": 1},
}


async def test_anthropic_headers_go_upstream_and_the_key_does_not() -> None:
    seen: list[dict[str, str | None]] = []
    names = ("anthropic-version", "anthropic-beta", "x-api-key", "Authorization")

    async def messages(request: web.Request) -> web.Response:
        seen.append({h: request.headers.get(h) for h in names})
        return web.json_response(ANTHROPIC_ANSWER)

    async def models(_request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "fake"}]})

    app = web.Application()
    app.router.add_get("/health", _ok)
    app.router.add_get("/v1/models", models)
    app.router.add_post("/v1/messages", messages)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    gw = await asyncio.to_thread(start_gateway, [f"http://127.0.0.1:{runner.addresses[0][1]}"])
    try:
        headers = {
            "x-api-key": "sk-demo-p0",
            "anthropic-version": "2023-06-01",
            "anthropic-beta": "tools-2024-04-04",
        }
        body = orjson.dumps({"model": "fake", "max_tokens": 3, "messages": HI})
        async with (
            aiohttp.ClientSession() as s,
            s.post(gw.url + "/v1/messages", data=body, headers=headers) as r,
        ):
            assert r.status == 200 and (await r.json())["content"][0]["text"] == "hi"
    finally:
        await asyncio.to_thread(gw.stop)
        await runner.cleanup()
    assert seen == [
        {
            "anthropic-version": "2023-06-01",
            "anthropic-beta": "tools-2024-04-04",
            "x-api-key": None,  # the client's key stays with the gateway
            "Authorization": None,
        }
    ]


async def _ok(_request: web.Request) -> web.Response:
    return web.Response()


ONE_SLOT = """
queues:
  - {priority: 0, name: realtime-interactive, maxQueueSize: 1, timeout: 8s, dropPolicy: tail}
  - {priority: 1, name: agent-workflow, maxQueueSize: 1, timeout: 15s, dropPolicy: tail}
  - {priority: 2, name: batch-extraction, maxQueueSize: 1, timeout: 60s, dropPolicy: tail}
tenants:
  - {name: chat-app, apiKeys: [sk-demo-p0], priority: 0}
  - {name: metered, apiKeys: [sk-metered], priority: 0, requestsPerMinute: 1}
limiter: {algorithm: fixed, fixedLimit: 1}
dispatcher: {reserved: {p0: 0.0}}
"""


def _long_stream(url: str) -> httpx.Response:
    return httpx.post(
        url + "/v1/chat/completions",
        json={"model": MODEL, "messages": HI, "max_tokens": 400, "ignore_eos": True},
        headers=P0,
        timeout=60,
    )


async def test_overload_and_quota_in_each_routes_shape(sim_factory: SimFactory) -> None:
    """The only slot taken and the only queue place too: the next request is refused at
    once, as 529 overloaded_error on the Anthropic route and 429 queue_full on the others,
    each with Retry-After; a tenant over its quota is Anthropic's 429 rate_limit_error; and
    the routes outside the queues (tokenize, count_tokens) still answer."""
    sim = sim_factory("--profile", "tiny", "--speed", "0.2")
    gw = await asyncio.to_thread(start_gateway, [sim.url], ONE_SLOT)
    try:
        running = asyncio.ensure_future(asyncio.to_thread(_long_stream, gw.url))
        queued = asyncio.ensure_future(asyncio.to_thread(_long_stream, gw.url))
        await _until(lambda: _queued(gw) >= 1)
        messages = {"model": MODEL, "max_tokens": 3, "messages": HI}
        anthropic_key = {"x-api-key": "sk-demo-p0", "anthropic-version": "2023-06-01"}
        over = await asyncio.to_thread(_post, gw.url + "/v1/messages", messages, anthropic_key)
        assert over.status_code == 529, over.text
        assert over.json()["error"]["type"] == "overloaded_error"
        assert "queue_full" in over.json()["error"]["message"]
        assert int(over.headers["Retry-After"]) >= 1 and "retry-after-ms" in over.headers
        responses = {"model": MODEL, "input": "x", "max_output_tokens": 3}
        full = await asyncio.to_thread(_post, gw.url + "/v1/responses", responses, P0)
        assert full.status_code == 429 and full.json()["error"]["code"] == "queue_full"
        assert int(full.headers["Retry-After"]) >= 1
        embed = {"model": MODEL, "input": "x"}
        full = await asyncio.to_thread(_post, gw.url + "/v1/embeddings", embed, P0)
        assert full.status_code == 429 and full.json()["error"]["code"] == "queue_full"
        # outside the queues: answered while every slot and queue place is taken
        started = time.monotonic()
        tokens = await asyncio.to_thread(
            _post, gw.url + "/tokenize", {"model": MODEL, "prompt": "hi"}, P0
        )
        counted = await asyncio.to_thread(
            _post, gw.url + "/v1/messages/count_tokens", messages, anthropic_key
        )
        assert tokens.status_code == 200 and tokens.json()["count"] > 0
        assert counted.status_code == 200 and counted.json()["input_tokens"] > 0
        assert time.monotonic() - started < 5
        running.cancel()
        queued.cancel()
    finally:
        await asyncio.to_thread(gw.stop)
    # a tenant over its own quota: Anthropic's rate_limit_error
    gw = await asyncio.to_thread(start_gateway, [sim.url], ONE_SLOT)
    try:
        metered = {"x-api-key": "sk-metered"}
        first = await asyncio.to_thread(_post, gw.url + "/v1/messages", messages, metered)
        second = await asyncio.to_thread(_post, gw.url + "/v1/messages", messages, metered)
    finally:
        await asyncio.to_thread(gw.stop)
    assert first.status_code == 200, first.text
    assert second.status_code == 429 and second.json()["error"]["type"] == "rate_limit_error"
    assert int(second.headers["Retry-After"]) >= 1


def _queued(gw: GatewayProcess) -> float:
    return gw.metrics().get('sluice_queue_depth{priority="0"}', 0.0)


async def _until(check: object, within_s: float = 20.0) -> None:
    deadline = time.monotonic() + within_s
    while not await asyncio.to_thread(check):  # type: ignore[arg-type]
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.05)


# --- stored responses ---------------------------------------------------------------------


STORE_POLICY = """
tenants:
  - {name: chat-app, apiKeys: [sk-demo-p0], priority: 0}
  - {name: agents, apiKeys: [sk-demo-p1], priority: 1}
expose: {backendNames: true}  # the test reads X-Sluice-Backend
"""


def test_stored_responses_live_on_the_backend_that_made_them(sim_factory: SimFactory) -> None:
    """Two backends that store responses: each response is fetched, cancelled and
    continued (previous_response_id) on its own backend, and only by its own tenant."""
    sims = [
        sim_factory("--profile", "tiny", "--speed", "4", "--enable-responses-store", "--seed", s)
        for s in ("1", "2")
    ]
    gw = start_gateway([s.url for s in sims], STORE_POLICY)
    try:

        def create(i: int) -> tuple[str, str]:
            body = {"model": MODEL, "input": f"Question {i}", "max_output_tokens": 12}
            answer = _post(gw.url + "/v1/responses", body, P0)
            assert answer.status_code == 200, answer.text
            return answer.json()["id"], answer.headers["X-Sluice-Backend"]

        # at the same time: the least loaded backend takes each, so both make some
        with ThreadPoolExecutor(6) as pool:
            made = list(pool.map(create, range(6)))
        assert len({backend for _, backend in made}) == 2  # both backends made some
        for response_id, _backend in made:
            fetched = httpx.get(gw.url + f"/v1/responses/{response_id}", headers=P0)
            assert fetched.status_code == 200 and fetched.json()["id"] == response_id
            # another tenant does not see it
            other = httpx.get(gw.url + f"/v1/responses/{response_id}", headers=P1)
            assert other.status_code == 404
            assert other.json()["error"]["code"] == "response_not_found"
            # cancel reaches its backend: vLLM's answer for a response that is not running
            cancel = httpx.post(gw.url + f"/v1/responses/{response_id}/cancel", headers=P0)
            assert cancel.status_code == 400, cancel.text
            assert "Cannot cancel a synchronous response" in cancel.json()["error"]["message"]
            # a continuation runs where the response it continues is stored
            follow = {
                "model": MODEL,
                "input": "And then?",
                "previous_response_id": response_id,
                "max_output_tokens": 3,
            }
            continued = _post(gw.url + "/v1/responses", follow, P0)
            assert continued.status_code == 200, continued.text
            assert continued.headers["X-Sluice-Backend"] == _backend
        unknown = httpx.get(gw.url + "/v1/responses/resp_nothing", headers=P0)
        assert unknown.status_code == 404
    finally:
        gw.stop()


FALLBACK_POLICY = """
tenants:
  - {name: chat-app, apiKeys: [sk-demo-p0], priority: 0}
features:
  - name: summarize
    core: false
    fallback: {static: "Summaries are paused for a moment."}
"""


def test_static_fallback_in_each_routes_own_shape(sim_factory: SimFactory) -> None:
    """A non-core feature whose backends are gone answers from its static text, in the
    shape each route's SDK parses (stream and not); a route no text can stand in for (an
    embedding) gets a 503 with Retry-After instead."""
    import anthropic
    import openai

    sim = sim_factory("--profile", "tiny")
    gw = start_gateway([sim.url], FALLBACK_POLICY)
    feature = {"X-Sluice-Feature": "summarize"}
    text = "Summaries are paused for a moment."
    try:
        sim.kill()  # every backend gone: non-core features are held on their fallback
        deadline = time.monotonic() + 10
        while httpx.get(gw.url + "/readyz").status_code == 200:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        oai = openai.OpenAI(
            base_url=gw.url + "/v1", api_key="sk-demo-p0", max_retries=0, default_headers=feature
        )
        answer = oai.responses.create(model=MODEL, input="Summarise this.")
        assert answer.output_text == text and answer.status == "completed"
        with oai.responses.stream(model=MODEL, input="Summarise this.") as stream:
            kinds = [event.type for event in stream]
            assert stream.get_final_response().output_text == text
        assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
        ant = anthropic.Anthropic(
            base_url=gw.url, api_key="sk-demo-p0", max_retries=0, default_headers=feature
        )
        ask = {"model": MODEL, "max_tokens": 50, "messages": [{"role": "user", "content": "x"}]}
        message = ant.messages.create(**ask)  # type: ignore[arg-type]
        assert message.content[0].text == text and message.stop_reason == "end_turn"  # type: ignore[union-attr]
        with ant.messages.stream(**ask) as events:  # type: ignore[arg-type]
            assert events.get_final_text() == text
        embed = _post(gw.url + "/v1/embeddings", {"model": MODEL, "input": "x"}, P0 | feature)
        assert embed.status_code == 503 and embed.json()["error"]["code"] == "feature_degraded"
        assert int(embed.headers["Retry-After"]) >= 1
    finally:
        gw.stop()
