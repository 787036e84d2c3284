"""`sluice sim` as a command: help, bad options, shutdown."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from tests.integration.conftest import SimFactory

pytestmark = pytest.mark.integration

SLUICE = Path(sys.executable).parent / "sluice"


def sluice_sim(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "sluice.cli", "sim", *args],
        capture_output=True,
        text=True,
        timeout=30,
    )


def test_the_installed_command_has_help() -> None:
    assert SLUICE.exists(), "the venv has no sluice command; run make install"
    done = subprocess.run(
        [str(SLUICE), "sim", "--help"], capture_output=True, text=True, timeout=30
    )
    assert done.returncode == 0
    for option in ("--profile", "--kv-blocks", "--block-size", "--max-num-seqs", "--speed"):
        assert option in done.stdout
    assert "h100-llama3-8b" in done.stdout and "tiny" in done.stdout


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--kv-blocks", "0"], "num_gpu_blocks must be at least 1"),
        (["--profile", "tiny", "--max-model-len", "99999"], "larger than the KV cache"),
        (["--speed", "0"], "--speed must be positive"),
    ],
)
def test_bad_options_are_refused_with_a_reason(args: list[str], needle: str) -> None:
    done = sluice_sim(*args)
    assert done.returncode == 2
    assert needle in done.stderr


def test_an_unknown_profile_is_refused() -> None:
    done = sluice_sim("--profile", "a100-gpt5")
    assert done.returncode == 2
    assert "invalid choice" in done.stderr


def test_a_busy_port_is_reported() -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        done = sluice_sim("--profile", "tiny", "--port", str(port))
    assert done.returncode == 1
    assert f"cannot listen on 127.0.0.1:{port}" in done.stderr


def test_a_smaller_kv_cache_shrinks_the_context_to_fit(sim_factory: SimFactory) -> None:
    sim = sim_factory("--profile", "tiny", "--kv-blocks", "32")
    assert "32 KV blocks x 16 tokens" in sim.ready_line
    assert "max_model_len 512" in sim.ready_line


def test_sigterm_stops_it_promptly_even_with_an_open_stream(sim_factory: SimFactory) -> None:
    sim = sim_factory("--profile", "tiny")
    body = {
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 2000,
        "ignore_eos": True,
        "stream": True,
    }
    with httpx.stream("POST", sim.url + "/v1/chat/completions", json=body, timeout=10) as r:
        next(r.iter_lines())
        started = time.monotonic()
        sim.proc.send_signal(signal.SIGTERM)
        code = sim.proc.wait(timeout=5)
    assert code == 0
    assert time.monotonic() - started < 3
