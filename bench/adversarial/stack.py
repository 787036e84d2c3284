"""Processes for the adversarial benchmarks: simulators, a gateway whose log is captured
to a file, a redis-server with a password, RSS sampling, and the machine's busy share
(sluice.bench.procfs's sampler). Real processes on 127.0.0.1 only."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from sluice.bench.procfs import BusySampler, rss_mib

REPO = Path(__file__).resolve().parents[2]

__all__ = ["BusySampler", "Proc", "free_port", "rss_mib", "start_gateway", "start_redis"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Proc:
    proc: subprocess.Popen[bytes]
    url: str
    log: Path | None = None
    extra: dict[str, str] = field(default_factory=dict)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


def _wait_http(url: str, path: str, proc: subprocess.Popen[bytes], timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            if httpx.get(url + path, timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"{url} did not come up")
        time.sleep(0.05)


def _sluice(*args: str) -> list[str]:
    return [sys.executable, "-m", "sluice.cli", *args]


def start_sim(*args: str, log: Path | None = None) -> Proc:
    port = free_port()
    out = open(log, "wb") if log else subprocess.DEVNULL  # noqa: SIM115
    proc = subprocess.Popen(
        _sluice("sim", "--port", str(port), *args), stdout=out, stderr=subprocess.STDOUT
    )
    url = f"http://127.0.0.1:{port}"
    _wait_http(url, "/health", proc)
    return Proc(proc, url, log)


def start_gateway(policy: str, folder: Path, *args: str, src: Path | None = None) -> Proc:
    """`sluice serve` on the policy text, JSON logs captured in folder/gateway.log; from
    another source tree's `src/` if given (a before/after comparison in one run)."""
    path = folder / "policy.yaml"
    path.write_text(policy)
    log = folder / "gateway.log"
    port = free_port()
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if src is not None:
        env["PYTHONPATH"] = str(src)
    proc = subprocess.Popen(
        _sluice("serve", "--config", str(path), "--port", str(port), "--log-format", "json", *args),
        stdout=open(log, "wb"),  # noqa: SIM115
        stderr=subprocess.STDOUT,
        env=env,
    )
    url = f"http://127.0.0.1:{port}"
    _wait_http(url, "/readyz", proc)
    return Proc(proc, url, log, {"policy": str(path)})


def start_redis(folder: Path, password: str) -> Proc:
    exe = shutil.which("redis-server")
    if exe is None:
        raise RuntimeError("redis-server is missing: run scripts/ensure_redis.sh")
    port = free_port()
    args = [exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
    args += ["--dir", str(folder), "--requirepass", password]
    proc = subprocess.Popen(
        args,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 10
    while True:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                break
        if time.monotonic() > deadline:
            raise RuntimeError("redis-server did not start")
        time.sleep(0.05)
    return Proc(proc, f"redis://:{password}@127.0.0.1:{port}/0")
