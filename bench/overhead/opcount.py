"""Python bytecodes the proxy executes per request: a deterministic companion to run.py.

CPU time per request moves with whatever else runs on a shared machine; the number of
bytecode instructions a proxy executes per request does not. This script runs the bare
pass-through (passthrough_aiohttp.py) and Sluice's gateway (every feature on, as run.py's
sluice arm) in one thread of this process, traces every Python instruction executed in that
thread while a load generator (another thread) sends N requests, and prints instructions
per request for each, their ratio, and where Sluice's extra instructions go.

Bytecodes are not nanoseconds (a C call such as orjson.loads is one instruction), but
what Sluice adds in the request path is Python code, so the ratio tracks the CPU ratio
run.py measures (1.78x here on bytecodes vs ~1.8-2x in CPU per non-streamed request in
the same state of the code) and shows the effect of a change exactly, on a noisy machine.

Run: python bench/overhead/opcount.py [--requests 300] [--mode json|stream] [--top 30]
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import CodeType, FrameType
from typing import Any

import aiohttp
import uvloop
from aiohttp import web

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from arms import API_KEY, sluice_config  # noqa: E402
from passthrough_aiohttp import make_app as passthrough_app  # noqa: E402

from sluice.config import Backend, load_policy  # noqa: E402
from sluice.gateway.app import create_app  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class OpCounter:
    """sys.settrace with opcode events, counting per code object while `on` is set."""

    def __init__(self) -> None:
        self.on = False
        self.counts: collections.Counter[CodeType] = collections.Counter()

    def install(self) -> None:
        counts = self.counts

        def local(frame: FrameType, event: str, _arg: Any) -> Any:
            if event == "opcode" and self.on:
                counts[frame.f_code] += 1
            return local

        def new_frame(frame: FrameType, _event: str, _arg: Any) -> Any:
            frame.f_trace_opcodes = True
            return local

        sys.settrace(new_frame)

    def take(self) -> collections.Counter[CodeType]:
        out = collections.Counter(self.counts)
        self.counts.clear()
        return out


class ProxyThread(threading.Thread):
    """The proxies under test, on their own event loop, traced."""

    def __init__(self, upstream: str, policy_path: Path) -> None:
        super().__init__(daemon=True)
        self.upstream = upstream
        self.policy_path = policy_path
        self.counter = OpCounter()
        self.runners: list[web.AppRunner] = []
        self.ready = threading.Event()
        self.loop: asyncio.AbstractEventLoop | None = None

    def run(self) -> None:
        self.loop = uvloop.new_event_loop()
        asyncio.set_event_loop(self.loop)
        self.counter.install()
        self.ready.set()
        self.loop.run_forever()

    def serve(self, name: str) -> str:
        """Start one proxy (only one runs while it is measured: the gateway's background
        tasks must not count against the pass-through)."""
        assert self.loop is not None
        future = asyncio.run_coroutine_threadsafe(self._start(name), self.loop)
        return future.result(30)

    async def _start(self, name: str) -> str:
        if name == "passthrough":
            app = passthrough_app(self.upstream)
        else:
            policy = load_policy(self.policy_path)
            app = create_app(policy, None, (Backend(name="backend-0", url=self.upstream),))
        runner = web.AppRunner(app, access_log=None, handler_cancellation=True)
        await runner.setup()
        port = free_port()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        self.runners.append(runner)
        return f"http://127.0.0.1:{port}"

    def stop_all(self) -> None:
        assert self.loop is not None
        for runner in self.runners:
            asyncio.run_coroutine_threadsafe(runner.cleanup(), self.loop).result(30)
        self.runners.clear()


async def load(url: str, n: int, mode: str, concurrency: int = 16) -> int:
    body: dict[str, Any] = {
        "model": "bench-model",
        "max_tokens": 16,
        "messages": [{"role": "user", "content": "hello there"}],
    }
    if mode == "stream":
        body["stream"] = True
    headers = {"Authorization": f"Bearer {API_KEY}"}
    ok = 0
    remaining = n
    async with aiohttp.ClientSession() as session:

        async def worker() -> None:
            nonlocal remaining, ok
            while remaining > 0:
                remaining -= 1
                async with session.post(
                    url + "/v1/chat/completions", json=body, headers=headers
                ) as r:
                    await r.read()
                    ok += r.status == 200

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return ok


def where(code: CodeType) -> str:
    path = code.co_filename
    for marker in ("site-packages/", "/src/", "/bench/"):
        if marker in path:
            path = path.split(marker, 1)[1]
            break
    return f"{path}:{code.co_firstlineno} {code.co_name}"


def area_of(code: CodeType) -> str:
    """The package a code object belongs to (sluice.gateway, aiohttp, asyncio, ...)."""
    path = where(code).split(":", 1)[0]
    if path.startswith("sluice/"):
        return "sluice." + path.split("/")[1].removesuffix(".py")
    if "/lib/python3" in path:
        return "stdlib." + path.rsplit("/lib/python3", 1)[1].split("/")[1].removesuffix(".py")
    return path.split("/")[0].removesuffix(".py")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=300)
    parser.add_argument("--mode", choices=["json", "stream"], default="json")
    parser.add_argument("--top", type=int, default=30)
    args = parser.parse_args()

    up_port = free_port()
    upstream = subprocess.Popen(
        [sys.executable, str(HERE / "upstream.py"), "--port", str(up_port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        upstream_url = f"http://127.0.0.1:{up_port}"
        deadline = time.monotonic() + 20
        while True:
            try:
                socket.create_connection(("127.0.0.1", up_port), timeout=0.5).close()
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise SystemExit("the fake upstream did not start") from None
                time.sleep(0.05)
        import tempfile

        with tempfile.TemporaryDirectory() as tmp:
            policy_path, _ = sluice_config(Path(tmp), None, 16)
            proxies = ProxyThread(upstream_url, policy_path)
            proxies.start()
            proxies.ready.wait(30)
            per_request: dict[str, collections.Counter[CodeType]] = {}
            for name in ("passthrough", "sluice"):
                url = proxies.serve(name)
                time.sleep(1.0)  # the gateway's first health check and scrape
                asyncio.run(load(url, 50, args.mode))  # warm-up: caches, first scrape
                proxies.counter.on = True
                ok = asyncio.run(load(url, args.requests, args.mode))
                proxies.counter.on = False
                if ok != args.requests:
                    raise SystemExit(f"{name}: {args.requests - ok} requests failed")
                per_request[name] = proxies.counter.take()
                proxies.stop_all()
    finally:
        upstream.terminate()
        upstream.wait()

    n = args.requests
    bare = sum(per_request["passthrough"].values()) / n
    ours = sum(per_request["sluice"].values()) / n
    print(
        f"mode {args.mode}, {n} requests at concurrency 16 (each proxy's background tasks included)"
    )
    print(f"  passthrough: {bare:8.0f} bytecodes/request")
    print(f"  sluice:      {ours:8.0f} bytecodes/request  ({ours / bare:.2f}x)")
    extra: collections.Counter[str] = collections.Counter()
    base = {where(c): v for c, v in per_request["passthrough"].items()}
    for code, v in per_request["sluice"].items():
        key = where(code)
        extra[key] += v - base.get(key, 0)
    print("\nby package (bytecodes/request): passthrough, sluice")
    for area in sorted({area_of(c) for arm in per_request.values() for c in arm}):
        a, b = (
            sum(v for c, v in per_request[arm].items() if area_of(c) == area) / n
            for arm in ("passthrough", "sluice")
        )
        print(f"  {area:<24} {a:8.0f} {b:8.0f}")
    print(f"\nwhere Sluice's extra {ours - bare:.0f} bytecodes/request go (top {args.top}):")
    for key, v in extra.most_common(args.top):
        print(f"  {v / n:7.1f}  {key}")
    print("\nwhere Sluice runs less than the pass-through:")
    for key, v in sorted(extra.items(), key=lambda kv: kv[1])[:10]:
        if v < 0:
            print(f"  {v / n:7.1f}  {key}")


if __name__ == "__main__":
    main()
