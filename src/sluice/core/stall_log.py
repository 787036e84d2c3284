"""Stalls: stretches of time during which the host did not run the gateway at all (a VM
paused by its hypervisor, a process not scheduled for seconds). The latency signals must
not read them as the engine's queueing: a first token that came during a 2 s stall is
seen 2 s late whatever the engine did, and the engine itself was usually not run either
(on the 2-core VM of `make test-vllm`, every process stops together for 0.5-10 s several
times a minute while vLLM computes: tests/vllm/machine_stalls.py). The controller takes
the stalled part out of a request's TTFT, TPOT and first-token alarm (`stalled(a, b)`);
the shell's watcher (gateway/stall_watch.py) reports them. Virtual time has none.

Pure: spans come in as (start, end) on the controller's clock; overlapping or touching
spans merge; spans older than `keep_s` before the newest are forgotten (no request waits
that long for its first token)."""

from __future__ import annotations

from collections import deque
from typing import Protocol


class StallSource(Protocol):
    def stalled(self, start: float, end: float) -> float:
        """Seconds of [start, end] during which the host did not run the gateway."""
        ...


class StallLog:
    __slots__ = ("_spans", "keep_s", "total_s")

    def __init__(self, keep_s: float = 120.0) -> None:
        self.keep_s = keep_s
        self._spans: deque[tuple[float, float]] = deque()
        self.total_s = 0.0  # every stall recorded, in seconds (for the shell's metric)

    def add(self, start: float, end: float) -> None:
        if end <= start:
            return
        spans = self._spans
        if spans and start <= spans[-1][1]:  # overlaps the newest (reported twice)
            last_start, last_end = spans.pop()
            self.total_s -= last_end - last_start
            start, end = min(start, last_start), max(end, last_end)
        spans.append((start, end))
        self.total_s += end - start
        while spans and spans[0][1] < end - self.keep_s:
            spans.popleft()

    def stalled(self, start: float, end: float) -> float:
        total = 0.0
        for s, e in reversed(self._spans):
            if e <= start:
                break  # the spans are in order, and none after this one reaches `start`
            total += max(0.0, min(e, end) - max(s, start))
        return total
