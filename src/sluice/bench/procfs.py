"""What the bench, bench/overhead, bench/adversarial and the tests read from /proc: a
process's (or a process tree's) CPU time, its resident memory, and the whole machine's busy
fraction. Linux only, like the machines these run on.

A process's utime + stime in /proc/PID/stat already covers all its threads; a proxy that
forks workers (nginx, granian) is covered by summing every live descendant of its root."""

from __future__ import annotations

import os
import re
import threading
from pathlib import Path
from typing import Any

TICK_HZ = float(os.sysconf("SC_CLK_TCK"))
# a sample at or above this busy fraction means the machine, not the subject, set the pace
SATURATED_AT = 0.9
_RSS = re.compile(r"^VmRSS:\s+(\d+) kB", re.M)


def _stat_fields(pid: int) -> list[str] | None:
    """/proc/PID/stat after the command name (which may hold spaces and parentheses):
    fields[0] is field 3 (the state), so field N is fields[N - 3]."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text(encoding="ascii")
    except (OSError, UnicodeDecodeError):
        return None
    return raw[raw.rindex(")") + 2 :].split()


def process_cpu_s(pid: int, reaped_children: bool = False) -> float | None:
    """CPU seconds (user + system, all threads) a live process has used so far; with
    `reaped_children`, also what its waited-for children used. None once it is gone."""
    fields = _stat_fields(pid)
    if fields is None:
        return None
    used = fields[11:15] if reaped_children else fields[11:13]  # utime stime [cutime cstime]
    return sum(int(v) for v in used) / TICK_HZ


def process_tree(root: int) -> list[int]:
    """The root pid and all its live descendants."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (fields := _stat_fields(int(entry))) is not None:
            children.setdefault(int(fields[1]), []).append(int(entry))
    tree, todo = [], [root]
    while todo:
        pid = todo.pop()
        tree.append(pid)
        todo.extend(children.get(pid, []))
    return tree


def cpu_seconds(pids: list[int]) -> float:
    """CPU seconds (user + system) of the given processes; a gone one counts 0."""
    return sum(process_cpu_s(pid) or 0.0 for pid in pids)


def rss_mib(pid: int) -> float:
    """A live process's resident memory in MiB (0 once it is gone)."""
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return 0.0
    m = _RSS.search(text)
    return int(m.group(1)) / 1024 if m else 0.0


def _machine_times() -> tuple[int, int]:
    """(all ticks, idle ticks) of every core together since boot."""
    with open("/proc/stat", encoding="ascii") as f:
        values = [int(v) for v in f.readline().split()[1:]]
    idle = values[3] + values[4]  # idle + iowait
    return sum(values[:8]), idle  # user..steal; guest time is already inside user


class CpuSampler:
    """The whole machine's busy fraction (all cores together) over each interval between
    calls of `sample`."""

    def __init__(self) -> None:
        self.samples: list[float] = []
        self._last = self._first = _machine_times()

    def busy_s(self) -> float:
        """CPU seconds the whole machine (every process, all cores) spent since creation."""
        total, idle = _machine_times()
        t0, i0 = self._first
        return ((total - idle) - (t0 - i0)) / TICK_HZ

    def mean(self) -> float:
        """The busy fraction from creation to now."""
        total, idle = _machine_times()
        t0, i0 = self._first
        return 1.0 - (idle - i0) / max(1, total - t0)

    def sample(self) -> None:
        total, idle = _machine_times()
        t0, i0 = self._last
        if total > t0:
            self.samples.append(1.0 - (idle - i0) / (total - t0))
        self._last = (total, idle)

    def summary(self) -> dict[str, Any]:
        return cpu_summary(self.samples)


class BusySampler:
    """A CpuSampler sampled every `interval` s in a thread, for a `with` block: `mean` (the
    whole block) and `max` (the busiest interval) once it has ended."""

    def __init__(self, interval: float = 0.25) -> None:
        self.interval = interval
        self.cpu = CpuSampler()
        self.mean = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    @property
    def samples(self) -> list[float]:
        return self.cpu.samples

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            self.cpu.sample()

    def __enter__(self) -> BusySampler:
        self.cpu = CpuSampler()
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join()
        self.mean = self.cpu.mean()

    @property
    def max(self) -> float:
        return max(self.cpu.samples, default=self.mean)


def cpu_summary(samples: list[float]) -> dict[str, Any]:
    """Busy fractions as a report shows them: max, mean, cores, and whether saturated."""
    busy = max(samples) if samples else None
    mean = sum(samples) / len(samples) if samples else None
    return {
        "busy_fraction_max": None if busy is None else round(busy, 3),
        "busy_fraction_mean": None if mean is None else round(mean, 3),
        "cores": os.cpu_count(),
        "samples": len(samples),
        "saturated": busy is not None and busy >= SATURATED_AT,
    }
