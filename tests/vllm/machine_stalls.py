"""Notice when the machine stops running this process: while vLLM computes on this 2-core
VM, every other process is sometimes not run for seconds (measured with an independent
watcher process and with vmstat: 2-10 s gaps, several a minute during the overload tests;
a plain CPU hog on both cores causes none). Timers of the test, the gateway and the
clients are then all overdue together, so a test that times a client against the gateway
cannot tell such a stall from a hang, nor measure a 100 ms bound across one.

    with MachineStalls() as stalls:
        t0 = time.monotonic(); ...; t1 = time.monotonic()
    stalls.during(t0, t1)  # the stalls that overlapped [t0, t1]
    print(stalls.summary())
"""

from __future__ import annotations

import threading
import time
from types import TracebackType

_TICK_S = 0.02


class MachineStalls:
    """A thread that wakes every 20 ms and records each wake-up later than `min_s`."""

    def __init__(self, min_s: float = 0.1) -> None:
        self.min_s = min_s
        self.stalls: list[tuple[float, float]] = []  # (monotonic start, seconds)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)

    def __enter__(self) -> MachineStalls:
        self._thread.start()
        return self

    def __exit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._stop.set()
        self._thread.join()

    def _watch(self) -> None:
        last = time.monotonic()
        while not self._stop.wait(_TICK_S):
            now = time.monotonic()
            if now - last - _TICK_S > self.min_s:
                self.stalls.append((last + _TICK_S, now - last - _TICK_S))
            last = now

    def during(self, t0: float, t1: float) -> list[tuple[float, float]]:
        return [(start, s) for start, s in self.stalls if start < t1 and start + s > t0]

    def summary(self) -> str:
        if not self.stalls:
            return f"machine stalls over {self.min_s * 1000:.0f} ms: none"
        longest = max(s for _, s in self.stalls)
        return (
            f"machine stalls over {self.min_s * 1000:.0f} ms: {len(self.stalls)}, "
            f"{sum(s for _, s in self.stalls):.1f} s in all, longest {longest:.1f} s"
        )
