"""The gateway's client connections: aiohttp's own handler, with answers of Sluice's for
what never reaches a route.

- **Malformed requests** (aiohttp's parser refuses the request line or a header: a bad
  character, a line too long, a smuggling attempt): `400` in OpenAI's error shape, like
  every other error the gateway writes, naming the kind of fault but never quoting the
  offending line back. They are logged at most once a minute with the count since the last
  line (aiohttp logs each one at ERROR with the line in it, a key included), and counted
  in `sluice_malformed_requests_total`.
- **Too many connections**: one process holds at most `server.maxConnections` client
  connections at once (4096 by default), so that running out of file descriptors is a
  choice, not an accident. A connection past the limit is answered at once, without
  reading its request, `503` with `Retry-After: 1` and code `too_many_connections`, and
  closed; it is counted in `sluice_connections_refused_total`. The limit is read at every
  connection, so a reload applies it.

`GatewayRunner` is aiohttp's `AppRunner` whose server makes these handlers. It reaches
into two of aiohttp's internals: `AppRunner._make_server` (to wrap the server it makes)
and `Server._kwargs` (the handler's settings); tests/integration/test_adversarial.py
checks the behaviour, so an aiohttp that changes them fails there."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError

from sluice.gateway.errors import error_body, error_response
from sluice.gateway.logs import REDACTOR

log = logging.getLogger("sluice.connections")

SUMMARY_EVERY_S = 60.0  # malformed requests are logged at most this often
LINGER_S = 1.0  # a refused connection is closed after this (its answer drains first)
MAX_LINGERING = 256  # past this many refused connections lingering, close at once


def too_many_connections_answer() -> bytes:
    body = error_body(
        503,
        "The gateway holds as many connections as it may (server.maxConnections); "
        "retry shortly, or on another replica.",
        "too_many_connections",
    )
    head = (
        "HTTP/1.1 503 Service Unavailable\r\n"
        "Content-Type: application/json\r\n"
        "Retry-After: 1\r\n"
        "retry-after-ms: 1000\r\n"
        "Connection: close\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    )
    return head.encode() + body


_TOO_MANY = too_many_connections_answer()


class MalformedLog:
    """Malformed requests: the first logged at once, then at most one line per
    `every_s` with how many came since; each counted through `on_count`."""

    def __init__(
        self,
        on_count: Callable[[int], None] | None = None,
        every_s: float = SUMMARY_EVERY_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._on_count = on_count
        self._every_s = every_s
        self._clock = clock
        self._last_at: float | None = None
        self.unreported = 0
        self.total = 0

    def record(self, status: int, reason: str, remote: str | None) -> None:
        self.total += 1
        if self._on_count is not None:
            self._on_count(status)
        now = self._clock()
        if self._last_at is not None and now - self._last_at < self._every_s:
            self.unreported += 1
            return
        more = self.unreported
        self._last_at, self.unreported = now, 0
        log.warning(
            "malformed request from %s answered %d (%s)%s",
            remote or "?",
            status,
            REDACTOR.redact(reason),
            f"; {more} more in the last {self._every_s:.0f} s" if more else "",
        )


def _reason(exc: BaseException | None, status: int) -> str:
    """The kind of fault, without the line the client sent."""
    if isinstance(exc, HttpProcessingError):
        first = (exc.message or "").strip().splitlines()
        text = first[0].rstrip(":") if first else ""
        return f"{type(exc).__name__}: {text}"[:200] if text else type(exc).__name__
    if exc is not None:
        return type(exc).__name__
    return f"HTTP {status}"


_CODES = {400: "invalid_request", 408: "request_timeout", 413: "body_too_large"}


class GatewayRequestHandler(web.RequestHandler):
    __slots__ = ("_refused",)

    def __init__(self, manager: GatewayServer, **kwargs: Any) -> None:
        super().__init__(manager, **kwargs)
        self._refused = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        manager = self._manager
        if isinstance(manager, GatewayServer) and not manager.admit():
            self._refused = True
            manager.refused(transport)
            return
        super().connection_made(transport)

    def data_received(self, data: bytes) -> None:
        if not self._refused:
            super().data_received(data)

    def eof_received(self) -> None:
        if not self._refused:
            super().eof_received()

    def connection_lost(self, exc: BaseException | None) -> None:
        if self._refused:
            if isinstance(self._manager, GatewayServer):
                self._manager.lingered()
            self._manager = None
            return
        super().connection_lost(exc)

    def handle_error(
        self,
        request: web.BaseRequest,
        status: int = 500,
        exc: BaseException | None = None,
        message: str | None = None,
    ) -> web.StreamResponse:
        """aiohttp's answer to what its parser refused (or to a handler that failed
        before the app's error middleware): in OpenAI's shape, logged rate-limited."""
        reason = _reason(exc, status)
        manager = self._manager
        if isinstance(manager, GatewayServer):
            manager.malformed.record(status, reason, request.remote)
        if request.writer.output_size > 0:  # as aiohttp: the answer has begun
            raise ConnectionError("the answer has begun, no error can be sent")
        if status >= 500:
            text = "The gateway could not handle the request."
        else:
            text = f"The request is not valid HTTP ({reason})."
        response = error_response(status, text, _CODES.get(status))
        response.force_close()
        return response


class GatewayServer(web.Server):
    """aiohttp's server, making `GatewayRequestHandler`s and counting connections."""

    def __init__(
        self,
        *args: Any,
        max_connections: Callable[[], int],
        malformed: MalformedLog,
        on_refused: Callable[[], None] | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        self._max_connections = max_connections
        self.malformed = malformed
        self._on_refused = on_refused
        self.open = 0  # connections held (refused ones not counted)
        self.lingering = 0
        self.refused_total = 0

    @classmethod
    def adopt(
        cls,
        server: web.Server,
        *,
        max_connections: Callable[[], int],
        malformed: MalformedLog,
        on_refused: Callable[[], None] | None = None,
    ) -> GatewayServer:
        """The same server as `server` (its handler, request factory and settings)."""
        kwargs = dict(server._kwargs)
        return cls(
            server.request_handler,
            request_factory=server.request_factory,
            handler_cancellation=server.handler_cancellation,
            loop=server._loop,
            max_connections=max_connections,
            malformed=malformed,
            on_refused=on_refused,
            **kwargs,
        )

    def __call__(self) -> GatewayRequestHandler:
        return GatewayRequestHandler(self, loop=self._loop, **self._kwargs)

    def admit(self) -> bool:
        return self.open < self._max_connections()

    def connection_made(self, handler: web.RequestHandler, transport: asyncio.Transport) -> None:
        self.open += 1
        super().connection_made(handler, transport)

    def connection_lost(
        self, handler: web.RequestHandler, exc: BaseException | None = None
    ) -> None:
        if handler in self._connections:
            self.open -= 1
        super().connection_lost(handler, exc)

    def refused(self, transport: asyncio.BaseTransport) -> None:
        """Answer a connection past the limit and close it: after LINGER_S, so that the
        answer is not lost to a reset if the client had sent its request already."""
        self.refused_total += 1
        if self._on_refused is not None:
            self._on_refused()
        # (uvloop's transports are not asyncio.Transport subclasses, but behave as one)
        transport.write(_TOO_MANY)  # type: ignore[attr-defined]
        if self.lingering >= MAX_LINGERING:
            transport.close()
            return
        self.lingering += 1
        if transport.can_write_eof():  # type: ignore[attr-defined]
            transport.write_eof()  # type: ignore[attr-defined]
        self._loop.call_later(LINGER_S, transport.close)

    def lingered(self) -> None:
        self.lingering = max(0, self.lingering - 1)


class GatewayRunner(web.AppRunner):
    """`web.AppRunner` whose server is a `GatewayServer`."""

    def __init__(
        self,
        app: web.Application,
        *,
        max_connections: Callable[[], int],
        on_malformed: Callable[[int], None] | None = None,
        on_refused: Callable[[], None] | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(app, **kwargs)
        self._max_connections = max_connections
        self.malformed = MalformedLog(on_malformed)
        self._on_refused = on_refused

    async def _make_server(self) -> web.Server:
        server = await super()._make_server()
        return GatewayServer.adopt(
            server,
            max_connections=self._max_connections,
            malformed=self.malformed,
            on_refused=self._on_refused,
        )
