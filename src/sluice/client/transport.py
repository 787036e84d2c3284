"""httpx transports that retry refused LLM requests politely: Retry-After honoured and
jittered, full-jitter back-off otherwise, bounded by attempts, the caller's deadline and a
retry budget. The decisions live in `RetryPolicy` and `RetryBudget`; this module only
sends, sleeps and closes."""

from __future__ import annotations

import asyncio
import logging
import random
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import httpx

from sluice.client.budget import RetryBudget
from sluice.client.deadline import DEADLINE_HEADERS, request_time_budget, stated_budget
from sluice.client.policy import RetryPolicy

log = logging.getLogger("sluice.client")

RETRY_HEADER = "X-Sluice-Retry"
# The return slot a Sluice 429 booked: sent back as it came, so that the gateway lets the
# retry in ahead of fresh arrivals of its class.
BOOKING_HEADER = "X-Sluice-Booking"

# Discarded answers up to this size are read to the end so their connection goes back to
# the pool; bigger (or unsized) ones are closed, which drops the connection.
_DRAIN_LIMIT = 64 * 1024


@dataclass
class RetryStats:
    """Counters of one transport (or of several sharing an engine), for tests and metrics."""

    requests: int = 0  # calls made by the caller (first attempts)
    retries: int = 0  # extra attempts sent
    gave_up_attempts: int = 0  # retryable, but max_attempts reached
    gave_up_deadline: int = 0  # retryable, but the sleep would end past the caller's deadline
    gave_up_budget: int = 0  # retryable, but the retry budget was empty
    not_replayable: int = 0  # retryable, but the request body was a one-shot stream
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def add(self, name: str) -> None:
        with self._lock:
            setattr(self, name, getattr(self, name) + 1)


@dataclass
class _Call:
    """One caller's request across its attempts."""

    request: httpx.Request
    replayable: bool
    deadline: float | None  # on the transport's clock
    retries: int = 0
    booking: str | None = None  # from the last refusal
    stated_deadline: float | None = None  # from the caller's deadline headers alone


class _RetryEngine:
    """Everything the sync and async transports share: the decision after each attempt."""

    def __init__(
        self,
        policy: RetryPolicy | None,
        budget: RetryBudget | None,
        rng: random.Random | None,
        clock: Callable[[], float],
        wall_clock: Callable[[], float],
    ) -> None:
        self.policy = policy if policy is not None else RetryPolicy()
        self.budget = budget if budget is not None else RetryBudget()
        # A private generator: a seeded global `random` in user code must not sync clients.
        self.rng = rng if rng is not None else random.Random()
        self.clock = clock
        self.wall_clock = wall_clock
        self.stats = RetryStats()

    def begin(self, request: httpx.Request) -> _Call:
        self.budget.deposit()
        self.stats.add("requests")
        allowed = request_time_budget(request)
        deadline = None if allowed is None else self.clock() + allowed
        # Decided before the first send: a transport may read a one-shot stream into memory
        # (httpx.MockTransport does), which would make it look replayable afterwards.
        replayable = isinstance(request.stream, httpx.ByteStream)
        stated = stated_budget(request)
        return _Call(
            request=request,
            replayable=replayable,
            deadline=deadline,
            stated_deadline=None if stated is None else self.clock() + stated,
        )

    def after_response(self, call: _Call, response: httpx.Response) -> float | None:
        call.booking = response.headers.get(BOOKING_HEADER)
        delay = self.policy.delay_for_status(
            response.status_code,
            response.headers,
            call.retries,
            self.rng,
            wall_now=self.wall_clock(),
        )
        return self._admit(call, delay, f"status {response.status_code}")

    def after_error(self, call: _Call, error: Exception) -> float | None:
        call.booking = None
        delay = self.policy.delay_for_error(error, call.retries, self.rng)
        return self._admit(call, delay, type(error).__name__)

    def _admit(self, call: _Call, delay: float | None, why: str) -> float | None:
        """The retry's sleep, or None: give the caller this outcome. The budget is checked
        last so that tokens are spent only on retries actually made."""
        if delay is None:
            return None
        if not call.replayable:
            self.stats.add("not_replayable")
            return None
        if call.retries + 1 >= self.policy.max_attempts:
            self.stats.add("gave_up_attempts")
            return None
        if call.deadline is not None and self.clock() + delay > call.deadline:
            self.stats.add("gave_up_deadline")
            return None
        if not self.budget.try_spend():
            self.stats.add("gave_up_budget")
            return None
        call.retries += 1
        self.stats.add("retries")
        log.debug(
            "retry %d of %s %s after %s in %.3fs",
            call.retries,
            call.request.method,
            call.request.url,
            why,
            delay,
        )
        return delay

    def next_request(self, call: _Call) -> httpx.Request:
        """The original request again (same replayable body), marked with the retry
        number, carrying the booking the refusal gave it, and, when the caller stated its
        deadline in a header (X-Request-Timeout, X-Stainless-Timeout), what is left of it:
        the gateway keeps its Retry-After and its queue wait within it."""
        original = call.request
        headers = original.headers.copy()
        headers[RETRY_HEADER] = str(call.retries)
        if call.booking is not None:
            headers[BOOKING_HEADER] = call.booking
        elif BOOKING_HEADER in headers:
            del headers[BOOKING_HEADER]
        if call.stated_deadline is not None:
            left = max(0.001, call.stated_deadline - self.clock())
            for name in DEADLINE_HEADERS:
                if name in headers:
                    headers[name] = f"{left:.3f}"
        return httpx.Request(
            original.method,
            original.url,
            headers=headers,
            stream=original.stream,
            extensions=original.extensions,
        )


def _worth_draining(response: httpx.Response) -> bool:
    length = response.headers.get("content-length")
    return length is not None and length.isdigit() and int(length) <= _DRAIN_LIMIT


def _discard(response: httpx.Response) -> None:
    try:
        if _worth_draining(response):
            response.read()
    except httpx.HTTPError:
        pass  # a broken discarded answer changes nothing; closing below frees it
    finally:
        response.close()


async def _adiscard(response: httpx.Response) -> None:
    try:
        if _worth_draining(response):
            await response.aread()
    except httpx.HTTPError:
        pass
    finally:
        await response.aclose()


class _EngineView:
    """What both transports expose of their retry engine."""

    _engine: _RetryEngine

    @property
    def policy(self) -> RetryPolicy:
        return self._engine.policy

    @property
    def budget(self) -> RetryBudget:
        return self._engine.budget

    @property
    def stats(self) -> RetryStats:
        return self._engine.stats


class RetryTransport(_EngineView, httpx.BaseTransport):
    """Retrying wrapper around a sync httpx transport.

    Use: `httpx.Client(transport=RetryTransport())`, e.g. as the `http_client` of
    `openai.OpenAI(..., max_retries=0)`. `sleep`, `clock` (monotonic seconds), `wall_clock`
    (Unix seconds, for HTTP-date Retry-After) and `rng` are injectable for tests. Pass one
    `budget` to several transports to give them a common retry budget.
    """

    def __init__(
        self,
        transport: httpx.BaseTransport | None = None,
        *,
        policy: RetryPolicy | None = None,
        budget: RetryBudget | None = None,
        rng: random.Random | None = None,
        sleep: Callable[[float], None] = time.sleep,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        self._inner = transport if transport is not None else httpx.HTTPTransport()
        self._engine = _RetryEngine(policy, budget, rng, clock, wall_clock)
        self._sleep = sleep

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        call = self._engine.begin(request)
        attempt = request
        while True:
            try:
                response = self._inner.handle_request(attempt)
            except httpx.TransportError as error:
                delay = self._engine.after_error(call, error)
                if delay is None:
                    raise
            else:
                delay = self._engine.after_response(call, response)
                if delay is None:
                    return response
                _discard(response)
            self._sleep(delay)
            attempt = self._engine.next_request(call)

    def close(self) -> None:
        self._inner.close()


class AsyncRetryTransport(_EngineView, httpx.AsyncBaseTransport):
    """The async twin of `RetryTransport`, for `httpx.AsyncClient` / `openai.AsyncOpenAI`.

    `sleep` defaults to asyncio.sleep (under trio, pass `sleep=trio.sleep`).
    """

    def __init__(
        self,
        transport: httpx.AsyncBaseTransport | None = None,
        *,
        policy: RetryPolicy | None = None,
        budget: RetryBudget | None = None,
        rng: random.Random | None = None,
        sleep: Callable[[float], Awaitable[object]] = asyncio.sleep,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        self._inner = transport if transport is not None else httpx.AsyncHTTPTransport()
        self._engine = _RetryEngine(policy, budget, rng, clock, wall_clock)
        self._sleep = sleep

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        call = self._engine.begin(request)
        attempt = request
        while True:
            try:
                response = await self._inner.handle_async_request(attempt)
            except httpx.TransportError as error:
                delay = self._engine.after_error(call, error)
                if delay is None:
                    raise
            else:
                delay = self._engine.after_response(call, response)
                if delay is None:
                    return response
                await _adiscard(response)
            await self._sleep(delay)
            attempt = self._engine.next_request(call)

    async def aclose(self) -> None:
        await self._inner.aclose()
