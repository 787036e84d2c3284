"""The relay's deadline: its expiry is told apart from every other cancellation (the
client hanging up must stay a cancellation, whichever comes first), and a call that ends
in time is never cancelled afterwards."""

from __future__ import annotations

import asyncio

import pytest

from sluice.gateway.upstream_deadline import UpstreamDeadline


async def _call(
    deadline_s: float,
    done: asyncio.Event,
    convert: bool = False,
    held: list[UpstreamDeadline] | None = None,
) -> str:
    """An upstream call as the relay makes it; `convert`: the client library turns the
    cancellation into an error of its own; `held` gets the deadline once it is set."""
    deadline = UpstreamDeadline(deadline_s)
    if held is not None:
        held.append(deadline)
    timed_out = False
    try:
        try:
            try:
                await done.wait()
            except asyncio.CancelledError:
                if convert:
                    raise ConnectionResetError("closed") from None
                raise
            return "answered"
        finally:
            timed_out = deadline.settle()
    except asyncio.CancelledError:
        if timed_out:
            return "timed out"
        raise
    except ConnectionResetError:
        return "timed out" if timed_out else "failed"


async def test_the_deadline_ends_a_call_as_a_timeout_not_a_cancellation() -> None:
    task = asyncio.create_task(_call(0.01, asyncio.Event()))
    assert await task == "timed out"
    assert task.cancelling() == 0  # taken back: the handler goes on normally


async def test_a_deadline_the_client_library_turned_into_an_error_is_still_a_timeout() -> None:
    task = asyncio.create_task(_call(0.01, asyncio.Event(), convert=True))
    assert await task == "timed out"
    assert task.cancelling() == 0


async def test_a_call_that_ends_in_time_is_not_cancelled_later() -> None:
    done = asyncio.Event()
    done.set()
    assert await _call(0.01, done) == "answered"
    late = asyncio.Event()
    asyncio.get_running_loop().call_later(0.05, late.set)
    await late.wait()  # past the deadline: nothing cancels this task
    assert asyncio.current_task().cancelling() == 0  # type: ignore[union-attr]


async def test_the_client_hanging_up_stays_a_cancellation() -> None:
    task = asyncio.create_task(_call(60.0, asyncio.Event()))
    await asyncio.sleep(0)  # let it start waiting
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


async def test_a_hang_up_at_the_deadline_is_still_a_cancellation() -> None:
    """Both cancel the task before it runs again: the client's wins (it is gone)."""
    held: list[UpstreamDeadline] = []
    task = asyncio.create_task(_call(60.0, asyncio.Event(), held=held))
    await asyncio.sleep(0)  # one turn of the loop: the call runs to its first wait
    assert held
    held[0]._expire()  # the deadline's timer fires...
    task.cancel()  # ...and the client hangs up, both before the task runs again
    assert held[0].expired
    with pytest.raises(asyncio.CancelledError):
        await task
