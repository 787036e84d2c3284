"""The gateway keeps no client state between requests on its shared upstream connections.

Every tenant's request travels over the same pooled aiohttp session. A backend, or a load
balancer in front of it, that sets a cookie (sticky sessions do) must not have that cookie
stored by the gateway and replayed on other tenants' requests, nor see a client's own
cookies or credentials: the gateway sends the backend its own headers only (and the W3C
trace context, so that a traced backend's spans join the client's trace), and relays the
backend's answer without its Set-Cookie."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
import orjson
import pytest
from aiohttp import web
from gateway_proc import start_gateway

pytestmark = pytest.mark.integration

MODEL = "cookie-model"
ANSWER = {
    "id": "x",
    "object": "chat.completion",
    "model": MODEL,
    "choices": [{"index": 0, "message": {"role": "assistant", "content": "hi"}}],
    "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4},
}


BODY = orjson.dumps(
    {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
)
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


async def _health(_request: web.Request) -> web.Response:
    return web.Response()


async def _models(_request: web.Request) -> web.Response:
    return web.json_response({"object": "list", "data": [{"id": MODEL, "object": "model"}]})


async def _start_backend(
    completion: Handler, middlewares: tuple[Any, ...] = ()
) -> tuple[web.AppRunner, int]:
    """A fake backend on 127.0.0.1 (on the test's loop): /health, /v1/models, and
    `completion` for chat completions; returns its runner and port."""
    app = web.Application(middlewares=middlewares)
    app.router.add_get("/health", _health)
    app.router.add_get("/v1/models", _models)
    app.router.add_post("/v1/chat/completions", completion)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    return runner, runner.addresses[0][1]


FORWARDED = ("Cookie", "Authorization", "X-Api-Key", "traceparent", "tracestate")
TRACE = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


async def test_backend_cookies_are_neither_stored_nor_relayed() -> None:
    seen: list[dict[str, str | None]] = []  # what each completion request carried

    async def completion(request: web.Request) -> web.Response:
        seen.append({h: request.headers.get(h) for h in FORWARDED})
        response = web.json_response(ANSWER)
        response.set_cookie("lb", f"sticky-{len(seen)}", path="/")
        return response

    runner, port = await _start_backend(completion)
    # a host name, not an IP address: aiohttp's cookie jar ignores cookies from IP hosts
    backend = f"http://localhost:{port}"
    # in a thread: the backend on this loop must answer the gateway's start-up checks
    gw = await asyncio.to_thread(start_gateway, [backend])
    try:
        answers = []
        async with aiohttp.ClientSession(cookie_jar=aiohttp.DummyCookieJar()) as s:
            for key in ("sk-demo-p0", "sk-demo-p1", "sk-demo-p2", "sk-demo-p0"):
                headers = {
                    "Authorization": f"Bearer {key}",
                    "Content-Type": "application/json",
                    "Cookie": f"session=client-of-{key}",
                    "X-Api-Key": key,
                }
                if key == "sk-demo-p2":  # W3C trace context is passed on, and only it
                    headers |= {"traceparent": TRACE, "tracestate": "vendor=1"}
                async with s.post(gw.url + "/v1/chat/completions", data=BODY, headers=headers) as r:
                    answers.append((r.status, r.headers.getall("Set-Cookie", [])))
    finally:
        await asyncio.to_thread(gw.stop)
        await runner.cleanup()

    assert [status for status, _ in answers] == [200] * 4
    assert all(cookies == [] for _, cookies in answers), answers
    assert len(seen) == 4
    # no backend cookie replayed, no client cookie or API key passed on; a trace context is
    nothing = dict.fromkeys(FORWARDED)
    traced = nothing | {"traceparent": TRACE, "tracestate": "vendor=1"}
    assert seen == [nothing, nothing, traced, nothing], seen


KEY_ENV = "SLUICE_TEST_BACKEND_KEY"


def _policy_with_key(url: str, models: str = "") -> str:
    return f"""
tenants:
  - {{name: chat-app, apiKeys: [sk-demo-p0], priority: 0}}
backends:
  - {{name: keyed, url: "{url}", apiKeyEnv: {KEY_ENV}{models}}}
"""


async def test_a_backend_with_an_api_key_gets_the_gateways_key(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """vLLM started with --api-key guards its /v1 routes (not /health, /metrics): the
    gateway sends the key from backends[].apiKeyEnv there, including for model discovery;
    a wrong key is the gateway's misconfiguration, a 502 no client can fix, not a 401."""
    required = "Bearer backend-s3cret"
    seen: list[str | None] = []

    @web.middleware
    async def guard(request: web.Request, handler):  # type: ignore[no-untyped-def]
        if request.path.startswith("/v1"):
            seen.append(request.headers.get("Authorization"))
            if request.headers.get("Authorization") != required:
                return web.json_response({"error": "Unauthorized"}, status=401)
        return await handler(request)

    ids: list[str | None] = []

    async def completion(request: web.Request) -> web.Response:
        ids.append(request.headers.get("X-Request-Id"))
        return web.json_response(ANSWER)

    runner, port = await _start_backend(completion, (guard,))
    url = f"http://127.0.0.1:{port}"
    policy = _policy_with_key(url)
    client = {"Authorization": "Bearer sk-demo-p0", "Content-Type": "application/json"}
    try:
        # without the variable the gateway refuses to start, naming the field and variable
        monkeypatch.delenv(KEY_ENV, raising=False)
        with pytest.raises(RuntimeError) as refused:
            await asyncio.to_thread(start_gateway, [], policy, timeout=10.0)
        assert f"backends.0.apiKeyEnv: the environment variable {KEY_ENV}" in str(refused.value)

        answers = {}
        for key in ("backend-s3cret", "a-wrong-key"):
            monkeypatch.setenv(KEY_ENV, key)
            # with a wrong key no model can be discovered: name it, so the request is tried
            known = "" if key == "backend-s3cret" else f", models: [{MODEL}]"
            gw = await asyncio.to_thread(start_gateway, [], _policy_with_key(url, known))
            try:
                async with aiohttp.ClientSession() as s:
                    async with s.get(gw.url + "/v1/models", headers=client) as r:
                        models_seen = [m["id"] for m in (await r.json())["data"]]
                    async with s.post(
                        gw.url + "/v1/chat/completions", data=BODY, headers=client
                    ) as r:
                        answers[key] = (r.status, await r.json())
                        gateway_ids = [r.headers["X-Request-Id"]]
            finally:
                await asyncio.to_thread(gw.stop)
            output = "\n".join(gw.output)
            assert key not in output, "the backend's key was logged"
            if key == "backend-s3cret":
                assert models_seen == [MODEL]  # discovered through the guarded route
                # the backend got the gateway's request id (vLLM makes it its own)
                assert ids == gateway_ids
            else:
                assert "backend keyed refuses the gateway's credentials (HTTP 401)" in output
    finally:
        await runner.cleanup()

    assert answers["backend-s3cret"][0] == 200
    assert required in seen
    status, error = answers["a-wrong-key"]
    assert status == 502 and error["error"]["code"] == "upstream_auth", error
    assert "Bearer sk-demo-p0" not in seen  # the client's key never reaches the backend
