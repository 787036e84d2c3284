"""`sluice serve`: run the gateway."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import resource
import signal
import sys
from importlib import resources

import uvloop
from aiohttp import web

from sluice.config import (
    Backend,
    ConfigError,
    Policy,
    load_policy,
    lockout_errors,
    missing_environment,
    parse_policy,
)
from sluice.gateway.app import GATEWAY_KEY, create_app
from sluice.gateway.connections import GatewayRunner
from sluice.gateway.logs import setup_logging
from sluice.gateway.slow_clients import HeadSweep

log = logging.getLogger("sluice.serve")


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--config", metavar="PATH", help="policy file (default: the built-in example policy)"
    )
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8080)
    parser.add_argument(
        "--backend",
        action="append",
        default=[],
        metavar="URL",
        help="backend base URL (repeatable); replaces the config's backends",
    )
    parser.add_argument(
        "--sim-profile",
        default="h100-llama3-8b",
        help="profile of the built-in simulated backends (embedded default)",
    )
    parser.add_argument(
        "--sim-speed", type=float, default=1.0, help="speed-up of the built-in simulated backends"
    )
    parser.add_argument(
        "--log-level", default="info", choices=["debug", "info", "warning", "error"]
    )
    parser.add_argument(
        "--log-format",
        default="auto",
        choices=["auto", "json", "text"],
        help="auto: text on a terminal, JSON lines otherwise",
    )
    parser.add_argument(
        "--no-access-log", action="store_true", help="do not log one line per request"
    )
    parser.add_argument(
        "--workers",
        type=_positive_int,
        default=1,
        metavar="N",
        help="gateway processes sharing the port (SO_REUSEPORT), each with "
        "its own limiters; /metrics adds them up (default 1)",
    )
    # set by the master of --workers N for each worker it starts
    parser.add_argument("--worker-index", type=int, default=None, help=argparse.SUPPRESS)


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError("must be at least 1")
    return value


def default_policy() -> Policy:
    text = resources.files("sluice").joinpath("data/policy.yaml").read_text(encoding="utf-8")
    return parse_policy(text, "built-in policy")


def run(args: argparse.Namespace) -> int:
    setup_logging(args.log_level, args.log_format, access=not args.no_access_log)
    try:
        policy = load_policy(args.config) if args.config else default_policy()
        if problems := missing_environment(policy) + lockout_errors(policy):
            raise ConfigError(args.config or "built-in policy", problems)
    except ConfigError as exc:
        print(f"{exc.source}: invalid policy", file=sys.stderr)
        for line in exc.errors:
            print(f"  {line}", file=sys.stderr)
        return 1
    if args.workers > 1 and args.worker_index is None:
        from sluice.gateway.workers import run_master

        return run_master(policy, args)
    if args.worker_index is not None:
        from sluice.gateway.workers import die_with_parent

        die_with_parent()
    try:
        uvloop.run(_serve(policy, args))
    except ListenError as exc:
        print(f"sluice serve: {exc}", file=sys.stderr)
        return 1
    return 0


# File descriptors a process needs besides its client connections: upstream connections,
# Redis, the policy file, logs.
FD_RESERVE = 1024


def _check_descriptors(max_connections: int) -> None:
    """Raise the open-file limit as far as allowed, and say so if server.maxConnections
    plus what the gateway needs besides cannot fit in it (it would fail on accept())."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = max_connections + FD_RESERVE
    if soft != resource.RLIM_INFINITY and soft < want:
        target = want if hard == resource.RLIM_INFINITY else min(want, hard)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):
            pass
    if soft != resource.RLIM_INFINITY and soft < want:
        log.warning(
            "the open-file limit (%d) is below server.maxConnections (%d) + %d for upstream "
            "connections: lower maxConnections or raise the limit (ulimit -n)",
            soft,
            max_connections,
            FD_RESERVE,
        )


class ListenError(Exception):
    """The port could not be bound (in use, or not allowed)."""


async def _serve(policy: Policy, args: argparse.Namespace) -> None:
    embedded = None
    override = tuple(Backend(name=f"backend-{i}", url=u) for i, u in enumerate(args.backend))
    if not policy.backends and not override:
        from sluice.gateway.embedded import EmbeddedBackends

        embedded = EmbeddedBackends(profile=args.sim_profile, speed=args.sim_speed)
        backends = await embedded.start()
        override = tuple(backends)
        print(
            f"No backend configured: started {len(backends)} simulated backends "
            f"({args.sim_profile}) at " + ", ".join(b.url for b in backends),
            flush=True,
        )
        for t in policy.tenants:
            if t.api_keys:
                print(
                    f"  demo key for {t.name} (P{t.priority}): {', '.join(t.api_keys)}", flush=True
                )
    app = create_app(policy, args.config, override or None)
    gateway = app[GATEWAY_KEY]
    # the workers share the backends: each claims 1/N of them (core/fleet_share.py; with
    # Redis, its count of the live processes replaces N at each heartbeat)
    gateway.set_workers(args.workers)
    _check_descriptors(policy.server.max_connections)
    runner = GatewayRunner(
        app,
        max_connections=lambda: gateway.policy.server.max_connections,
        on_malformed=gateway.telemetry.malformed_request,
        on_refused=gateway.telemetry.connections_refused.inc,
        handler_cancellation=True,
        access_log=None,
        shutdown_timeout=policy.server.shutdown_grace,
        # aiohttp's own timer: idle keep-alive, and any request head after the first
        keepalive_timeout=policy.server.idle_timeout,
    )
    await runner.setup()
    server = runner.server
    assert server is not None
    # the first request head of a new connection (slow_clients.py)
    head_sweep = HeadSweep(
        lambda: server.connections,
        lambda: gateway.policy.server.header_timeout,
        on_cut=gateway.telemetry.slow_clients.inc,
    )
    worker = args.worker_index
    site = web.TCPSite(
        runner, args.host, args.port, backlog=1024, reuse_port=True if worker is not None else None
    )
    try:
        await site.start()
    except OSError as exc:
        await runner.cleanup()
        if embedded is not None:
            await embedded.stop()
        raise ListenError(f"cannot listen on {args.host}:{args.port}: {exc.strerror}") from exc
    port = site._server.sockets[0].getsockname()[1] if site._server else args.port  # type: ignore[attr-defined]
    if worker is None:
        print(f"Sluice listening on http://{args.host}:{port}", flush=True)
    else:
        from sluice.gateway.workers import report_ready

        log.info("worker %d (pid %d) serving on %s:%d", worker, os.getpid(), args.host, port)
        report_ready(worker)
    head_sweep.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    log.info(
        "shutting down: no new requests; open streams may finish within %.0fs",
        policy.server.shutdown_grace,
    )
    gateway.draining = True
    await head_sweep.stop()
    await runner.cleanup()  # stops listening, waits up to shutdown_timeout for handlers
    if embedded is not None:
        await embedded.stop()
