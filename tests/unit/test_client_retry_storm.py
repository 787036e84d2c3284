"""Must-show (issue 5): 1,000 clients refused in the same instant with `Retry-After: 3`.

With the SDK their returns spread over [3 s, 4.5 s] and the busiest 100 ms holds at most 2x
the mean per 100 ms of that window; clients that sleep exactly Retry-After all come back
in the same 100 ms, at least 10x the same mean. Virtual time: the delays come from the
transport's own decision code, with one independent generator per client.

Run with `pytest -s` to see both figures; they are also in the assertion messages.
"""

from __future__ import annotations

import asyncio
import bisect
import random

import httpx

from sluice.client import AsyncRetryTransport, RetryPolicy

CLIENTS = 1000
RETRY_AFTER = {"Retry-After": "3"}
BIN_S = 0.1


def busiest_100ms(times: list[float]) -> int:
    """The most returns in any 100 ms interval [t, t + 0.1) (not just aligned bins)."""
    ordered = sorted(times)
    return max(bisect.bisect_left(ordered, t + BIN_S) - i for i, t in enumerate(ordered))


def mean_per_100ms(count: int, window_s: float) -> float:
    return count * BIN_S / max(window_s, BIN_S)


def peak_ratios(sdk_returns: list[float]) -> tuple[float, float, float]:
    """(SDK ratio, naive ratio, window): both peaks measured against the mean per 100 ms of
    the window the SDK's returns are spread over (the naive returns have no spread at all)."""
    window = max(sdk_returns) - min(sdk_returns)
    mean = mean_per_100ms(len(sdk_returns), window)
    naive_returns = [3.0] * len(sdk_returns)  # sleep exactly Retry-After
    return busiest_100ms(sdk_returns) / mean, busiest_100ms(naive_returns) / mean, window


def sdk_delay(policy: RetryPolicy, rng: random.Random) -> float:
    delay = policy.delay_for_status(429, httpx.Headers(RETRY_AFTER), 0, rng, wall_now=0.0)
    assert delay is not None
    return delay


def test_busiest_100ms_counts_a_sliding_window() -> None:
    assert busiest_100ms([0.0, 0.05, 0.099, 0.1, 0.35]) == 3
    assert busiest_100ms([1.0] * 5) == 5


def test_retry_storm_is_spread_by_the_sdk_and_not_by_naive_clients() -> None:
    policy = RetryPolicy()
    returns = [sdk_delay(policy, random.Random(client)) for client in range(CLIENTS)]

    sdk, naive, window = peak_ratios(returns)
    message = (
        f"{CLIENTS} clients told Retry-After: 3 return over {window:.2f} s; busiest "
        f"100 ms vs mean per 100 ms: SDK {sdk:.2f}x, naive {naive:.2f}x"
    )
    print("\n" + message)

    assert min(returns) >= 3.0 and max(returns) <= 4.5, message
    assert window > 1.4, message  # the spread really uses [3, 4.5]
    assert sdk <= 2.0, message
    assert naive >= 10.0, message


def test_the_spread_holds_for_any_seeds_and_a_shared_generator() -> None:
    # Not one lucky seed: 50 independent storms, plus 1,000 clients drawing from one generator.
    policy = RetryPolicy()
    worst = 0.0
    for storm in range(50):
        returns = [sdk_delay(policy, random.Random(storm * CLIENTS + c)) for c in range(CLIENTS)]
        worst = max(worst, peak_ratios(returns)[0])
    shared = random.Random(2024)
    shared_ratio = peak_ratios([sdk_delay(policy, shared) for _ in range(CLIENTS)])[0]
    assert worst <= 2.0, f"worst of 50 storms: {worst:.2f}x"
    assert shared_ratio <= 2.0, f"shared generator: {shared_ratio:.2f}x"


async def test_a_thousand_async_transports_refused_at_once_come_back_spread_out() -> None:
    returns: list[float] = []
    served: list[str | None] = []

    def gateway(request: httpx.Request) -> httpx.Response:
        served.append(request.headers.get("x-sluice-retry"))
        if request.headers.get("x-sluice-retry") is None:
            return httpx.Response(429, headers=RETRY_AFTER, json={"error": {"code": "queue_full"}})
        return httpx.Response(200, json={"ok": True})

    async def one_client(index: int) -> int:
        now = 0.0  # every client is refused at t = 0 of its own virtual clock

        async def sleep(seconds: float) -> None:
            nonlocal now
            now += seconds
            returns.append(now)

        transport = AsyncRetryTransport(
            httpx.MockTransport(gateway), rng=random.Random(index), sleep=sleep, clock=lambda: now
        )
        request = httpx.Request(
            "POST",
            "http://gateway.test/v1/chat/completions",
            content=b'{"model":"m"}',
            extensions={"timeout": httpx.Timeout(30.0).as_dict()},
        )
        response = await transport.handle_async_request(request)
        await response.aclose()
        return response.status_code

    statuses = await asyncio.gather(*(one_client(i) for i in range(CLIENTS)))

    assert statuses == [200] * CLIENTS
    assert served.count(None) == CLIENTS and served.count("1") == CLIENTS
    sdk, naive, window = peak_ratios(returns)
    message = (
        f"async transports: returns over {window:.2f} s, busiest 100 ms vs mean: "
        f"SDK {sdk:.2f}x, naive {naive:.2f}x"
    )
    print("\n" + message)
    assert sdk <= 2.0 and naive >= 10.0, message
