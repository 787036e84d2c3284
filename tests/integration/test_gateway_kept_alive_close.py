"""A backend that closes a kept-alive connection just as a request goes out on it.

llama.cpp's HTTP server (cpp-httplib) closes its idle kept-alive connections on its own
terms, and uvicorn closes them at its keep-alive timeout: a request the gateway sends on a
pooled connection can meet the close before any answer began. Nothing was served, so the
gateway sends it once more on another connection, and the backend stays in service. A
backend that closes every connection without answering is failing, and is taken out.

The fake backend is a raw asyncio server on 127.0.0.1 (aiohttp would not close at the
wrong moment on purpose): its GET answers close their connection, its POST answers keep
theirs alive, and a POST that arrives on a connection that served one already is met by a
close, never an answer."""

from __future__ import annotations

import asyncio
import contextlib
from collections import Counter
from dataclasses import dataclass, field

import aiohttp
import orjson
import pytest
from gateway_proc import start_gateway

pytestmark = pytest.mark.integration

MODEL = "fake-engine"
POLICY = """
tenants:
  - {name: chat-app, apiKeys: [sk-test-p0], priority: 0}
admin:
  apiKeys: [sk-test-admin]
limiter: {algorithm: fixed, fixedLimit: 4}
"""
P0 = {"Authorization": "Bearer sk-test-p0"}
ADMIN = {"Authorization": "Bearer sk-test-admin"}
ANSWER = orjson.dumps(
    {
        "id": "chatcmpl-1",
        "object": "chat.completion",
        "model": MODEL,
        "choices": [
            {"index": 0, "message": {"role": "assistant", "content": "hi"}, "finish_reason": "stop"}
        ],
        "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4},
    }
)
MODELS = orjson.dumps({"object": "list", "data": [{"id": MODEL, "object": "model"}]})


@dataclass
class ClosingBackend:
    """Closes a kept-alive connection when a second POST arrives on it (`always`: closes
    every POST's connection without answering)."""

    always: bool = False
    seen: Counter[str] = field(default_factory=Counter)
    url: str = ""

    async def start(self) -> asyncio.Server:
        server = await asyncio.start_server(self._connection, "127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
        return server

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        posts = 0
        with contextlib.suppress(ConnectionError, asyncio.IncompleteReadError):
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                method, path = head.split(b" ", 2)[:2]
                length = 0
                for line in head.split(b"\r\n")[1:]:
                    name, _, value = line.partition(b":")
                    if name.strip().lower() == b"content-length":
                        length = int(value)
                await reader.readexactly(length)
                if method == b"GET":
                    body = MODELS if path == b"/v1/models" else b"{}"
                    self._answer(writer, body, keep_alive=False)
                    await writer.drain()
                    break
                posts += 1
                if self.always or posts > 1:
                    self.seen["closed"] += 1
                    break  # closed as the request went out: no answer began
                self.seen["answered"] += 1
                self._answer(writer, ANSWER, keep_alive=True)
                await writer.drain()
        writer.close()

    @staticmethod
    def _answer(writer: asyncio.StreamWriter, body: bytes, keep_alive: bool) -> None:
        connection = b"keep-alive" if keep_alive else b"close"
        writer.write(
            b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\nConnection: %s\r\n\r\n%s" % (len(body), connection, body)
        )


def _chat(i: int) -> dict[str, object]:
    return {"model": MODEL, "messages": [{"role": "user", "content": f"hi {i}"}], "max_tokens": 4}


async def _run(backend: ClosingBackend, requests: int) -> tuple[list[int], str, dict[str, object]]:
    server = await backend.start()
    gw = await asyncio.to_thread(start_gateway, [backend.url], POLICY)
    statuses: list[int] = []
    try:
        async with aiohttp.ClientSession() as s:
            for i in range(requests):  # one after another: each finds the last one's connection
                async with s.post(gw.url + "/v1/chat/completions", json=_chat(i), headers=P0) as r:
                    await r.read()
                    statuses.append(r.status)
            async with s.get(gw.url + "/admin/state", headers=ADMIN) as r:
                state = orjson.loads(await r.read())
            async with s.get(gw.url + "/metrics") as r:
                metrics = await r.text()
    finally:
        await asyncio.to_thread(gw.stop)
        server.close()
        await server.wait_closed()
    return statuses, metrics, {"state": state, "log": "\n".join(gw.output)}


async def test_a_kept_alive_connection_closed_as_the_request_goes_out_is_resent() -> None:
    backend = ClosingBackend()
    statuses, metrics, seen = await _run(backend, 8)
    # every request served, each but the first on the second try
    assert statuses == [200] * 8, (statuses, seen["log"])
    assert backend.seen == {"answered": 8, "closed": 7}, backend.seen
    assert 'sluice_upstream_errors_total{backend="backend-0",kind="resent"} 7.0' in metrics
    assert "out of service" not in str(seen["log"])
    state = seen["state"]
    assert isinstance(state, dict) and state["backends"]["backend-0"]["healthy"] is True


async def test_a_backend_that_closes_every_connection_is_taken_out() -> None:
    backend = ClosingBackend(always=True)
    statuses, metrics, seen = await _run(backend, 1)
    # sent twice, closed twice: a 502, and the backend leaves service
    assert statuses == [502], (statuses, seen["log"])
    assert backend.seen == {"closed": 2}, backend.seen
    assert 'sluice_upstream_errors_total{backend="backend-0",kind="disconnect"} 1.0' in metrics
    assert "backend backend-0 is out of service" in str(seen["log"])
