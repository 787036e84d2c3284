"""The deadline of one upstream call: what `asyncio.timeout` does for the relay, for a
fraction of its cost per request (one timer handle, no state machine).

At the deadline the task is cancelled. `settle()`, called once on every way out of the
call (a `finally`), stops the timer and tells whether the deadline ended the call: then the
deadline's cancellation is taken back, whatever the call raised on the way out (aiohttp
may turn a cancellation into an error of its own), as `asyncio.timeout` does. Any other
cancellation, such as the client hanging up, stays a cancellation, even at the deadline."""

from __future__ import annotations

import asyncio


class UpstreamDeadline:
    __slots__ = ("_cancelling", "_handle", "_task", "expired")

    def __init__(self, delay: float) -> None:
        task = asyncio.current_task()
        if task is None:
            raise RuntimeError("UpstreamDeadline must be created inside a task")
        self._task = task
        self._cancelling = task.cancelling()
        self.expired = False
        self._handle = asyncio.get_running_loop().call_later(delay, self._expire)

    def _expire(self) -> None:
        self.expired = True
        self._task.cancel()

    def settle(self) -> bool:
        """The call is over (ask once): whether the deadline alone ended it."""
        self._handle.cancel()
        return self.expired and self._task.uncancel() <= self._cancelling
