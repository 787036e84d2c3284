"""`sluice serve --workers N`: N gateway processes sharing one port.

A small master starts N `sluice serve` worker processes on the same host and port; each
binds it with SO_REUSEPORT (the kernel spreads new connections over them) and runs its
own controller, limiters and queues, like replicas behind a Service. The master:

  * reserves the port (a bound, non-listening SO_REUSEPORT socket when --port is 0);
  * creates the folder through which prometheus_client adds the workers' metrics up
    (PROMETHEUS_MULTIPROC_DIR), and removes it at exit;
  * with no backend configured, runs the simulated backends once, for all workers;
  * says `Sluice listening on ...` once every worker listens;
  * forwards SIGTERM/SIGINT (each worker drains as a single gateway does) and exits
    when they have.

It restarts nothing, on purpose: a worker that dies unexpectedly makes the master drain
the others and exit non-zero, so that the supervisor (Kubernetes, systemd) restarts the
whole gateway cleanly rather than the master hiding a crash loop behind a half-sized
gateway. Workers die with the master (PR_SET_PDEATHSIG) if it is killed outright."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ctypes
import logging
import os
import secrets
import shutil
import signal
import socket
import sys
import tempfile
from typing import Any

from prometheus_client.multiprocess import mark_process_dead

from sluice.config import Policy
from sluice.gateway.returns import SECRET_ENV as BOOKING_SECRET_ENV

log = logging.getLogger("sluice.workers")

READY_FD_ENV = "SLUICE_READY_FD"
START_TIMEOUT_S = 60.0
_PR_SET_PDEATHSIG = 1


def reserve_port(host: str, port: int) -> socket.socket:
    """A bound SO_REUSEPORT socket that holds the port for the workers. It never
    listens, so it takes no connections."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    return sock


def worker_argv(args: argparse.Namespace, port: int, index: int, backends: list[str]) -> list[str]:
    """The command line of worker `index`: the master's own options, one worker, the
    reserved port, and the backends (the configured ones or the master's simulated)."""
    argv = [
        sys.executable,
        "-m",
        "sluice.cli",
        "serve",
        "--host",
        args.host,
        "--port",
        str(port),
        "--worker-index",
        str(index),
        "--workers",  # how many share the backends (each worker's fleet share prior)
        str(args.workers),
        "--log-level",
        args.log_level,
        "--log-format",
        args.log_format,
    ]
    if args.config:
        argv += ["--config", args.config]
    if args.no_access_log:
        argv.append("--no-access-log")
    for url in backends:
        argv += ["--backend", url]
    return argv


def die_with_parent() -> None:
    """A worker ends with its master, even when the master is SIGKILLed (Linux)."""
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


def report_ready(index: int) -> None:
    """Tell the master this worker listens (a line on the pipe it inherited)."""
    fd = os.environ.get(READY_FD_ENV)
    if fd is None:
        return
    with contextlib.suppress(OSError, ValueError):
        os.write(int(fd), f"{index}\n".encode())
        os.close(int(fd))


def run_master(policy: Policy, args: argparse.Namespace) -> int:
    import uvloop

    return uvloop.run(_master(policy, args))


async def _master(policy: Policy, args: argparse.Namespace) -> int:
    metrics_dir = tempfile.mkdtemp(prefix="sluice-metrics-")
    embedded = None
    procs: list[asyncio.subprocess.Process] = []
    holder: socket.socket | None = None
    try:
        backends = list(args.backend)
        if not policy.backends and not backends:
            from sluice.gateway.embedded import EmbeddedBackends

            embedded = EmbeddedBackends(profile=args.sim_profile, speed=args.sim_speed)
            started = await embedded.start()
            backends = [b.url for b in started]
            print(
                f"No backend configured: started {len(started)} simulated backends "
                f"({args.sim_profile}) at {', '.join(backends)}, shared by "
                f"{args.workers} workers",
                flush=True,
            )
            for t in policy.tenants:
                if t.api_keys:
                    print(
                        f"  demo key for {t.name} (P{t.priority}): {', '.join(t.api_keys)}",
                        flush=True,
                    )
        try:
            holder = reserve_port(args.host, args.port)
        except OSError as exc:
            print(
                f"sluice serve: cannot listen on {args.host}:{args.port}: {exc.strerror}",
                file=sys.stderr,
                flush=True,
            )
            return 1
        port = int(holder.getsockname()[1])
        read_fd, write_fd = os.pipe()
        env = dict(
            os.environ,
            PROMETHEUS_MULTIPROC_DIR=metrics_dir,
            **{READY_FD_ENV: str(write_fd)},
            # one key for every worker's booking tokens: a return lands on any of them
            **{BOOKING_SECRET_ENV: secrets.token_hex(32)},
        )
        try:
            for i in range(args.workers):
                procs.append(
                    await asyncio.create_subprocess_exec(
                        *worker_argv(args, port, i, backends), env=env, pass_fds=(write_fd,)
                    )
                )
        finally:
            os.close(write_fd)
        return await _supervise(
            procs, read_fd, args, port, policy.server.shutdown_grace, metrics_dir
        )
    finally:
        for p in procs:
            if p.returncode is None:
                p.kill()
                await p.wait()
        if holder is not None:
            holder.close()
        if embedded is not None:
            await embedded.stop()
        shutil.rmtree(metrics_dir, ignore_errors=True)


async def _supervise(
    procs: list[asyncio.subprocess.Process],
    read_fd: int,
    args: argparse.Namespace,
    port: int,
    grace_s: float,
    metrics_dir: str,
) -> int:
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    exits = {asyncio.ensure_future(p.wait()): p for p in procs}
    if not await _wait_ready(read_fd, len(procs), list(exits), stop):
        await _terminate(procs, grace_s)
        if stop.is_set():
            return 0
        print("sluice serve: the workers did not all start", file=sys.stderr, flush=True)
        return 1
    print(
        f"Sluice listening on http://{args.host}:{port} ({len(procs)} workers, pids "
        f"{', '.join(str(p.pid) for p in procs)})",
        flush=True,
    )
    stopping = asyncio.ensure_future(stop.wait())
    done, _ = await asyncio.wait([stopping, *exits], return_when=asyncio.FIRST_COMPLETED)
    code = 0
    if stopping not in done:
        crashed = next(exits[f] for f in done)
        log.error(
            "worker pid %d exited with code %s; draining the others and exiting",
            crashed.pid,
            crashed.returncode,
        )
        print(
            f"sluice serve: worker pid {crashed.pid} exited with code "
            f"{crashed.returncode}; stopping",
            file=sys.stderr,
            flush=True,
        )
        code = 1
    stopping.cancel()
    await _terminate(procs, grace_s)
    for p in procs:
        mark_process_dead(p.pid, metrics_dir)
    return code


async def _wait_ready(
    read_fd: int, n: int, exits: list[asyncio.Future[int]], stop: asyncio.Event
) -> bool:
    """True once `n` workers said they listen; False if one exits first, a signal
    comes, or START_TIMEOUT_S passes."""
    reader = asyncio.StreamReader()
    loop = asyncio.get_running_loop()
    transport, _ = await loop.connect_read_pipe(
        lambda: asyncio.StreamReaderProtocol(reader), os.fdopen(read_fd, "rb")
    )
    try:

        async def lines() -> bool:
            ready = 0
            while ready < n:
                if not await reader.readline():
                    return False
                ready += 1
            return True

        reading = asyncio.ensure_future(lines())
        stopping = asyncio.ensure_future(stop.wait())
        waited: list[asyncio.Future[Any]] = [reading, stopping, *exits]
        done, _ = await asyncio.wait(
            waited,
            timeout=START_TIMEOUT_S,
            return_when=asyncio.FIRST_COMPLETED,
        )
        reading.cancel()
        stopping.cancel()
        return reading in done and reading.result()
    finally:
        transport.close()


async def _terminate(procs: list[asyncio.subprocess.Process], grace_s: float) -> None:
    """SIGTERM to every live worker; SIGKILL whatever is left after the grace period."""
    for p in procs:
        if p.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                p.send_signal(signal.SIGTERM)
    waits = [asyncio.ensure_future(p.wait()) for p in procs]
    _, pending = await asyncio.wait(waits, timeout=grace_s + 5.0)
    for p in procs:
        if p.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                p.kill()
    if pending:
        await asyncio.wait(pending)
