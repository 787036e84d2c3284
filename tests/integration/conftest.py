"""Shared helpers for integration tests: real `sluice sim` processes on 127.0.0.1.

    sim = start_sim("--profile", "tiny", "--speed", "4")   # or the fixtures below
    sim.url            # "http://127.0.0.1:PORT"
    sim.metrics()      # {"vllm:num_requests_running": 0.0, ...} (summed over labels)
    sim.stop()         # SIGTERM, then SIGKILL if it lingers; sim.kill() for SIGKILL

The simulator binds port 0 (the OS picks a free port) unless `--port` is given, and
`start_sim` reads the port from its ready line, so parallel tests never collide.
Fixtures: `sim` (a tiny-profile simulator for the test) and `sim_factory` (start any
number with any arguments; all are stopped at teardown).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import IO, Protocol

import httpx
import pytest

from sluice.bench.prom_text import parse_metrics

_READY = re.compile(r"serving model .* on (http://\S+)")
_PROJECT_SRC = os.path.join(os.path.dirname(__file__), "..", "..", "src")


@dataclass
class SimProcess:
    proc: subprocess.Popen[str]
    url: str
    ready_line: str
    output: list[str] = field(default_factory=list)  # stdout + stderr lines, as they come

    @property
    def pid(self) -> int:
        return self.proc.pid

    def metrics_text(self, timeout: float = 5.0) -> str:
        response = httpx.get(self.url + "/metrics", timeout=timeout)
        response.raise_for_status()
        return response.text

    def metrics(self) -> dict[str, float]:
        return parse_metrics(self.metrics_text())

    def stop(self, timeout: float = 5.0) -> int:
        """SIGTERM and wait; SIGKILL if it has not exited within `timeout`."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.kill()
        return self.proc.wait()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


def _pump(stream: IO[str], sink: list[str], ready: threading.Event) -> None:
    for line in iter(stream.readline, ""):
        sink.append(line.rstrip("\n"))
        if _READY.search(line):
            ready.set()


def start_sim(*args: str, timeout: float = 30.0) -> SimProcess:
    """Start `sluice sim ARGS...` as a real process and wait until /health answers."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (os.path.abspath(_PROJECT_SRC), env.get("PYTHONPATH")) if p
    )
    env["PYTHONUNBUFFERED"] = "1"
    proc = subprocess.Popen(
        [sys.executable, "-m", "sluice.cli", "sim", "--port", "0", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )
    output: list[str] = []
    ready = threading.Event()
    threading.Thread(target=_pump, args=(proc.stdout, output, ready), daemon=True).start()
    deadline = time.monotonic() + timeout
    while not ready.wait(0.02):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            proc.wait()
            raise RuntimeError("sluice sim did not start:\n" + "\n".join(output))
    line = next(x for x in output if _READY.search(x))
    match = _READY.search(line)
    assert match is not None
    sim = SimProcess(proc=proc, url=match.group(1), ready_line=line, output=output)
    while True:
        try:
            if httpx.get(sim.url + "/health", timeout=1.0).status_code == 200:
                return sim
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            sim.kill()
            raise RuntimeError("sluice sim never answered /health:\n" + "\n".join(output))
        time.sleep(0.01)


class SimFactory(Protocol):
    def __call__(self, *args: str, timeout: float = 30.0) -> SimProcess: ...


@pytest.fixture
def sim_factory() -> Iterator[SimFactory]:
    started: list[SimProcess] = []

    def factory(*args: str, timeout: float = 30.0) -> SimProcess:
        sim = start_sim(*args, timeout=timeout)
        started.append(sim)
        return sim

    yield factory
    for sim in started:
        sim.stop()


@pytest.fixture
def sim(sim_factory: SimFactory) -> SimProcess:
    """A `sluice sim --profile tiny` process for one test."""
    return sim_factory("--profile", "tiny")
