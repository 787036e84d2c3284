"""The first token's path through the relay: the answer's head and its first event reach
the client in one write (one segment: the client wakes once, and the gateway cannot lose
its core between the two), and the core and the metrics hear of the first token only
after it was written. Against a real upstream stream (an aiohttp server on loopback) and
aiohttp's own payload writer over a transport that records each write."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import aiohttp
import pytest
from aiohttp import web
from aiohttp.http_writer import StreamWriter
from aiohttp.test_utils import make_mocked_request

from sluice.config import Backend
from sluice.core.types import Outcome
from sluice.gateway.backend_pool import BackendHandle
from sluice.gateway.relay import Relay
from sluice.gateway.request_context import RequestContext
from sluice.gateway.routes import CHAT, MESSAGES
from sluice.gateway.routes.spec import RouteSpec
from sluice.gateway.telemetry import Telemetry

CHAT_EVENTS = [
    b'data: {"choices":[{"delta":{"role":"assistant","content":"Hi"}}]}\n\n',
    b'data: {"choices":[{"delta":{"content":" there"}}]}\n\n',
    b'data: {"choices":[],"usage":{"prompt_tokens":5,"completion_tokens":2}}\n\n',
    b"data: [DONE]\n\n",
]
# Anthropic's stream: its first token is in the first content_block_delta, not the first event
MESSAGES_EVENTS = [
    b'event: message_start\ndata: {"type":"message_start","message":{"usage":{}}}\n\n',
    b'event: content_block_start\ndata: {"type":"content_block_start","index":0}\n\n',
    b'event: content_block_delta\ndata: {"type":"content_block_delta","delta":{"text":"Hi"}}\n\n',
    b'event: message_stop\ndata: {"type":"message_stop"}\n\n',
]


class RecordingTransport(asyncio.Transport):
    """The client's socket: every write the gateway makes to it, in order."""

    def __init__(self) -> None:
        super().__init__()
        self.writes: list[bytes] = []

    def write(self, data: bytes | bytearray | memoryview) -> None:
        self.writes.append(bytes(data))

    def writelines(self, chunks: object) -> None:
        self.writes.append(b"".join(chunks))  # type: ignore[arg-type]

    def is_closing(self) -> bool:
        return False


class _Protocol:
    """What aiohttp's payload writer reads of its connection."""

    _paused = False  # never past the write buffer's limit here

    def __init__(self, transport: RecordingTransport) -> None:
        self.transport = transport


def _upstream_app(events: list[bytes]) -> web.Application:
    async def stream(request: web.Request) -> web.StreamResponse:
        await request.read()
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for event in events:
            await response.write(event)
            await asyncio.sleep(0)  # one event per read, as an engine's tokens come
        await response.write_eof()
        return response

    app = web.Application()
    app.router.add_post("/{tail:.*}", stream)
    return app


@pytest.fixture
async def serve() -> AsyncIterator[object]:
    runners: list[web.AppRunner] = []

    async def start(events: list[bytes]) -> str:
        runner = web.AppRunner(_upstream_app(events))
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        runners.append(runner)
        return f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"  # type: ignore[union-attr]

    yield start
    for runner in runners:
        await runner.cleanup()


async def _relay(url: str, route: RouteSpec) -> tuple[RecordingTransport, list[int], Outcome]:
    """Relay one stream; returns the client's writes and, for each first-token report,
    how many writes the client had received by then."""
    transport = RecordingTransport()
    loop = asyncio.get_running_loop()
    writer = StreamWriter(_Protocol(transport), loop)  # type: ignore[arg-type]
    request = make_mocked_request("POST", route.upstream_path or "/", writer=writer, loop=loop)
    ctx = RequestContext(request, route, time.monotonic())
    ctx.request_id, ctx.priority = "r1", 0
    ctx.backend = BackendHandle(Backend(name="b0", url=url))
    ctx.body, ctx.stream = b'{"model":"m","stream":true}', True
    reported: list[int] = []
    async with aiohttp.ClientSession() as session:
        result = await Relay(session, Telemetry(), 10.0).forward(
            ctx, lambda: reported.append(len(transport.writes))
        )
    return transport, reported, result.outcome


async def test_the_head_goes_out_with_the_first_event_in_one_write(serve: object) -> None:
    url = await serve(CHAT_EVENTS)  # type: ignore[operator]
    transport, _, outcome = await _relay(url, CHAT)
    assert outcome is Outcome.OK
    first = transport.writes[0]
    assert first.startswith(b"HTTP/1.1 200 OK\r\n")
    assert b"text/event-stream" in first
    head, _, body = first.partition(b"\r\n\r\n")
    assert b"Transfer-Encoding: chunked" in head
    assert body.split(b"\r\n", 1)[1].startswith(CHAT_EVENTS[0])  # chunk-encoded after it


async def test_the_first_token_is_reported_after_it_was_written(serve: object) -> None:
    url = await serve(CHAT_EVENTS)  # type: ignore[operator]
    transport, reported, _ = await _relay(url, CHAT)
    assert reported == [1]  # once, with the head and the first event already written
    assert CHAT_EVENTS[0] in transport.writes[0]


async def test_a_first_token_after_opening_events_is_reported_after_its_own_event(
    serve: object,
) -> None:
    url = await serve(MESSAGES_EVENTS)  # type: ignore[operator]
    transport, reported, outcome = await _relay(url, MESSAGES)
    assert outcome is Outcome.OK
    assert transport.writes[0].startswith(b"HTTP/1.1 200 OK\r\n")
    delta = next(i for i, w in enumerate(transport.writes) if MESSAGES_EVENTS[2] in w)
    assert reported == [delta + 1]
