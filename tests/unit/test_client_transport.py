"""RetryTransport and AsyncRetryTransport driven through httpx.MockTransport with a fake
clock, a fake sleep and seeded randomness: exact waits, attempts, headers and bodies."""

from __future__ import annotations

import random
from collections.abc import AsyncIterator, Callable, Iterator

import httpx
import pytest

from sluice.client import AsyncRetryTransport, RetryBudget, RetryPolicy, RetryTransport

URL = "http://gateway.test/v1/chat/completions"
BODY = b'{"model":"m","messages":[{"role":"user","content":"hi"}]}'


class FakeTime:
    """A clock that only moves when the code under test sleeps (or a handler says so)."""

    def __init__(self) -> None:
        self.now = 0.0
        self.sleeps: list[float] = []

    def clock(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds

    async def async_sleep(self, seconds: float) -> None:
        self.sleep(seconds)


class TrackedStream(httpx.SyncByteStream, httpx.AsyncByteStream):
    """A response body that records whether it was closed."""

    def __init__(self, body: bytes) -> None:
        self.body = body
        self.closed = False

    def __iter__(self) -> Iterator[bytes]:
        yield self.body

    async def __aiter__(self) -> AsyncIterator[bytes]:
        yield self.body

    def close(self) -> None:
        self.closed = True

    async def aclose(self) -> None:
        self.closed = True


class Server:
    """A scripted server: answers `statuses` in order (the last one repeats) and records
    what each attempt carried."""

    def __init__(
        self,
        *answers: tuple[int, dict[str, str]],
        time: FakeTime | None = None,
        service_s: float = 0.0,
    ) -> None:
        self.answers = list(answers)
        self.time = time
        self.service_s = service_s
        self.retry_headers: list[str | None] = []
        self.bodies: list[bytes] = []
        self.streams: list[TrackedStream] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        if self.time is not None:
            self.time.now += self.service_s
        self.retry_headers.append(request.headers.get("x-sluice-retry"))
        self.bodies.append(request.content)
        status, headers = self.answers[min(len(self.bodies) - 1, len(self.answers) - 1)]
        payload = b'{"ok":true}' if status == 200 else b'{"error":{"code":"queue_full"}}'
        stream = TrackedStream(payload)
        self.streams.append(stream)
        return httpx.Response(
            status, headers={**headers, "content-length": str(len(payload))}, stream=stream
        )

    @property
    def calls(self) -> int:
        return len(self.bodies)


def sync_client(
    server: Callable[[httpx.Request], httpx.Response],
    time: FakeTime,
    seed: int = 1,
    **kwargs: object,
) -> tuple[httpx.Client, RetryTransport]:
    transport = RetryTransport(
        httpx.MockTransport(server),
        rng=random.Random(seed),
        sleep=time.sleep,
        clock=time.clock,
        **kwargs,
    )  # type: ignore[arg-type]
    return httpx.Client(transport=transport, timeout=60.0), transport


RA_1S = {"Retry-After": "1"}


def test_retries_after_429_with_jittered_retry_after_and_marks_each_retry() -> None:
    time = FakeTime()
    server = Server((429, RA_1S), (429, {"retry-after-ms": "2000"}), (200, {}))
    client, transport = sync_client(server, time, seed=42)

    response = client.post(URL, content=BODY)

    assert response.status_code == 200
    assert response.json() == {"ok": True}
    reference = random.Random(42)
    assert time.sleeps == [
        1.0 * (1 + 0.5 * reference.random()),
        2.0 * (1 + 0.5 * reference.random()),
    ]
    assert server.retry_headers == [None, "1", "2"]
    assert transport.stats.requests == 1 and transport.stats.retries == 2


def test_stops_at_max_attempts_and_returns_the_last_answer() -> None:
    time = FakeTime()
    server = Server((503, {}))  # no Retry-After: full jitter
    client, transport = sync_client(server, time, seed=3, policy=RetryPolicy(max_attempts=3))

    response = client.post(URL, content=BODY)

    assert response.status_code == 503
    assert server.calls == 3
    reference = random.Random(3)
    assert time.sleeps == [0.5 * reference.random(), 1.0 * reference.random()]
    assert transport.stats.gave_up_attempts == 1


@pytest.mark.parametrize("status", [502, 504])
def test_gateway_errors_are_retried_with_full_jitter(status: int) -> None:
    time = FakeTime()
    server = Server((status, RA_1S), (200, {}))
    client, _ = sync_client(server, time, seed=5)
    assert client.post(URL, content=BODY).status_code == 200
    assert time.sleeps == [0.5 * random.Random(5).random()]


@pytest.mark.parametrize("status", [400, 401, 403, 404, 500])
def test_client_errors_and_500_are_returned_at_once(status: int) -> None:
    time = FakeTime()
    server = Server((status, RA_1S))
    client, _ = sync_client(server, time)
    assert client.post(URL, content=BODY).status_code == status
    assert server.calls == 1 and time.sleeps == []


def test_discarded_answers_are_closed_and_the_returned_one_is_not() -> None:
    time = FakeTime()
    server = Server((429, RA_1S), (429, RA_1S), (429, RA_1S))
    client, _ = sync_client(server, time, policy=RetryPolicy(max_attempts=3))

    with client.stream("POST", URL, content=BODY) as response:
        assert response.status_code == 429
        assert [s.closed for s in server.streams] == [True, True, False]
        assert response.read() == b'{"error":{"code":"queue_full"}}'
    assert server.streams[-1].closed


def test_no_retry_whose_sleep_would_end_past_the_timeout() -> None:
    time = FakeTime()
    server = Server((429, {"Retry-After": "3"}), (200, {}))
    client, transport = sync_client(server, time)

    response = client.post(URL, content=BODY, timeout=2.0)

    assert response.status_code == 429
    assert server.calls == 1 and time.sleeps == []
    assert transport.stats.gave_up_deadline == 1


def test_deadline_counts_the_time_already_spent() -> None:
    # Each attempt takes 1 s; the caller allows 3 s; the server advises 0.5 s.
    # t=0..1 attempt 1, sleep [0.5, 0.75], attempt 2 ends by 2.75; another sleep of at
    # least 0.5 s would end past 3 s, so no third attempt.
    time = FakeTime()
    server = Server((429, {"retry-after-ms": "500"}), time=time, service_s=1.0)
    client, transport = sync_client(server, time, seed=9)

    response = client.post(URL, content=BODY, timeout=3.0)

    assert response.status_code == 429
    assert server.calls == 2
    assert time.sleeps == [0.5 * (1 + 0.5 * random.Random(9).random())]
    assert transport.stats.gave_up_deadline == 1


def test_x_request_timeout_header_is_a_deadline_too() -> None:
    time = FakeTime()
    server = Server((429, {"Retry-After": "2"}), (200, {}))
    client, _ = sync_client(server, time)
    response = client.post(URL, content=BODY, headers={"X-Request-Timeout": "1.5"})
    assert response.status_code == 429 and server.calls == 1


class Recorder(Server):
    """A Server that also keeps every attempt's headers."""

    def __init__(self, *answers: tuple[int, dict[str, str]], **kw: object) -> None:
        super().__init__(*answers, **kw)  # type: ignore[arg-type]
        self.headers: list[httpx.Headers] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.headers.append(request.headers)
        return super().__call__(request)


def test_a_return_slot_is_kept_the_window_jitters_and_the_booking_goes_back() -> None:
    time = FakeTime()
    slot = {
        "retry-after-ms": "2500",
        "Retry-After": "3",
        "X-Sluice-Booking": "b1.2.99.abc",
        "X-Sluice-Retry-Window-Ms": "200",
    }
    server = Recorder((429, slot), (429, {"Retry-After": "1"}), (200, {}))
    client, _ = sync_client(server, time, seed=3)
    response = client.post(URL, content=BODY, headers={"X-Request-Timeout": "20"})
    assert response.status_code == 200
    reference = random.Random(3)
    # back at the slot plus a share of its window (not 50 % of 2.5 s: that misses it)
    assert time.sleeps == [2.5 + 0.2 * reference.random(), 1.0 * (1 + 0.5 * reference.random())]
    assert "x-sluice-booking" not in server.headers[0]
    assert server.headers[1]["x-sluice-booking"] == "b1.2.99.abc"
    assert "x-sluice-booking" not in server.headers[2]  # the second refusal booked none
    # each retry states what is left of the caller's 20 s
    assert server.headers[0]["x-request-timeout"] == "20"
    assert float(server.headers[1]["x-request-timeout"]) == pytest.approx(
        20 - time.sleeps[0], abs=1e-3
    )
    assert float(server.headers[2]["x-request-timeout"]) == pytest.approx(
        20 - sum(time.sleeps), abs=1e-3
    )


def test_cannot_serve_in_time_is_not_retried() -> None:
    time = FakeTime()
    server = Server((429, {"x-should-retry": "false"}), (200, {}))
    client, transport = sync_client(server, time)
    response = client.post(URL, content=BODY)
    assert response.status_code == 429 and server.calls == 1 and time.sleeps == []
    assert transport.stats.retries == 0


def test_budget_caps_retries_of_a_thousand_refused_requests() -> None:
    time = FakeTime()
    server = Server((429, RA_1S))
    client, transport = sync_client(server, time)  # default budget: 10% + 10 tokens

    statuses = {client.post(URL, content=BODY).status_code for _ in range(1000)}

    assert statuses == {429}
    # Tokens (in tenths): 100, capped; requests 1-3 take 3 retries each (100->70->41->12),
    # request 4 one (13->3); then one retry per ten requests: (3 + 996) // 10 = 99.
    assert transport.stats.retries == 109 <= 0.1 * 1000 + 10
    assert server.calls == 1000 + 109
    assert transport.stats.gave_up_budget == 1000 - 3


def test_a_shared_budget_caps_several_transports_together() -> None:
    time = FakeTime()
    budget = RetryBudget(ratio=0.0, initial=2.0)
    server = Server((429, RA_1S))
    first, _ = sync_client(server, time, budget=budget)
    second, _ = sync_client(server, time, budget=budget)
    first.post(URL, content=BODY)
    second.post(URL, content=BODY)
    assert server.calls == 2 + 2


def test_the_same_body_is_sent_on_every_attempt() -> None:
    time = FakeTime()
    server = Server((429, RA_1S), (503, {}), (200, {}))
    client, _ = sync_client(server, time)
    assert client.post(URL, content=BODY).status_code == 200
    assert server.bodies == [BODY, BODY, BODY]


def test_a_one_shot_streaming_body_is_not_retried() -> None:
    def chunks() -> Iterator[bytes]:
        yield b'{"model":'
        yield b'"m"}'

    time = FakeTime()
    server = Server((429, RA_1S), (200, {}))
    client, transport = sync_client(server, time)

    assert client.post(URL, content=chunks()).status_code == 429
    assert server.calls == 1
    assert transport.stats.not_replayable == 1


def test_connect_errors_are_retried() -> None:
    time = FakeTime()
    calls: list[int] = []

    def flaky(request: httpx.Request) -> httpx.Response:
        calls.append(1)
        if len(calls) < 3:
            raise httpx.ConnectError("connection refused", request=request)
        return httpx.Response(200, json={"ok": True})

    client, _ = sync_client(flaky, time, seed=11)
    assert client.post(URL, content=BODY).status_code == 200
    reference = random.Random(11)
    assert time.sleeps == [0.5 * reference.random(), 1.0 * reference.random()]


def test_connect_errors_past_max_attempts_are_raised() -> None:
    time = FakeTime()
    calls: list[int] = []

    def refused(request: httpx.Request) -> httpx.Response:
        calls.append(1)
        raise httpx.ConnectError("connection refused", request=request)

    client, _ = sync_client(refused, time, policy=RetryPolicy(max_attempts=2))
    with pytest.raises(httpx.ConnectError):
        client.post(URL, content=BODY)
    assert len(calls) == 2


def test_read_timeouts_are_not_retried() -> None:
    # The request reached the server, which may be generating: sending it again would pay
    # for the generation twice.
    time = FakeTime()
    calls: list[int] = []

    def slow(request: httpx.Request) -> httpx.Response:
        calls.append(1)
        raise httpx.ReadTimeout("timed out", request=request)

    client, _ = sync_client(slow, time)
    with pytest.raises(httpx.ReadTimeout):
        client.post(URL, content=BODY)
    assert len(calls) == 1 and time.sleeps == []


def test_inner_transport_is_closed_with_the_client() -> None:
    closed: list[bool] = []

    class Inner(httpx.MockTransport):
        def close(self) -> None:
            closed.append(True)

    with httpx.Client(transport=RetryTransport(Inner(Server((200, {}))))):
        pass
    assert closed == [True]


def async_client(
    server: Callable[[httpx.Request], httpx.Response],
    time: FakeTime,
    seed: int = 1,
    **kwargs: object,
) -> tuple[httpx.AsyncClient, AsyncRetryTransport]:
    transport = AsyncRetryTransport(
        httpx.MockTransport(server),
        rng=random.Random(seed),
        sleep=time.async_sleep,
        clock=time.clock,
        **kwargs,
    )  # type: ignore[arg-type]
    return httpx.AsyncClient(transport=transport, timeout=60.0), transport


async def test_async_retries_after_429_and_marks_each_retry() -> None:
    time = FakeTime()
    server = Server((429, RA_1S), (503, {}), (200, {}))
    client, transport = async_client(server, time, seed=42)

    response = await client.post(URL, content=BODY)

    assert response.status_code == 200
    reference = random.Random(42)
    assert time.sleeps == [1.0 * (1 + 0.5 * reference.random()), 1.0 * reference.random()]
    assert server.retry_headers == [None, "1", "2"]
    assert server.bodies == [BODY, BODY, BODY]
    assert transport.stats.retries == 2


async def test_async_closes_discarded_answers_and_respects_the_deadline() -> None:
    time = FakeTime()
    server = Server((429, RA_1S), (429, {"Retry-After": "5"}))
    client, transport = async_client(server, time)

    async with client.stream("POST", URL, content=BODY, timeout=4.0) as response:
        assert response.status_code == 429
        assert [s.closed for s in server.streams] == [True, False]
    assert server.calls == 2
    assert transport.stats.gave_up_deadline == 1


async def test_async_budget_caps_retries() -> None:
    time = FakeTime()
    server = Server((429, RA_1S))
    client, transport = async_client(server, time, budget=RetryBudget(ratio=0.1, initial=0.0))
    for _ in range(100):
        await client.post(URL, content=BODY)
    assert transport.stats.retries == 10
    assert server.calls == 110


async def test_async_read_timeouts_are_not_retried() -> None:
    time = FakeTime()

    def slow(request: httpx.Request) -> httpx.Response:
        raise httpx.ReadTimeout("timed out", request=request)

    client, transport = async_client(slow, time)
    with pytest.raises(httpx.ReadTimeout):
        await client.post(URL, content=BODY)
    assert transport.stats.retries == 0
