"""CPU accounting from /proc: a process tree's CPU time and the whole machine's busy share.

A process's utime+stime in /proc/PID/stat already covers all its threads; a proxy that
forks workers (nginx, granian) is covered by summing every live descendant of its root.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

TICK_HZ = float(os.sysconf("SC_CLK_TCK"))


def _stat_fields(pid: int) -> list[str] | None:
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # comm may contain spaces and parentheses: split after the last ')'.
    return raw[raw.rindex(")") + 2 :].split()


def process_tree(root: int) -> list[int]:
    """The root pid and all its live descendants."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        fields = _stat_fields(int(entry))
        if fields is not None:
            children.setdefault(int(fields[1]), []).append(int(entry))
    tree, todo = [], [root]
    while todo:
        pid = todo.pop()
        tree.append(pid)
        todo.extend(children.get(pid, []))
    return tree


def cpu_seconds(pids: list[int]) -> float:
    """utime+stime of the given processes (all their threads), in seconds."""
    total = 0
    for pid in pids:
        fields = _stat_fields(pid)
        if fields is not None:
            total += int(fields[11]) + int(fields[12])  # utime, stime (fields 14, 15)
    return total / TICK_HZ


def _machine_times() -> tuple[int, int]:
    with open("/proc/stat") as f:
        values = [int(v) for v in f.readline().split()[1:]]
    idle = values[3] + values[4]  # idle + iowait
    return sum(values[:8]), idle  # user..steal; guest time is already inside user


class BusySampler:
    """Samples the whole machine's busy fraction every `interval` s in a thread."""

    def __init__(self, interval: float = 0.25) -> None:
        self.interval = interval
        self.samples: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._start_times = _machine_times()

    def _loop(self) -> None:
        prev_total, prev_idle = self._start_times
        while not self._stop.wait(self.interval):
            total, idle = _machine_times()
            if total > prev_total:
                self.samples.append(1.0 - (idle - prev_idle) / (total - prev_total))
            prev_total, prev_idle = total, idle

    def __enter__(self) -> BusySampler:
        self._start_times = _machine_times()
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join()
        total, idle = _machine_times()
        start_total, start_idle = self._start_times
        self.mean = 1.0 - (idle - start_idle) / max(1, total - start_total)

    @property
    def max(self) -> float:
        return max(self.samples, default=self.mean)
