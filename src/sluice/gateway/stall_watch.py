"""The shell's side of core/stall_log.py: a thread that wakes every `TICK_S` and records
each wake-up later than `MIN_S` as a stall (the host did not run this process). A thread
rather than the event loop: a loop busy with requests is late too, and that lateness is
the gateway's work, not a stall; a thread gets the GIL within the interpreter's switch
interval (5 ms) whatever the loop does. The same watch as tests/vllm/machine_stalls.py.

Asked by the controller (`stalled`), it first takes what the thread recorded, and a stall
still in progress from the thread's point of view: after a stall the loop may handle a
first token before the thread has run again, so a thread silent for longer than a tick
and `MIN_S` is a stall up to now (the thread's own record of it later merges with it)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from sluice.core.stall_log import StallLog

TICK_S = 0.02
MIN_S = 0.05  # shorter waits are the OS's scheduling at any load


class StallWatch:
    def __init__(
        self,
        *,
        tick_s: float = TICK_S,
        min_s: float = MIN_S,
        on_stall: Callable[[float], None] | None = None,
    ) -> None:
        self.tick_s = tick_s
        self.min_s = min_s
        self.log = StallLog()
        self._on_stall = on_stall  # each stall's seconds, once recorded (a metric)
        self._new: list[tuple[float, float]] = []  # recorded by the thread, not yet taken
        self._lock = threading.Lock()
        self._last = time.monotonic()  # the thread's last wake-up
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        if self._thread is None:
            self._last = time.monotonic()
            self._thread = threading.Thread(target=self._watch, name="stall-watch", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def _watch(self) -> None:
        while not self._stop.wait(self.tick_s):
            now = time.monotonic()
            late = now - self._last - self.tick_s
            if late > self.min_s:
                with self._lock:
                    self._new.append((self._last + self.tick_s, now))
            self._last = now

    def stalled(self, start: float, end: float) -> float:
        """Seconds of [start, end] (time.monotonic) during which this process did not run."""
        if self._new:
            with self._lock:
                new, self._new = self._new, []
            for a, b in new:
                self._record(a, b)
        last = self._last
        if self._thread is not None and end - last - self.tick_s > self.min_s:
            self._record(last + self.tick_s, end)  # in progress for the thread
        return self.log.stalled(start, end)

    def _record(self, a: float, b: float) -> None:
        before = self.log.total_s
        self.log.add(a, b)
        if self._on_stall is not None and self.log.total_s > before:
            self._on_stall(self.log.total_s - before)
