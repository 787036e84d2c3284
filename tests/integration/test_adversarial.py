"""The standing adversarial suite (issue 14): real processes on loopback (`sluice serve`,
two `sluice sim`, a password-protected redis-server, a backend that fails on purpose),
every attack bounded in time, and through every one of them other tenants' streams
running in the background (`Background`), which must all finish intact: 200, every
token, `data: [DONE]`.

What it attacks, and the issue's item each test reproduces (each fails on the main
before the hardening):
  1 a client closing after `data: [DONE]`      7 malformed header lines (keys in the log)
  2 GET /health                                8 Redis killed (its password in the log)
  3 a policy written in two parts, or empty    9 a backend down when the gateway starts
  4 a policy file that is not UTF-8           11 unknown routes, 405, the parser's 400s
  5 max_tokens of 10^7 and 2^63-1 with Redis  12 backend names, error texts, dashboard,
  6 a prompt larger than any KV cache            breakers across a reload
plus what held before and must keep holding: malformed and deeply nested JSON, bodies
over the limit, request smuggling, slowloris, idle connections, clients that never read,
a backend killed mid-stream, and the connection limit. (Item 10, the estimate of tools
and n, is a unit test: tests/unit/test_gateway_parsing.py.)"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import threading
import time
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
from aiohttp import web
from conftest import SimProcess, start_sim
from gateway_proc import GatewayProcess, start_gateway
from redis_proc import REDIS_SERVER, RedisServer

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(REDIS_SERVER is None, reason="redis-server is missing"),
]

REDIS_PASSWORD = "redis-pw-Zq81x"
KEYS = {
    "chat": "sk-adv-chat-4Rk9",
    "agents": "sk-adv-agents-8Tb2",
    "other": "sk-adv-other-3Pw7",
    "metered": "sk-adv-metered-6Ly5",
    "admin": "sk-adv-admin-1Mv3",
}
SECRETS = [*KEYS.values(), REDIS_PASSWORD]
STREAM_TOKENS = 24

POLICY = """
tenants:
  - {{name: chat, apiKeys: [{chat}], priority: 0}}
  - {{name: agents, apiKeys: [{agents}], priority: 1}}
  - {{name: other, apiKeys: [{other}], priority: 1}}
  - {{name: metered, apiKeys: [{metered}], priority: 1, tokensPerMinute: 100000}}
{extra_tenants}
admin: {{apiKeys: [{admin}]}}
backends:
  - {{name: sim-a, url: "{sim_a}"}}
  - {{name: sim-b, url: "{sim_b}", models: [victim]}}
  - {{name: broken, url: "{broken}", models: [broken]}}
redis: {{url: "{redis}"}}
features:
  - {{name: flaky, core: false, fallback: {{static: "paused"}}}}
breakers: {{minRequests: 3, openFor: 60s}}
server: {{headerTimeout: 1s, readTimeout: 2s, maxBodyBytes: 1048576}}
"""


def _auth(tenant: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {KEYS[tenant]}"}


# -- a backend that fails on purpose ------------------------------------------------------


class BrokenBackend:
    """Passes its health checks, serves the model `broken`, and answers every completion
    500 with internals in the text (a traceback, a private host:port)."""

    LEAK = "Traceback (most recent call last): worker at 10.9.8.7:8000 died"

    def __init__(self) -> None:
        self.url = ""
        self.calls = 0  # completions it was sent
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> None:
        self._thread.start()
        assert self._ready.wait(10)

    def stop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        app = web.Application()
        app.router.add_get("/health", _empty)
        app.router.add_get("/metrics", _empty)
        app.router.add_get("/v1/models", _broken_models)
        app.router.add_post("/v1/chat/completions", self._fail)
        runner = web.AppRunner(app, access_log=None)
        self._loop.run_until_complete(runner.setup())
        site = web.TCPSite(runner, "127.0.0.1", 0)
        self._loop.run_until_complete(site.start())
        self.url = f"http://127.0.0.1:{runner.addresses[0][1]}"
        self._ready.set()
        self._loop.run_forever()

    async def _fail(self, request: web.Request) -> web.Response:
        self.calls += 1
        await request.read()
        return web.json_response({"error": {"message": self.LEAK}}, status=500)


async def _empty(_request: web.Request) -> web.Response:
    return web.Response()


async def _broken_models(_request: web.Request) -> web.Response:
    return web.json_response({"object": "list", "data": [{"id": "broken"}]})


# -- other tenants' streams, running through every attack ----------------------------------


@dataclass
class Background:
    """Streams of the `chat` (P0) and `agents` (P1) tenants, back to back on a few
    connections, each checked whole: 200, STREAM_TOKENS content events, usage, [DONE]."""

    url: str
    workers: int = 3
    keys: dict[str, str] = field(default_factory=lambda: dict(KEYS))
    done: Counter[str] = field(default_factory=Counter)
    broken: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._stop = threading.Event()
        self._started = threading.Event()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._run()), daemon=True)

    def __enter__(self) -> Background:
        self._thread.start()
        assert self._started.wait(10), "background streams did not start"
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(30)
        assert not self._thread.is_alive(), "background streams did not finish"
        assert not self.broken, self.broken[:3]
        assert sum(self.done.values()) >= self.workers, self.done

    async def _run(self) -> None:
        limits = httpx.Limits(max_connections=self.workers)
        async with httpx.AsyncClient(timeout=20.0, limits=limits) as client:
            await asyncio.gather(*(self._worker(client, i) for i in range(self.workers)))

    async def _worker(self, client: httpx.AsyncClient, i: int) -> None:
        tenant = "chat" if i == 0 else "agents"
        while not self._stop.is_set():
            try:
                problem = await self._one(client, tenant)
            except httpx.HTTPError as exc:
                problem = f"{tenant}: {exc!r}"
            if problem:
                self.broken.append(problem)
            else:
                self.done[tenant] += 1

    async def _one(self, client: httpx.AsyncClient, tenant: str) -> str | None:
        body = {
            "model": "sluice-sim",
            "stream": True,
            "max_tokens": STREAM_TOKENS,
            "ignore_eos": True,
            "stream_options": {"include_usage": True},
            "messages": [{"role": "user", "content": "a steady stream " * 8}],
        }
        auth = {"Authorization": f"Bearer {self.keys[tenant]}"}
        async with client.stream(
            "POST", self.url + "/v1/chat/completions", json=body, headers=auth
        ) as r:
            self._started.set()
            if r.status_code != 200:
                return f"{tenant}: HTTP {r.status_code} {(await r.aread())[:200]!r}"
            events = [line async for line in r.aiter_lines() if line.startswith("data: ")]
        content = [e for e in events if '"content"' in e and '"delta"' in e]
        if events[-1:] != ["data: [DONE]"] or len(content) < STREAM_TOKENS:
            return f"{tenant}: cut stream ({len(content)} tokens, last {events[-1:]})"
        if not any('"usage"' in e and '"completion_tokens":24' in e for e in events):
            return f"{tenant}: no usage"
        return None


# -- the stack ----------------------------------------------------------------------------


@dataclass
class Stack:
    gw: GatewayProcess
    sim_a: SimProcess
    sim_b: SimProcess
    redis: RedisServer
    broken: BrokenBackend
    policy_path: Path
    fields: dict[str, str]

    def policy(self, extra_tenants: str = "") -> str:
        return POLICY.format(**self.fields, extra_tenants=extra_tenants)

    def metric(self, name: str) -> float:
        return self.gw.metrics().get(name, 0.0)

    def log(self) -> str:
        return "\n".join(self.gw.output)


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    folder = tmp_path_factory.mktemp("adversarial")
    redis_server = RedisServer(folder, password=REDIS_PASSWORD)
    broken = BrokenBackend()
    with ThreadPoolExecutor(4) as pool:  # started side by side: a few seconds saved
        a = pool.submit(start_sim, "--profile", "tiny", "--speed", "4")
        b = pool.submit(start_sim, "--profile", "tiny", "--speed", "4", "--model", "victim")
        pool.submit(redis_server.start).result()
        pool.submit(broken.start).result()
        sim_a, sim_b = a.result(), b.result()
    fields = {
        **KEYS,
        "sim_a": sim_a.url,
        "sim_b": sim_b.url,
        "broken": broken.url,
        "redis": redis_server.url,
    }
    path = folder / "policy.yaml"
    path.write_text(POLICY.format(**fields, extra_tenants=""))
    gw = start_gateway([], None, "--config", str(path), "--log-format", "json")
    # the scrape has told the gateway sim-a's KV cache (for the large-prompt attack)
    deadline = time.monotonic() + 10
    while (
        "sim-a" not in _admin_state(gw)["controller"]["backends"]
        or not (_admin_state(gw)["controller"]["backends"]["sim-a"]["metrics_fresh"])
    ):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    yield Stack(gw, sim_a, sim_b, redis_server, broken, path, fields)
    gw.stop()
    output = "\n".join(gw.output)
    for s in (sim_a, sim_b):
        s.stop()
    broken.stop()
    redis_server.kill()
    # no configured key nor the Redis password ever reached the gateway's log
    leaked = [s for s in SECRETS if s in output]
    assert not leaked, leaked


def _admin_state(gw: GatewayProcess) -> dict[str, Any]:
    r = httpx.get(gw.url + "/admin/state", headers=_auth("admin"), timeout=5)
    return dict(r.json())


def _chat(model: str = "sluice-sim", **fields: Any) -> dict[str, Any]:
    body = {"model": model, "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}
    return {**body, **fields}


def _openai_error(r: httpx.Response) -> dict[str, Any]:
    assert r.headers["content-type"].startswith("application/json"), r.text
    err = r.json()["error"]
    assert isinstance(err["message"], str) and err["message"] and "type" in err
    return dict(err)


def _raw(gw: GatewayProcess, data: bytes, timeout: float = 5.0) -> bytes:
    """Send raw bytes, return everything answered until the gateway closes (or timeout)."""
    host, port = gw.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=timeout) as s:
        s.sendall(data)
        out = b""
        with contextlib.suppress(TimeoutError, ConnectionResetError):
            while chunk := s.recv(65536):
                out += chunk
    return out


# -- 1: a client that closes right after [DONE] -------------------------------------------


def test_clients_closing_after_done_never_take_the_backend_out(stack: Stack) -> None:
    """httpx leaving `client.stream()` on `data: [DONE]` (guidellm does the same) closes
    before the chunked terminator: 4 clients x 25 such requests, one at a time each,
    0 non-200, the backend never out of service, no upstream error counted.
    (`bench/adversarial/done_close.py` runs 1,000.)"""
    errors_before = stack.metric("sluice_upstream_errors_total")
    statuses: Counter[int] = Counter()

    def client() -> None:
        with httpx.Client(timeout=10) as c:
            for _ in range(25):
                body = _chat(stream=True, max_tokens=4)
                with c.stream(
                    "POST", stack.gw.url + "/v1/chat/completions", json=body, headers=_auth("other")
                ) as r:
                    statuses[r.status_code] += 1
                    for line in r.iter_lines():
                        if line == "data: [DONE]":
                            break  # and leave at once, as guidellm does

    with Background(stack.gw.url):
        clients = [threading.Thread(target=client) for _ in range(4)]
        for t in clients:
            t.start()
        for t in clients:
            t.join(60)
    assert statuses == Counter({200: 100})
    assert stack.metric("sluice_upstream_errors_total") == errors_before
    assert stack.metric('sluice_backend_healthy{backend="sim-a"}') == 1


# -- 2: /health as the engines answer it --------------------------------------------------


def test_health_answers_as_the_engines_do(stack: Stack) -> None:
    r = httpx.get(stack.gw.url + "/health", timeout=5)
    assert (r.status_code, r.content) == (200, b"")


# -- 3, 4: policies that would lock everybody out, or cannot be read -----------------------


def _write_in_place(path: Path, data: bytes) -> None:
    with open(path, "r+b") as f:  # as an editor, `kubectl cp` or `cat >` do
        f.truncate(0)
        f.write(data)
        f.flush()


def test_a_policy_written_in_two_parts_or_empty_locks_nobody_out(stack: Stack) -> None:
    refused = stack.metric('sluice_policy_reloads_total{result="refused"}')
    ok = stack.metric('sluice_policy_reloads_total{result="ok"}')
    seen: Counter[int] = Counter()
    stop = threading.Event()

    def probe() -> None:
        with httpx.Client(timeout=5) as c:
            while not stop.is_set():
                seen[c.get(stack.gw.url + "/v1/models", headers=_auth("agents")).status_code] += 1
                admin = c.get(stack.gw.url + "/admin/state", headers=_auth("admin"))
                seen[admin.status_code] += 1
                time.sleep(0.05)

    prober = threading.Thread(target=probe)
    with Background(stack.gw.url):
        prober.start()
        data = stack.policy(extra_tenants="  - {name: late, apiKeys: [sk-adv-late-0]}").encode()
        _write_in_place(stack.policy_path, data[: len(data) // 3])
        time.sleep(0.8)
        _write_in_place(stack.policy_path, data)
        _wait(lambda: stack.metric('sluice_policy_reloads_total{result="ok"}') > ok, 6)
        _replace(stack.policy_path, b"")  # an empty file: refused
        _wait(lambda: stack.metric('sluice_policy_reloads_total{result="refused"}') > refused, 6)
        time.sleep(0.3)
        stop.set()
        prober.join()
    assert set(seen) == {200}, seen
    assert stack.metric('sluice_policy_reloads_total{result="ok"}') == ok + 1  # once, whole
    assert stack.metric("sluice_policy_last_reload_ok") == 0
    late = httpx.get(stack.gw.url + "/v1/models", headers={"Authorization": "Bearer sk-adv-late-0"})
    assert late.status_code == 200
    _restore(stack)


def test_a_policy_that_is_not_utf8_is_refused_and_reload_lives_on(stack: Stack) -> None:
    refused = stack.metric('sluice_policy_reloads_total{result="refused"}')
    with Background(stack.gw.url):
        _replace(stack.policy_path, stack.policy().encode() + b"# caf\xe9\n")
        _wait(lambda: stack.metric('sluice_policy_reloads_total{result="refused"}') > refused, 6)
        assert stack.metric("sluice_policy_last_reload_ok") == 0
        r = httpx.post(stack.gw.url + "/admin/reload", headers=_auth("admin"), timeout=5)
        assert r.status_code == 422 and "not UTF-8" in r.json()["errors"][0], r.text
        # the watcher lives on: the next good file is applied
        _restore(stack, extra_tenants="  - {name: later, apiKeys: [sk-adv-later-0]}")
    auth = {"Authorization": "Bearer sk-adv-later-0"}
    assert httpx.get(stack.gw.url + "/v1/models", headers=auth).status_code == 200
    _restore(stack)


def _replace(path: Path, data: bytes) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)  # whole (a new inode): read at the next poll


def _restore(stack: Stack, extra_tenants: str = "") -> None:
    ok = stack.metric('sluice_policy_reloads_total{result="ok"}')
    _replace(stack.policy_path, stack.policy(extra_tenants).encode())
    _wait(lambda: stack.metric('sluice_policy_reloads_total{result="ok"}') > ok, 5)
    assert stack.metric("sluice_policy_last_reload_ok") == 1


def _wait(condition: Any, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


# -- 5: one request must not lock its tenant out (Redis quotas) ----------------------------


@pytest.mark.parametrize("max_tokens", [10_000_000, 2**63 - 1])
def test_a_huge_max_tokens_refused_by_the_backend_costs_its_tenant_nothing(
    stack: Stack, max_tokens: int
) -> None:
    client = stack.redis.client()
    key = "{sluice:tenant:metered}:rate"
    with Background(stack.gw.url), httpx.Client(timeout=10) as c:
        url = stack.gw.url + "/v1/chat/completions"
        huge = c.post(url, json=_chat(max_tokens=max_tokens), headers=_auth("metered"))
        assert huge.status_code == 400, huge.text  # the backend's: longer than the model
        ttl = client.pttl(key)
        level = float(client.hget(key, "tl") or 100_000)
        assert ttl <= 121_000 and level >= -100_000, (ttl, level)
        time.sleep(0.1)  # the give-back is flushed within 20 ms
        after = c.post(url, json=_chat(), headers=_auth("metered"))
        assert after.status_code == 200, after.text


# -- 6: a prompt no backend can hold ------------------------------------------------------


def test_a_prompt_larger_than_any_kv_cache_is_refused_at_once(stack: Stack) -> None:
    prompt = "lorem ipsum dolor sit amet " * 30_000  # 810 kB, ~200k tokens; tiny holds 4,096
    with Background(stack.gw.url):
        t0 = time.monotonic()
        r = httpx.post(
            stack.gw.url + "/v1/chat/completions",
            json=_chat(messages=[{"role": "user", "content": prompt}]),
            headers=_auth("other"),
            timeout=20,
        )
        took = time.monotonic() - t0
    assert r.status_code == 400 and "retry-after" not in r.headers
    assert _openai_error(r)["code"] == "context_length_exceeded"
    assert took < 2.0


# -- 7: malformed header lines --------------------------------------------------------------


def test_malformed_header_lines_never_put_a_key_in_the_log(stack: Stack) -> None:
    before = len(stack.gw.output)
    key = KEYS["agents"].encode()
    bad = b"GET /v1/models HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + key + b"\x01\r\n\r\n"
    with Background(stack.gw.url):
        answers = [_raw(stack.gw, bad) for _ in range(100)]
    assert all(a.startswith(b"HTTP/1.") and b" 400 " in a.split(b"\r\n")[0] for a in answers)
    assert all(b'"code":"invalid_request"' in a and key not in a for a in answers)
    time.sleep(0.5)
    new = stack.gw.output[before:]
    assert not [line for line in new if KEYS["agents"] in line]
    assert len([line for line in new if "malformed" in line]) <= 1  # once a minute
    assert stack.metric('sluice_malformed_requests_total{status="400"}') >= 100


# -- 11: every error in OpenAI's shape, unknown routes never forwarded ----------------------


def test_every_error_is_in_openai_shape_and_unknown_routes_stay_here(stack: Stack) -> None:
    with Background(stack.gw.url), httpx.Client(timeout=5) as c:
        unknown = c.post(stack.gw.url + "/v1/embeddingz", json={}, headers=_auth("agents"))
        assert unknown.status_code == 404 and _openai_error(unknown)["code"] == "unknown_route"
        wrong = c.get(stack.gw.url + "/v1/chat/completions", headers=_auth("agents"))
        assert wrong.status_code == 405 and wrong.headers["allow"] == "POST"
        assert _openai_error(wrong)["code"] == "method_not_allowed"
        big = c.post(
            stack.gw.url + "/v1/chat/completions",
            content=b"{" + b" " * 1_100_000 + b"}",
            headers={**_auth("agents"), "Content-Type": "application/json"},
        )
        assert big.status_code == 413 and _openai_error(big)["code"] == "body_too_large"
        for body in (b"{not json", b"[" * 100_000 + b"]" * 100_000, b'{"model": 3}'):
            r = c.post(stack.gw.url + "/v1/chat/completions", content=body, headers=_auth("agents"))
            assert r.status_code == 400 and _openai_error(r)["code"] == "invalid_request"
    for raw in (
        b"GARBAGE\r\n\r\n",
        b"GET /v1/models HTTP/1.1\r\nHost: x\r\nX: " + b"a" * 10_000 + b"\r\n\r\n",
        # request smuggling: both a length and chunked
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 4\r\n"
        b"Transfer-Encoding: chunked\r\n\r\n0\r\n\r\nGET /admin/state HTTP/1.1\r\n\r\n",
    ):
        answer = _raw(stack.gw, raw)
        head, _, body = answer.partition(b"\r\n\r\n")
        assert b" 400 " in head.split(b"\r\n")[0], answer[:200]
        assert orjson.loads(body)["error"]["code"] == "invalid_request"
        assert answer.count(b"HTTP/1.") == 1  # nothing smuggled behind it was answered


# -- 12: what an anonymous client sees ------------------------------------------------------


def test_anonymous_clients_see_no_internals(stack: Stack) -> None:
    with Background(stack.gw.url), httpx.Client(timeout=10) as c:
        ok = c.post(stack.gw.url + "/v1/chat/completions", json=_chat(), headers=_auth("agents"))
        assert ok.status_code == 200 and "x-sluice-backend" not in ok.headers
        state = c.get(stack.gw.url + "/dashboard/state").text
        for name in ("agents", "chat", "metered", "sim-a", "sim-b", "victim", "broken"):
            assert f'"{name}"' not in state, name
        full = c.get(stack.gw.url + "/dashboard/state", headers=_auth("admin")).json()
        assert "sim-a" in full["controller"]["backends"]
        # a backend's 500 with a traceback and a host:port: the client is told the kind
        failed = c.post(
            stack.gw.url + "/v1/chat/completions", json=_chat("broken"), headers=_auth("chat")
        )
    assert failed.status_code == 502, failed.text
    text = failed.text
    for leak in ("Traceback", "10.9.8.7", "127.0.0.1", stack.broken.url, "broken"):
        assert leak not in text.replace('"model":"broken"', ""), (leak, text)


def test_a_feature_breaker_stays_open_across_a_reload(stack: Stack) -> None:
    url = stack.gw.url + "/v1/chat/completions"
    gauge = 'sluice_breaker_open{kind="feature",name="flaky"}'
    flaky = {**_auth("chat"), "X-Sluice-Feature": "flaky"}
    with Background(stack.gw.url), httpx.Client(timeout=10) as c:
        for _ in range(20):  # the backend's 500s open the feature's breaker
            if stack.metric(gauge) == 1:
                break
            c.post(url, json=_chat("broken"), headers=flaky)
        assert stack.metric(gauge) == 1
        r = c.post(stack.gw.url + "/admin/reload", headers=_auth("admin"))
        assert r.status_code == 200, r.text
        assert stack.metric(gauge) == 1
        calls = stack.broken.calls
        answer = c.post(url, json=_chat("broken"), headers=flaky)
    assert answer.status_code == 200 and answer.headers.get("x-sluice-fallback") == "static"
    assert stack.broken.calls == calls  # answered by the open breaker, not after a 500


# -- held before, must keep holding ---------------------------------------------------------


def test_slowloris_idle_and_never_reading_clients_stall_nobody(stack: Stack) -> None:
    host, port = stack.gw.url.removeprefix("http://").split(":")
    with Background(stack.gw.url) as bg:
        idle = [socket.create_connection((host, int(port))) for _ in range(50)]
        trickle = socket.create_connection((host, int(port)))
        trickle.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n")
        # a client that asks for a long stream and never reads it
        deaf = socket.create_connection((host, int(port)))
        body = orjson.dumps(_chat(stream=True, max_tokens=1500, ignore_eos=True))
        deaf.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
            + b"\r\nAuthorization: Bearer "
            + KEYS["other"].encode()
            + b"\r\nContent-Length: "
            + str(len(body)).encode()
            + b"\r\n\r\n"
            + body
        )
        t0 = time.monotonic()
        trickle.settimeout(5)
        assert trickle.recv(100) == b""  # cut after headerTimeout (1 s)
        assert time.monotonic() - t0 < 4
        time.sleep(1.0)
        done = sum(bg.done.values())
    assert done > 0
    for s in [*idle, trickle, deaf]:
        s.close()


def test_a_backend_killed_mid_stream_ends_that_stream_visibly_and_nothing_else(
    stack: Stack,
) -> None:
    with Background(stack.gw.url), httpx.Client(timeout=10) as c:
        body = _chat("victim", stream=True, max_tokens=1500, ignore_eos=True)
        with c.stream(
            "POST", stack.gw.url + "/v1/chat/completions", json=body, headers=_auth("other")
        ) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            next(line for line in lines if line.startswith("data: "))
            stack.sim_b.kill()
            rest = [line for line in lines if line.startswith("data: ")]
    error = orjson.loads(next(x for x in rest if x.startswith('data: {"error"'))[6:])["error"]
    assert error["code"] == "upstream_error" and rest[-1] == "data: [DONE]"
    assert stack.sim_b.url.removeprefix("http://") not in error["message"]


def test_redis_killed_serves_on_and_its_password_never_reaches_the_log(stack: Stack) -> None:
    with Background(stack.gw.url), httpx.Client(timeout=10) as c:
        stack.redis.kill()
        _wait(lambda: stack.metric('sluice_quota_backend{mode="local"}') == 1, 10)
        r = c.post(stack.gw.url + "/v1/chat/completions", json=_chat(), headers=_auth("metered"))
        assert r.status_code == 200
    assert "is not answering" in stack.log()
    assert REDIS_PASSWORD not in stack.log()


# -- 9 and the connection limit: gateways of their own -----------------------------------


def test_a_model_on_a_backend_down_at_start_is_a_503_not_a_404(tmp_path: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    gw = start_gateway([url], None, wait_ready=False)
    sim = None
    try:
        r = httpx.post(
            gw.url + "/v1/chat/completions",
            json=_chat(),
            headers={"Authorization": "Bearer sk-demo-p1"},
            timeout=5,
        )
        assert r.status_code == 503 and int(r.headers["retry-after"]) >= 1, r.text
        assert _openai_error(r)["code"] == "no_backend"
        sim = start_sim("--profile", "tiny", "--port", str(port))
        _wait(lambda: httpx.get(gw.url + "/health").status_code == 200, 10)
        r = httpx.post(
            gw.url + "/v1/chat/completions",
            json=_chat(),
            headers={"Authorization": "Bearer sk-demo-p1"},
            timeout=5,
        )
        assert r.status_code == 200
        unknown = httpx.post(
            gw.url + "/v1/chat/completions",
            json=_chat("no-such-model"),
            headers={"Authorization": "Bearer sk-demo-p1"},
            timeout=5,
        )
        assert unknown.status_code == 404  # every backend's models known now
    finally:
        gw.stop()
        if sim is not None:
            sim.stop()


def test_connections_past_the_limit_get_a_503_and_the_others_carry_on(stack: Stack) -> None:
    policy = (
        "tenants: [{name: chat, apiKeys: [sk-demo-p0], priority: 0},"
        " {name: agents, apiKeys: [sk-demo-p1], priority: 1}]\n"
        "server: {maxConnections: 12}\n"
    )
    gw = start_gateway([stack.sim_a.url], policy)
    host, port = gw.url.removeprefix("http://").split(":")
    held: list[socket.socket] = []
    try:
        keys = {"chat": "sk-demo-p0", "agents": "sk-demo-p1"}
        with Background(gw.url, workers=2, keys=keys):
            time.sleep(0.3)  # the streams hold their connections
            held = [socket.create_connection((host, int(port))) for _ in range(10)]
            answer = _raw(gw, b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            time.sleep(0.3)
        head, _, body = answer.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 503") and b"Retry-After: 1" in head, answer
        assert orjson.loads(body)["error"]["code"] == "too_many_connections"
        held.pop().close()
        time.sleep(0.2)
        r = httpx.get(gw.url + "/health", timeout=5)
        assert r.status_code == 200
        assert gw.metrics()["sluice_connections_refused_total"] >= 1
    finally:
        for s in held:
            s.close()
        gw.stop()
