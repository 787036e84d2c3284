"""Relaying one request to its backend and the answer back to the client.

Streams are relayed event by event as they arrive (never buffered whole). A client that
goes away closes the upstream connection at once, which makes vLLM abort the request and
free its KV-cache blocks. An upstream failure after streaming began ends the stream with an
error event the client can see, never a silent cut.

Whose fault: only what the backend did or failed to do counts against it (`backend_lost`,
`Outcome.ERROR`). A client's hang-up, at any point (while its request is sent upstream,
before the answer's head, between two events, or after `data: [DONE]` before the chunked
terminator, as httpx and guidellm do), is the client's: every write to the client goes
through `_client`, which turns a failed write into the client's cancellation
(or, once the whole answer was written, into nothing: the stream is complete).

What a client is told of a failure names no internals unless `expose.errorDetails` says
so: the kind of failure, not the backend's host:port nor the HTTP client's own words.

What differs per route comes from its RouteSpec (routes/spec.py): the backend's path and
method, the client headers passed on, where the answer's usage is (`usage`), how its
stream is read (`stream`: the usage event, the first-token event, a refusing backend's
first event) and the shape of its errors (`errors`)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import aiohttp
import orjson
from aiohttp import web

from sluice.core.types import Outcome
from sluice.gateway.backend_pool import warn_credentials_refused
from sluice.gateway.telemetry import Telemetry
from sluice.gateway.upstream_deadline import UpstreamDeadline

if TYPE_CHECKING:
    from sluice.gateway.request_context import RequestContext

_EVENT_END = b"\n\n"
_NO_USAGE: tuple[int | None, int | None] = (None, None)


@dataclass(slots=True)
class RelayResult:
    response: web.StreamResponse
    outcome: Outcome
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    # The backend refused the connection or cut it: it is probably gone.
    backend_lost: bool = False
    # Failed before anything reached the client: another backend may try it.
    retryable: bool = False
    # The answer's body, or a stream's first events (what a route may read an id from).
    head: bytes = b""


class Relay:
    def __init__(
        self,
        session: aiohttp.ClientSession,
        telemetry: Telemetry,
        default_timeout: float,
        error_details: bool = False,
    ) -> None:
        self._session = session
        self._telemetry = telemetry
        # server.upstreamTimeout: the cap of a call whose client set no deadline
        self.default_timeout = default_timeout
        # expose.errorDetails: a client is told which backend failed, and how
        self.error_details = error_details

    async def forward(self, ctx: RequestContext, on_first_token: Callable[[], None]) -> RelayResult:
        timeout = self.default_timeout
        if ctx.deadline is not None:
            timeout = min(timeout, ctx.deadline - time.monotonic())
        # only a stream's relay changes it: an answer relayed whole shares one that stays
        state = _StreamState() if ctx.stream else _WHOLE_ANSWER
        backend = ctx.backend
        # vLLM takes X-Request-Id as its own request id: its logs then name the gateway's
        headers = {**backend.post_headers, "X-Request-Id": ctx.request_id}
        if (trace := ctx.request.headers.get("traceparent")) is not None:
            # W3C trace context: vLLM's spans (with --otlp-traces-endpoint) join the
            # client's trace
            headers["traceparent"] = trace
            if (trace_state := ctx.request.headers.get("tracestate")) is not None:
                headers["tracestate"] = trace_state
        deadline = UpstreamDeadline(max(0.001, timeout))
        timed_out = False
        try:
            try:
                async with await self._open(ctx, headers, deadline) as up:
                    if up.status != 200:
                        return await self._backend_refused(ctx, up)
                    if ctx.stream:
                        return await self._relay_stream(ctx, up, on_first_token, state)
                    return await self._relay_body(ctx, up)
            finally:
                timed_out = deadline.settle()
        except TimeoutError:
            # aiohttp's connect timeout
            return await self._timed_out(ctx, state)
        except asyncio.CancelledError:
            if timed_out:
                # the request's deadline; leaving the `async with` closed the connection
                return await self._timed_out(ctx, state)
            # The client hung up: leaving the `async with` closed the upstream connection,
            # which makes vLLM abort the request.
            self._telemetry.aborts.labels(ctx.backend.name).inc()
            raise
        except (aiohttp.ClientConnectorError, aiohttp.ServerDisconnectedError) as exc:
            if timed_out:  # aiohttp made the deadline's cancellation an error of its own
                return await self._timed_out(ctx, state)
            kind = "connect" if isinstance(exc, aiohttp.ClientConnectorError) else "disconnect"
            self._telemetry.upstream_errors.labels(ctx.backend.name, kind).inc()
            plain = (
                "The backend could not be reached."
                if kind == "connect"
                else "The backend closed the connection."
            )
            result = await self._fail(
                ctx,
                state,
                502,
                _detailed(ctx, self.error_details, plain, exc),
                "upstream_error",
                Outcome.ERROR,
            )
            result.backend_lost = True
            return result
        except (aiohttp.ClientPayloadError, aiohttp.ClientResponseError, OSError) as exc:
            if timed_out:
                return await self._timed_out(ctx, state)
            if state.client_gone:
                raise
            self._telemetry.upstream_errors.labels(ctx.backend.name, "stream").inc()
            result = await self._fail(
                ctx,
                state,
                502,
                _detailed(ctx, self.error_details, "The backend's answer broke off.", exc),
                "upstream_error",
                Outcome.ERROR,
            )
            result.backend_lost = True
            return result

    async def _open(
        self, ctx: RequestContext, headers: dict[str, str], deadline: UpstreamDeadline
    ) -> aiohttp.ClientResponse:
        """The backend's answer, up to its head. A backend may close a kept-alive
        connection just as a request goes out on it (llama.cpp's HTTP server closes its
        idle ones on its own terms, uvicorn at its keep-alive timeout): no answer began, so
        the request was not served, and it is sent once more, on another connection. It
        costs the backend nothing (a request whose connection closed is aborted by the
        engine). A second close is the backend's failure."""
        try:
            return await self._send(ctx, headers)
        except aiohttp.ClientConnectorError:
            raise  # not connected at all: nothing was sent
        except (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError):
            # closed or reset (aiohttp resends an idempotent request on either, once)
            if deadline.expired:  # aiohttp made the deadline's cancellation an error
                raise
            self._telemetry.upstream_errors.labels(ctx.backend.name, "resent").inc()
            return await self._send(ctx, headers)

    def _send(self, ctx: RequestContext, headers: dict[str, str]) -> Any:
        route = ctx.route
        if route.plain_post:  # most routes: POST a JSON body to a fixed path
            return self._session.post(
                ctx.backend.url + (route.upstream_path or ""), data=ctx.body, headers=headers
            )
        return self._call(ctx, headers)

    def _call(self, ctx: RequestContext, headers: dict[str, str]) -> Any:
        """The upstream call of a route that is not a plain JSON POST: its own method and
        path (the request's, query included), its own headers, its own Content-Type."""
        route = ctx.route
        client = ctx.request.headers
        for name in route.forwarded_headers:  # the route's own (anthropic-version, -beta)
            if (value := client.get(name)) is not None:
                headers[name] = value
        if route.client_content_type:  # a multipart upload keeps its boundary
            headers["Content-Type"] = client.get("Content-Type", "")
        url = ctx.backend.url + (route.upstream_path or ctx.request.raw_path)
        return self._session.request(route.method, url, data=ctx.body, headers=headers)

    async def _timed_out(self, ctx: RequestContext, state: _StreamState) -> RelayResult:
        self._telemetry.upstream_errors.labels(ctx.backend.name, "timeout").inc()
        return await self._fail(
            ctx,
            state,
            504,
            "The backend did not answer within the request's deadline.",
            "upstream_timeout",
            Outcome.TIMEOUT,
        )

    async def _relay_body(self, ctx: RequestContext, up: aiohttp.ClientResponse) -> RelayResult:
        data = await up.read()
        prompt, completion = ctx.route.usage.read(data)
        response = web.Response(
            body=data,
            status=200,
            headers={
                **ctx.headers,
                "Content-Type": up.headers.get("Content-Type", "application/json"),
            },
        )
        return RelayResult(response, Outcome.OK, prompt, completion, head=data)

    async def _relay_stream(
        self,
        ctx: RequestContext,
        up: aiohttp.ClientResponse,
        on_first_token: Callable[[], None],
        state: _StreamState,
    ) -> RelayResult:
        shape = ctx.route.stream
        assert shape is not None, "only a route with a stream shape is streamed"
        pending = b""
        usage = _NO_USAGE
        response: web.StreamResponse | None = None
        if ctx.early_head:
            # nothing says the backend could still refuse it (core/early_head.py): the
            # client reads the head while the engine prefills, not on its first token
            response = await self._start(ctx, state, web.StreamResponse)
        head = b""  # the first event, once it came (never empty: an event ends in \n\n)
        # What the first token's event contains (b"": the first event is it); None once
        # it was relayed.
        first_token: bytes | None = shape.first_token_marker or b""
        async for chunk in up.content.iter_any():
            # Relay whole events only; a chunk usually is exactly that (no copy then).
            if pending:
                chunk, pending = pending + chunk, b""
            if not chunk.endswith(_EVENT_END):
                end = chunk.rfind(_EVENT_END)
                if end < 0:
                    pending = chunk
                    continue
                chunk, pending = chunk[: end + 2], chunk[end + 2 :]
            if not head:
                if chunk.startswith(shape.refusal_prefix):
                    # vLLM's own admission control answers a stream with HTTP 200 and an
                    # error event: that is an overload signal, not a success to relay.
                    self._telemetry.upstream_errors.labels(ctx.backend.name, "overloaded").inc()
                    if response is None:
                        return _overloaded(ctx, self.error_details, _error_message(chunk))
                    # the head went out: the route's error event, as the engine's own
                    message = _overloaded_message(ctx, self.error_details, _error_message(chunk))
                    status = ctx.route.errors.overloaded_status
                    return await self._fail(
                        ctx, state, status, message, "backend_overloaded", Outcome.OVERLOADED
                    )
                head = chunk
                if response is None:
                    response = await self._start(ctx, state, _EventStream)
            assert response is not None  # started by the first event at the latest
            if shape.usage_marker in chunk:
                chunk, usage = shape.take_usage(chunk, ctx.route.usage, ctx.strip_usage, usage)
            if first_token is not None and first_token in chunk:
                # The first token goes to the client before the core and the metrics
                # hear of it: its bookkeeping is not on the client's time to first token.
                await _client(state, response.write(chunk))
                on_first_token()
                first_token = None
                continue
            await _client(state, response.write(chunk))
        if response is None or not head:
            raise aiohttp.ClientPayloadError("the backend closed the stream without an event")
        if pending:
            await _client(state, response.write(pending))
        # Everything the backend sent has been written: a client that hangs up now (before
        # the chunked terminator, as httpx and guidellm do after `data: [DONE]`) has its
        # whole answer. Not a failure of anyone's.
        with contextlib.suppress(*_CLIENT_GONE):
            await response.write_eof()
        return RelayResult(response, Outcome.OK, *usage, head=head)

    async def _start(
        self, ctx: RequestContext, state: _StreamState, kind: type[web.StreamResponse]
    ) -> web.StreamResponse:
        """The client's stream: its head written now (`web.StreamResponse`) or with the
        first event (`_EventStream`)."""
        response = state.response = kind(
            status=200,
            headers={
                **ctx.headers,
                "Content-Type": "text/event-stream",
                "Cache-Control": "no-cache",
            },
        )
        await _client(state, response.prepare(ctx.request))
        return response

    async def _backend_refused(
        self, ctx: RequestContext, up: aiohttp.ClientResponse
    ) -> RelayResult:
        data = await up.read()
        if up.status in (429, 503):
            self._telemetry.upstream_errors.labels(ctx.backend.name, "overloaded").inc()
            return _overloaded(ctx, self.error_details, _error_message(data))
        if up.status in (401, 403):
            # The gateway sends no client credentials upstream: the backend refused the
            # gateway's own key (backends[].apiKeyEnv), which no client can fix.
            self._telemetry.upstream_errors.labels(ctx.backend.name, "auth").inc()
            warn_credentials_refused(ctx.backend.name, up.status)
            which = f"The backend {ctx.backend.name}" if self.error_details else "A backend"
            message = (
                f"{which} refused the gateway's credentials "
                f"(HTTP {up.status}); its key is set with backends[].apiKeyEnv."
            )
            return RelayResult(
                ctx.route.errors.response(502, message, "upstream_auth", ctx.headers),
                Outcome.ERROR,
                retryable=True,
            )
        if 400 <= up.status < 500:
            # The client's mistake (prompt too long, bad field): relay it as the backend gave it.
            response = web.Response(
                body=data,
                status=up.status,
                headers={
                    **ctx.headers,
                    "Content-Type": up.headers.get("Content-Type", "application/json"),
                },
            )
            return RelayResult(response, Outcome.CLIENT_ERROR)
        self._telemetry.upstream_errors.labels(ctx.backend.name, f"http_{up.status}").inc()
        message = f"The backend answered HTTP {up.status}."
        if self.error_details:
            message = f"The backend {ctx.backend.name} answered HTTP {up.status}: "
            message += _error_message(data)
        return RelayResult(
            ctx.route.errors.response(502, message, "upstream_error", ctx.headers),
            Outcome.ERROR,
            retryable=True,
        )

    async def _fail(
        self,
        ctx: RequestContext,
        state: _StreamState,
        status: int,
        message: str,
        code: str,
        outcome: Outcome,
    ) -> RelayResult:
        errors = ctx.route.errors
        if state.response is None:
            return RelayResult(
                errors.response(status, message, code, ctx.headers),
                outcome,
                retryable=outcome is Outcome.ERROR,
            )
        # Streaming already began: end the stream with an error event the client can see.
        event = errors.stream_failure(status, message, code)
        with contextlib.suppress(*_CLIENT_GONE, asyncio.CancelledError):
            await state.response.write(event)
            await state.response.write_eof()
        return RelayResult(state.response, outcome)


class _EventStream(web.StreamResponse):
    """A relayed stream whose head goes out in one write with its first event (aiohttp's
    opt-in, web_response.py 3.11+: a StreamResponse sends its head at `prepare` by
    default). Sent apart, the head is a segment of its own that wakes the client for
    nothing and can cost the gateway its core between the two writes, on the path of the
    first token; the head is prepared only when the first event is here anyway."""

    _send_headers_immediately = False


@dataclass(slots=True)
class _StreamState:
    response: web.StreamResponse | None = None
    client_gone: bool = False


_WHOLE_ANSWER = _StreamState()  # never changed (see Relay.forward)

# What a write to a client that went away raises: aiohttp's ClientConnectionResetError
# (a ConnectionResetError) on a closing transport, another ConnectionError or OSError
# from the socket, RuntimeError for a write after the connection was torn down.
_CLIENT_GONE = (ConnectionError, OSError, RuntimeError)


async def _client(state: _StreamState, write: Awaitable[object]) -> None:
    """A write to the client. If the client went away, that is the client's hang-up:
    raised as its cancellation (the handler's own, when aiohttp notices first), never as
    an error that could count against the backend."""
    try:
        await write
    except _CLIENT_GONE:
        state.client_gone = True
        raise asyncio.CancelledError from None


def _detailed(ctx: RequestContext, details: bool, plain: str, exc: BaseException) -> str:
    """What the client is told of an upstream failure: the kind only, unless the policy
    exposes details (backend name, transport error)."""
    if not details:
        return plain
    return f"{plain[:-1]} (backend {ctx.backend.name}: {exc})."


def _overloaded_message(ctx: RequestContext, details: bool, detail: str) -> str:
    if details:
        return f"The backend {ctx.backend.name} is overloaded ({detail}); retry shortly."
    return "The backend is overloaded; retry shortly."


def _overloaded(ctx: RequestContext, details: bool, detail: str) -> RelayResult:
    message = _overloaded_message(ctx, details, detail)
    return RelayResult(
        ctx.route.errors.overloaded(message, ctx.headers), Outcome.OVERLOADED, retryable=True
    )


def _error_message(data: bytes) -> str:
    """The message of a backend's error: an OpenAI-shaped body, an Anthropic-shaped one
    (`error.message` too), or an SSE error event (`data: {...}`, maybe after `event:`)."""
    text = data
    if data.startswith((b"data:", b"event:")) and (at := data.find(b"data: ")) >= 0:
        text = data[at + 6 :]
    text = text.split(b"\n\n", 1)[0]
    try:
        body = orjson.loads(text)
        err = body.get("error") if isinstance(body, dict) else None
        if isinstance(err, dict) and isinstance(err.get("message"), str):
            return err["message"][:500]
        if isinstance(body, dict) and isinstance(body.get("message"), str):
            return body["message"][:500]
    except orjson.JSONDecodeError:
        pass
    return text[:200].decode("utf-8", "replace")
