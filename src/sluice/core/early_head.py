"""Whether a relayed stream's head may go out before its first event.

The relay holds a stream's head (HTTP 200 and its headers) until the backend's first
event, because vLLM started with `--max-num-queued-reqs` answers a burst's streams 200
and then refuses those past its cap in their first event (docs/vllm.md): with the head
still in hand, the gateway turns that into one more try or 503 with Retry-After. Held,
though, the head reaches the client together with the first token, and the client reads
it on its time to the first token: about 0.45 ms of httpx's (guidellm's client), which a
client straight on the engine spends during the prefill (docs/operations.md).

Such a refusal needs the engine full: it counts the requests running and waiting against
its cap, and past what it runs at once its requests wait. So the head waits for the
first event only while the backend may be full: its engine showed requests waiting on
two scrapes in a row (one is any arrival between two engine steps), or it refused a
request as overloaded, within the last `memory_s`; or nothing fresh says otherwise (no
scrape yet, metrics stale or absent). It waits too for a request whose client stated a
deadline (X-Request-Timeout): one that passes before the first token is the gateway's
504, which the SDKs retry, not an error event after a 200 (the controller's `_started`).
Otherwise the head goes as soon as the backend's came. A refusal that comes all the same
(an engine whose cap is below what it runs at once, refusing with nothing waiting) ends
the stream with the route's error event, as the engine's own stream would have; and from
then on the heads wait again.
"""

from __future__ import annotations

import math


class EarlyHead:
    __slots__ = ("_pressure_at", "_waiting_before", "memory_s")

    def __init__(self, memory_s: float = 30.0) -> None:
        self.memory_s = memory_s
        self._pressure_at = -math.inf
        self._waiting_before = False

    def on_scrape(self, waiting: float | None, now: float) -> None:
        """A fresh scrape: `waiting` requests in the engine (None: it does not say)."""
        queued = waiting is not None and waiting > 0
        if queued and self._waiting_before:
            self._pressure_at = now
        self._waiting_before = queued

    def on_refusal(self, now: float) -> None:
        """The backend refused a request as overloaded (503/429, or an error event)."""
        self._pressure_at = now

    def allowed(self, metrics_fresh: bool, now: float) -> bool:
        """May a stream sent to this backend now have its head relayed at once?"""
        return metrics_fresh and now - self._pressure_at >= self.memory_s
