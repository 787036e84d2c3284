"""Runs an Engine in real time on the asyncio loop.

The loop steps the engine only while it has work and sleeps on an event otherwise (no
busy loop when idle). Each step is computed at its start and its tokens are delivered at
its end, `duration` later. Back-to-back steps follow the engine's own timeline (the next
step starts when the previous one ends, not when the timer happened to fire), so timer
jitter does not slow the engine down; only a loop that falls more than `MAX_LAG_S` behind
(a starved process) lets the engine lose time."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable

from sluice.sim.engine import (
    FINISH_ABORT,
    FINISH_STOP,
    Engine,
    EngineRequest,
    StepResult,
    TokenEvent,
)

MAX_LAG_S = 0.02


class RequestHandle:
    """What a request's HTTP handler waits on: token events from the engine, in order.

    `on_token` stores the chunk bytes built by `render` (or nothing when `render` is None,
    for a non-streaming answer) and wakes the handler at most once per step."""

    __slots__ = ("_waiter", "chunks", "finish_reason", "generated", "render")

    def __init__(self, render: Callable[[int, str | None], bytes] | None) -> None:
        self.render = render
        self.chunks: list[bytes] = []
        self.generated = 0
        self.finish_reason: str | None = None
        self._waiter: asyncio.Future[None] | None = None

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    def on_token(self, event: TokenEvent) -> None:
        self.generated = event.index + 1
        if event.finish_reason is not None:
            self.finish_reason = event.finish_reason
        elif self.render is None:
            return  # a whole (non-streaming) answer only wakes up at the end
        if self.render is not None:
            self.chunks.append(self.render(event.index, event.finish_reason))
        self._wake()

    def on_abort(self) -> None:
        self.finish_reason = FINISH_ABORT
        self._wake()

    def on_pooled(self) -> None:
        """A prefill-only request is done: its prompt is computed, no token comes."""
        self.finish_reason = FINISH_STOP
        self._wake()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def wait(self) -> None:
        """Return when there are new chunks or the request is done."""
        if self.chunks or self.finish_reason is not None:
            return
        self._waiter = asyncio.get_running_loop().create_future()
        try:
            await self._waiter
        finally:
            self._waiter = None

    def take(self) -> bytes:
        data = b"".join(self.chunks)
        self.chunks.clear()
        return data


class EngineDriver:
    def __init__(self, engine: Engine, *, on_step: Callable[[StepResult], None] | None = None):
        self.engine = engine
        self._on_step = on_step
        self._handles: dict[str, RequestHandle] = {}
        self._has_work = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self.steps = 0

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run(), name="sim-engine")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    def now(self) -> float:
        return asyncio.get_running_loop().time()

    def submit(self, req: EngineRequest, handle: RequestHandle) -> None:
        self.engine.submit(req, self.now())
        self._handles[req.request_id] = handle
        self._has_work.set()

    def abort(self, request_id: str) -> None:
        """The client went away: free the request's blocks at the next step."""
        if self._handles.pop(request_id, None) is not None:
            self.engine.abort(request_id, self.now())
            self._has_work.set()

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        engine = self.engine
        prev_end: float | None = None
        while True:
            if not engine.has_work():
                prev_end = None
                self._has_work.clear()
                await self._has_work.wait()
                continue
            now = loop.time()
            start = now if prev_end is None else max(prev_end, now - MAX_LAG_S)
            result = engine.step(start)
            self.steps += 1
            if result.duration > 0:
                # Behind schedule (a busy machine) the delay is <= 0: still yield, or the
                # engine would starve the HTTP side of the process.
                await asyncio.sleep(max(0.0, result.end - loop.time()))
                prev_end = result.end
            self._deliver(result)
            if self._on_step is not None:
                self._on_step(result)

    def _deliver(self, result: StepResult) -> None:
        handles = self._handles
        for event in result.tokens:
            handle = handles.get(event.request_id)
            if handle is None:
                continue
            if event.finish_reason is not None:
                del handles[event.request_id]
            handle.on_token(event)
        for stats in result.finished:
            if stats.finish_reason == FINISH_ABORT:
                handle = handles.pop(stats.request_id, None)
                if handle is not None:
                    handle.on_abort()
            elif stats.pooling:
                handle = handles.pop(stats.request_id, None)
                if handle is not None:
                    handle.on_pooled()
