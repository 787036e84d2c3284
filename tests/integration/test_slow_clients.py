"""Slow or stalled clients cannot hold a connection forever (issue 3, item 7), against a
real `sluice serve`: a new connection that has not sent a complete request head within
`server.headerTimeout` is closed, whether it stalls or trickles (slowloris); a kept-alive
connection idle for `server.idleTimeout` is closed; requests in flight meanwhile, a body
sent slowly after its head, and a stream longer than both bounds are untouched."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest
from conftest import SimFactory
from gateway_proc import GatewayProcess, start_gateway

pytestmark = pytest.mark.integration

HEADER_TIMEOUT_S = 1.0
IDLE_TIMEOUT_S = 3.0
# The sweep runs every headerTimeout / 8, so a connection is cut within 2 ticks of the
# bound; the rest is slack for a loaded machine (still well below the idle bound).
CUT_WITHIN_S = HEADER_TIMEOUT_S + 2 * HEADER_TIMEOUT_S / 8 + 0.5
POLICY = f"""
tenants:
  - {{name: chat, apiKeys: [sk-chat], priority: 0}}
server:
  headerTimeout: {HEADER_TIMEOUT_S}s
  idleTimeout: {IDLE_TIMEOUT_S}s
"""
CHAT = "/v1/chat/completions"
AUTH = {"Authorization": "Bearer sk-chat"}


def _chat(max_tokens: int, stream: bool = False) -> dict[str, object]:
    return {
        "model": "sluice-sim",
        "messages": [{"role": "user", "content": "hello"}],
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "stream": stream,
    }


def _host_port(gw: GatewayProcess) -> tuple[str, int]:
    host, port = gw.url.removeprefix("http://").split(":")
    return host, int(port)


async def _closed_after(reader: asyncio.StreamReader, t0: float) -> float:
    """Seconds from t0 until the gateway closed the connection (EOF or reset)."""
    try:
        while await reader.read(65536):
            pass
    except ConnectionError:
        pass
    return time.monotonic() - t0


async def _stalled(gw: GatewayProcess) -> float:
    """Half a request line, then nothing: seconds until cut, from before the connect (the
    gateway's timer starts when it accepts, which may come before the client's own
    `open_connection` returns: from after it, a cut on time read 0.9996 s once)."""
    t0 = time.monotonic()
    reader, writer = await asyncio.open_connection(*_host_port(gw))
    writer.write(b"POST /v1/chat/compl")
    await writer.drain()
    try:
        return await asyncio.wait_for(_closed_after(reader, t0), IDLE_TIMEOUT_S + 5)
    finally:
        writer.close()


async def _slowloris(gw: GatewayProcess) -> tuple[float, int]:
    """A request line, then one header byte every 0.2 s, never the end of the head:
    (seconds until cut, bytes trickled)."""
    t0 = time.monotonic()  # before the connect, as in _stalled
    reader, writer = await asyncio.open_connection(*_host_port(gw))
    writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: ")
    closed = asyncio.ensure_future(_closed_after(reader, t0))
    sent = 0
    try:
        while not closed.done():
            assert time.monotonic() - t0 < IDLE_TIMEOUT_S + 5, "never cut"
            try:
                writer.write(b"a")
                await writer.drain()
            except ConnectionError:
                break
            sent += 1
            await asyncio.wait([closed], timeout=0.2)
        return await closed, sent
    finally:
        writer.close()


async def _slow_body(gw: GatewayProcess) -> tuple[int, float]:
    """A complete head at once, then the body in 10 pieces over ~2 s (longer than the
    header timeout, within readTimeout): (status, seconds)."""
    body = json.dumps(_chat(4)).encode()
    reader, writer = await asyncio.open_connection(*_host_port(gw))
    t0 = time.monotonic()
    writer.write(
        f"POST {CHAT} HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer sk-chat\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n"
        "Connection: close\r\n\r\n".encode()
    )
    step = -(-len(body) // 10)
    for i in range(0, len(body), step):
        await asyncio.sleep(0.2)
        writer.write(body[i : i + step])
        await writer.drain()
    status_line = await asyncio.wait_for(reader.readline(), 10)
    writer.close()
    return int(status_line.split()[1]), time.monotonic() - t0


async def _long_stream(client: httpx.AsyncClient, gw: GatewayProcess) -> tuple[int, float]:
    """A streamed answer longer than both bounds: (chunks with content, seconds)."""
    t0 = time.monotonic()
    chunks = 0
    async with client.stream("POST", gw.url + CHAT, json=_chat(400, True), headers=AUTH) as r:
        assert r.status_code == 200
        done = False
        async for line in r.aiter_lines():
            if line == "data: [DONE]":
                done = True
            elif line.startswith("data: "):
                choices = json.loads(line[6:])["choices"]
                chunks += bool(choices and choices[0]["delta"].get("content"))
        assert done, "the stream was cut"
    return chunks, time.monotonic() - t0


async def _steady_requests(
    client: httpx.AsyncClient, gw: GatewayProcess, until: asyncio.Future[object]
) -> list[int]:
    """Ordinary requests, one after another on a kept-alive connection, until `until`."""
    statuses = []
    while not until.done() or not statuses:
        r = await client.post(gw.url + CHAT, json=_chat(4), headers=AUTH)
        statuses.append(r.status_code)
    return statuses


async def test_stalled_and_trickling_heads_are_cut_and_requests_in_flight_are_not(
    sim_factory: SimFactory,
) -> None:
    sim = sim_factory("--profile", "tiny", "--speed", "0.5")
    gw = start_gateway([sim.url], POLICY)
    try:
        async with (
            httpx.AsyncClient(timeout=30) as streaming,
            httpx.AsyncClient(timeout=30) as steady,
        ):
            stream = asyncio.ensure_future(_long_stream(streaming, gw))
            normal = asyncio.ensure_future(_steady_requests(steady, gw, stream))
            stalled, (trickled_for, trickled), (body_status, body_s) = await asyncio.gather(
                _stalled(gw), _slowloris(gw), _slow_body(gw)
            )
            chunks, stream_s = await stream
            statuses = await normal
        print(
            f"stalled cut after {stalled:.2f}s; slowloris cut after {trickled_for:.2f}s "
            f"({trickled} bytes); slow body answered {body_status} after {body_s:.2f}s; "
            f"stream of {chunks} chunks over {stream_s:.2f}s; {len(statuses)} requests"
        )
        assert HEADER_TIMEOUT_S <= stalled <= CUT_WITHIN_S
        assert HEADER_TIMEOUT_S <= trickled_for <= CUT_WITHIN_S
        assert trickled >= 4  # it was trickling when cut, not closed at once
        assert body_status == 200 and body_s > HEADER_TIMEOUT_S  # a head in time is enough
        assert stream_s > IDLE_TIMEOUT_S and chunks == 400  # longer than both, never cut
        assert statuses == [200] * len(statuses) and len(statuses) >= 3
        assert gw.proc.poll() is None
        # operators see it: both cut connections are counted
        assert gw.metrics()["sluice_slow_client_disconnects_total"] == 2
    finally:
        gw.stop()


async def test_an_idle_kept_alive_connection_is_closed_after_the_idle_timeout(
    sim_factory: SimFactory,
) -> None:
    sim = sim_factory("--profile", "tiny")
    gw = start_gateway([sim.url], POLICY)
    request = b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"
    try:
        reader, writer = await asyncio.open_connection(*_host_port(gw))

        async def answer() -> bytes:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
            length = next(
                int(line.split(b":")[1])
                for line in head.split(b"\r\n")
                if line.lower().startswith(b"content-length:")
            )
            await reader.readexactly(length)
            return head

        writer.write(request)
        assert (await answer()).startswith(b"HTTP/1.1 200")
        # idle for longer than the header timeout, but less than the idle timeout: the
        # connection is still there and serves the next request
        await asyncio.sleep(HEADER_TIMEOUT_S * 1.5)
        writer.write(request)
        assert (await answer()).startswith(b"HTTP/1.1 200")
        t0 = time.monotonic()
        idle = await asyncio.wait_for(_closed_after(reader, t0), IDLE_TIMEOUT_S + 5)
        writer.close()
        print(f"idle connection closed after {idle:.2f}s")
        assert IDLE_TIMEOUT_S - 0.1 <= idle <= IDLE_TIMEOUT_S + 1.0
    finally:
        gw.stop()
