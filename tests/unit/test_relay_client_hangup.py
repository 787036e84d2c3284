"""A client's hang-up is the client's, wherever it happens (issue 14, item 1): the relay
against a real upstream stream (an aiohttp server on loopback), with a client whose
connection breaks at a chosen write. Only what the backend did marks it down
(`backend_lost`, an upstream error): a client that leaves after `data: [DONE]` without
the chunked terminator (httpx, guidellm) had its whole answer, and one that leaves
mid-stream is a cancellation."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from aiohttp.client_exceptions import ClientConnectionResetError
from aiohttp.test_utils import make_mocked_request

from sluice.config import Backend
from sluice.core.types import Outcome
from sluice.gateway.backend_pool import BackendHandle
from sluice.gateway.relay import Relay
from sluice.gateway.request_context import RequestContext
from sluice.gateway.routes import CHAT
from sluice.gateway.telemetry import Telemetry

EVENTS = [b'data: {"choices":[{"delta":{"content":"x"}}]}\n\n'] * 3 + [
    b'data: {"choices":[],"usage":{"prompt_tokens":5,"completion_tokens":3}}\n\n',
    b"data: [DONE]\n\n",
]


class BrokenClient:
    """The client side of a gateway connection (aiohttp's payload writer) whose
    connection is gone at `fail_at`: 'headers', 'write' (the first events) or 'eof'
    (the terminator after [DONE])."""

    def __init__(self, fail_at: str) -> None:
        self.fail_at = fail_at
        self.written: list[bytes] = []
        self.buffer_size = 0
        self.output_size = 0
        self.length: int | None = None

    def _gone(self) -> None:
        raise ClientConnectionResetError("Cannot write to closing transport")

    def enable_chunking(self) -> None:
        pass

    def enable_compression(self, *args: Any, **kwargs: Any) -> None:
        pass

    async def write_headers(self, status_line: str, headers: Any) -> None:
        if self.fail_at == "headers":
            self._gone()
        self.output_size += 1

    def send_headers(self) -> None:
        pass

    async def write(self, chunk: bytes, *args: Any, **kwargs: Any) -> None:
        if self.fail_at == "write":
            self._gone()
        self.written.append(bytes(chunk))
        self.output_size += len(chunk)

    async def write_eof(self, chunk: bytes = b"") -> None:
        if self.fail_at == "eof":
            self._gone()

    async def drain(self) -> None:
        pass


@pytest.fixture
async def upstream() -> AsyncIterator[str]:
    async def stream(request: web.Request) -> web.StreamResponse:
        await request.read()
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for event in EVENTS:
            await response.write(event)
        await response.write_eof()
        return response

    app = web.Application()
    app.router.add_post("/v1/chat/completions", stream)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    yield f"http://127.0.0.1:{port}"
    await runner.cleanup()


async def _forward(url: str, client: BrokenClient) -> tuple[Any, Telemetry]:
    telemetry = Telemetry()
    request = make_mocked_request("POST", "/v1/chat/completions", writer=client)
    ctx = RequestContext(request, CHAT, time.monotonic())
    ctx.request_id = "r1"
    ctx.priority = 1
    ctx.backend = BackendHandle(Backend(name="b0", url=url))
    ctx.body = b'{"model":"m","stream":true}'
    ctx.stream = True
    async with aiohttp.ClientSession() as session:
        result = await Relay(session, telemetry, 10.0).forward(ctx, lambda: None)
    return result, telemetry


def _upstream_errors(telemetry: Telemetry) -> float:
    return sum(
        s.value
        for m in telemetry.upstream_errors.collect()
        for s in m.samples
        if s.name.endswith("_total")
    )


async def test_a_client_gone_after_done_had_its_whole_answer(upstream: str) -> None:
    client = BrokenClient("eof")
    result, telemetry = await _forward(upstream, client)
    assert result.outcome is Outcome.OK and not result.backend_lost
    assert (result.prompt_tokens, result.completion_tokens) == (5, 3)
    assert client.written[-1].endswith(b"data: [DONE]\n\n")
    assert _upstream_errors(telemetry) == 0


@pytest.mark.parametrize("fail_at", ["headers", "write"])
async def test_a_client_gone_mid_answer_is_a_cancellation_not_a_backend_failure(
    upstream: str, fail_at: str
) -> None:
    with pytest.raises(asyncio.CancelledError):
        await _forward(upstream, BrokenClient(fail_at))
