"""Slow or stalled clients cannot hold a connection forever.

What bounds each phase of a connection, at no cost per request:

- the request body: the handler reads it under `server.readTimeout` (app.py);
- between requests on a kept-alive connection, and the next request head: aiohttp's own
  keep-alive timer (`keepalive_timeout` = `server.idleTimeout`) closes a connection that
  has not delivered a complete request head within that time of its previous answer (or
  of its opening); it never fires while a request is being handled, so a long stream is
  never cut;
- the first request head of a new connection, which aiohttp bounds only by that same
  timer: `HeadSweep` below, one pass every `tick_s` over the server's open connections,
  closes those still without a complete request head `server.headerTimeout` after it
  first saw them (so within headerTimeout + 2 ticks of their opening). A client that
  opens connections and trickles their first bytes (slowloris) is cut there.

The sweep reads one private attribute of aiohttp's `RequestHandler`: `_request_count`,
the request heads it has parsed. Without it (another aiohttp) the sweep does not run and
says so once; the idle bound still holds.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from typing import Any

from aiohttp.web_protocol import RequestHandler

from sluice.core.clock import Clock, MonotonicClock

log = logging.getLogger("sluice.slow_clients")

SUMMARY_EVERY_S = 60.0  # cuts are logged as a count at most this often, not one by one
MIN_TICK_S, MAX_TICK_S = 0.05, 1.0


def supported() -> bool:
    """Whether this aiohttp exposes what the sweep reads."""
    return hasattr(RequestHandler, "_request_count")


class HeadSweep:
    """Closes connections that sent no complete request head within `header_timeout_s()`
    of being first seen. `connections()` gives the server's open handlers (aiohttp's
    `Server.connections`); the timeout is read on every pass, so a policy reload
    applies."""

    def __init__(
        self,
        connections: Callable[[], list[Any]],
        header_timeout_s: Callable[[], float],
        *,
        clock: Clock | None = None,
        tick_s: float | None = None,
        on_cut: Callable[[int], None] | None = None,
    ) -> None:
        self._connections = connections
        self._on_cut = on_cut  # e.g. a counter: how many were closed in a pass
        self._timeout = header_timeout_s
        self._clock = clock or MonotonicClock()
        self._tick_s = tick_s
        self._first_seen: dict[Any, float] = {}
        self._task: asyncio.Task[None] | None = None
        self.cut = 0  # connections closed, in all
        self._unreported = 0
        self._reported_at = self._clock.now()

    def tick_s(self) -> float:
        if self._tick_s is not None:
            return self._tick_s
        return min(MAX_TICK_S, max(MIN_TICK_S, self._timeout() / 8))

    def sweep(self) -> int:
        """One pass; returns how many connections it closed."""
        now = self._clock.now()
        limit = self._timeout()
        seen: dict[Any, float] = {}
        cut = 0
        for handler in self._connections():
            if handler._request_count:  # it has sent a head: aiohttp bounds it from here
                continue
            since = self._first_seen.get(handler, now)
            if now - since > limit:
                handler.force_close()
                cut += 1
            else:
                seen[handler] = since
        self._first_seen = seen  # forgets closed connections and those past their head
        self.cut += cut
        if cut and self._on_cut is not None:
            self._on_cut(cut)
        self._unreported += cut
        if self._unreported and now - self._reported_at >= SUMMARY_EVERY_S:
            log.warning(
                "closed %d connections that sent no complete request head within %.0fs",
                self._unreported,
                limit,
            )
            self._unreported = 0
            self._reported_at = now
        return cut

    def start(self) -> None:
        if not supported():
            log.warning(
                "this aiohttp has no RequestHandler._request_count: the header timeout is "
                "off (idle connections are still closed after server.idleTimeout)"
            )
            return
        self._task = asyncio.create_task(self._run(), name="head-sweep")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.tick_s())
            try:
                self.sweep()
            except Exception:  # never let a surprise stop the bound for good
                log.exception("header-timeout sweep failed")
