"""The pure retry decisions: back-off and Retry-After delays, the budget, the deadline."""

from __future__ import annotations

import random

import httpx
import pytest

from sluice.client import RetryBudget, RetryPolicy, request_time_budget


class FixedRandom(random.Random):
    """A generator whose random() always returns `value`, to hit interval ends exactly."""

    def __init__(self, value: float) -> None:
        super().__init__(0)
        self.value = value

    def random(self) -> float:
        return self.value


ALMOST_ONE = 1.0 - 2.0**-53  # the largest value random.random() can return


def headers(**values: str) -> httpx.Headers:
    return httpx.Headers({k.replace("_", "-"): v for k, v in values.items()})


@pytest.mark.parametrize(
    ("retry_index", "ceiling"),
    [(0, 0.5), (1, 1.0), (2, 2.0), (3, 4.0), (4, 8.0), (5, 8.0), (1000, 8.0)],
)
def test_full_jitter_spans_zero_to_capped_exponential(retry_index: int, ceiling: float) -> None:
    policy = RetryPolicy(backoff_base=0.5, backoff_cap=8.0)
    assert policy.backoff_delay(retry_index, FixedRandom(0.0)) == 0.0
    assert policy.backoff_delay(retry_index, FixedRandom(ALMOST_ONE)) == ceiling * ALMOST_ONE
    assert policy.backoff_delay(retry_index, FixedRandom(0.5)) == ceiling / 2


def test_full_jitter_samples_stay_in_bounds_with_a_real_generator() -> None:
    policy = RetryPolicy(backoff_base=0.1, backoff_cap=2.0)
    rng = random.Random(7)
    for n in range(8):
        ceiling = min(2.0, 0.1 * 2**n)
        samples = [policy.backoff_delay(n, rng) for _ in range(2000)]
        assert all(0.0 <= s < ceiling for s in samples)
        # Full jitter really uses the whole interval, not just its top.
        assert min(samples) < 0.05 * ceiling and max(samples) > 0.95 * ceiling


def test_retry_after_spread_bounds() -> None:
    policy = RetryPolicy(retry_after_spread=0.5)
    assert policy.retry_after_delay(3.0, FixedRandom(0.0)) == 3.0
    assert policy.retry_after_delay(3.0, FixedRandom(0.5)) == 3.75
    # The interval is [ra, ra * (1 + spread)]; its top is reached up to float rounding.
    assert 4.4999 < policy.retry_after_delay(3.0, FixedRandom(ALMOST_ONE)) <= 4.5


def test_zero_spread_sleeps_exactly_retry_after() -> None:
    assert RetryPolicy(retry_after_spread=0.0).retry_after_delay(3.0, random.Random(1)) == 3.0


@pytest.mark.parametrize("status", [429, 503])
def test_retry_after_is_honoured_on_429_and_503(status: int) -> None:
    policy = RetryPolicy(retry_after_spread=0.5)
    delay = policy.delay_for_status(
        status, headers(retry_after_ms="2000"), 0, FixedRandom(0.5), wall_now=0.0
    )
    assert delay == 2.5


@pytest.mark.parametrize("status", [502, 504])
def test_retry_after_is_ignored_on_502_and_504(status: int) -> None:
    policy = RetryPolicy(backoff_base=0.5)
    delay = policy.delay_for_status(
        status, headers(retry_after="30"), 1, FixedRandom(0.5), wall_now=0.0
    )
    assert delay == 0.5  # full jitter: 0.5 * min(8, 0.5 * 2**1)


@pytest.mark.parametrize("advice", [{}, {"retry_after": "garbage"}, {"retry_after": "0"}])
def test_429_without_usable_advice_backs_off_with_full_jitter(advice: dict[str, str]) -> None:
    policy = RetryPolicy(backoff_base=0.5)
    delay = policy.delay_for_status(429, headers(**advice), 2, FixedRandom(0.25), wall_now=0.0)
    assert delay == 0.5  # 0.25 * min(8, 0.5 * 2**2)


@pytest.mark.parametrize("status", [200, 400, 401, 403, 404, 500])
def test_other_statuses_are_not_retried(status: int) -> None:
    policy = RetryPolicy()
    assert (
        policy.delay_for_status(status, headers(retry_after="1"), 0, random.Random(0), wall_now=0.0)
        is None
    )


def test_retry_after_longer_than_the_maximum_is_not_waited_for() -> None:
    policy = RetryPolicy(max_retry_after=60.0)
    assert (
        policy.delay_for_status(429, headers(retry_after="61"), 0, FixedRandom(0.0), wall_now=0.0)
        is None
    )
    assert (
        policy.delay_for_status(429, headers(retry_after="60"), 0, FixedRandom(0.0), wall_now=0.0)
        == 60.0
    )


def test_only_errors_before_the_request_left_are_retried() -> None:
    policy = RetryPolicy(backoff_base=1.0)
    rng = FixedRandom(0.5)
    assert policy.delay_for_error(httpx.ConnectError("refused"), 0, rng) == 0.5
    assert policy.delay_for_error(httpx.ConnectTimeout("slow"), 0, rng) == 0.5
    for error in (
        httpx.ReadTimeout("t"),
        httpx.ReadError("cut"),
        httpx.WriteError("w"),
        httpx.RemoteProtocolError("p"),
        httpx.PoolTimeout("pool"),
    ):
        assert policy.delay_for_error(error, 0, rng) is None


@pytest.mark.parametrize(
    "kwargs",
    [
        {"max_attempts": 0},
        {"backoff_base": -1.0},
        {"backoff_cap": -1.0},
        {"retry_after_spread": -0.1},
        {"max_retry_after": -1.0},
    ],
)
def test_invalid_policy_is_refused(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        RetryPolicy(**kwargs)  # type: ignore[arg-type]


def test_budget_starts_with_its_allowance_and_refills_by_ratio() -> None:
    budget = RetryBudget(ratio=0.1, initial=2.0)
    assert budget.try_spend() and budget.try_spend()
    assert not budget.try_spend()
    for _ in range(9):
        budget.deposit()
    assert not budget.try_spend()  # 0.9 tokens
    budget.deposit()
    assert budget.try_spend()  # ten deposits of 0.1 make exactly one token
    assert budget.tokens == 0.0


def test_budget_never_holds_more_than_its_capacity() -> None:
    budget = RetryBudget(ratio=0.5, initial=1.0, capacity=2.0)
    for _ in range(100):
        budget.deposit()
    assert budget.tokens == 2.0


@pytest.mark.parametrize(
    "kwargs",
    [{"ratio": -0.1}, {"ratio": 1.5}, {"initial": -1.0}, {"initial": 5.0, "capacity": 1.0}],
)
def test_invalid_budget_is_refused(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        RetryBudget(**kwargs)


def make_request(timeout: httpx.Timeout | None, **hdrs: str) -> httpx.Request:
    request = httpx.Request(
        "POST",
        "http://gw/v1/chat/completions",
        content=b"{}",
        headers={k.replace("_", "-"): v for k, v in hdrs.items()},
    )
    if timeout is not None:
        request.extensions["timeout"] = timeout.as_dict()
    return request


def test_time_budget_is_the_read_timeout_httpx_sets() -> None:
    assert request_time_budget(make_request(httpx.Timeout(30.0, connect=2.0))) == 30.0


def test_time_budget_headers_tighten_the_timeout() -> None:
    request = make_request(httpx.Timeout(600.0), x_request_timeout="12", x_stainless_timeout="20")
    assert request_time_budget(request) == 12.0


def test_no_timeout_means_no_deadline() -> None:
    assert request_time_budget(make_request(httpx.Timeout(None))) is None
    assert request_time_budget(make_request(None)) is None
    assert request_time_budget(make_request(None, x_request_timeout="bogus")) is None
