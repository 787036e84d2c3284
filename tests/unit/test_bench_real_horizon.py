"""How long a real-mode run waits for refused clients to come back (bench/real.py): the
longest Retry-After stretched by the client's own jitter, exact."""

from __future__ import annotations

import pytest

from sluice.bench.harness import ArmSpec
from sluice.bench.real import longest_return_wait
from sluice.bench.scenario import Retry
from sluice.bench.workload import ClientRequest


def request(index: int, retry: Retry) -> ClientRequest:
    return ClientRequest(
        index=index,
        request_id=f"r{index}",
        arrival=0.0,
        phase=0,
        priority=2,
        tenant="t",
        weight=1.0,
        prompt_tokens=10,
        max_tokens=10,
        output_tokens=10,
        cancel_after=None,
        deadline=None,
        retry=retry,
    )


def test_the_wait_covers_the_retry_after_and_the_clients_jitter() -> None:
    workload = [
        request(0, Retry(max_attempts=6, spread=0.5)),
        request(1, Retry(max_attempts=3, spread=0.2)),
        request(2, Retry(max_attempts=1, spread=2.0)),  # never retries
        request(3, Retry(max_attempts=4, spread=3.0, follow_retry_after=False)),
    ]
    # a P2 told 60 s at the burst's end comes back up to 90 s later
    assert longest_return_wait(workload, 60.0, ArmSpec("sluice")) == pytest.approx(90.0)


def test_a_small_spread_still_covers_a_return_window() -> None:
    workload = [request(0, Retry(max_attempts=2, spread=0.01))]
    assert longest_return_wait(workload, 60.0, ArmSpec("sluice")) == pytest.approx(61.0)
    no_jitter = [request(0, Retry(max_attempts=2, spread=0.0))]
    assert longest_return_wait(no_jitter, 60.0, ArmSpec("sluice")) == pytest.approx(60.0)


def test_a_client_that_will_not_wait_that_long_is_not_waited_for() -> None:
    workload = [request(0, Retry(max_attempts=3, spread=0.5, max_retry_after=60.0))]
    assert longest_return_wait(workload, 61.0, ArmSpec("sluice")) == 0.0
    # a peer arm's clients retry as its users' SDK does, whatever the workload says
    sdk = ArmSpec("litellm", client_retry=Retry(max_attempts=3, spread=0.0))
    assert longest_return_wait(workload, 61.0, sdk) == pytest.approx(61.0)
