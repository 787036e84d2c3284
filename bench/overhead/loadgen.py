"""Closed-loop load generator for the overhead benchmark, run in its own process.

It keeps `--concurrency` requests in flight until `--requests` have been sent (bounded),
and prints one JSON line with every request's latency (to the last byte), its time to
first chunk and the SSE events it received. It prints "READY" once imported and waits for
a line on stdin before it starts, so that the runner can read the proxy's CPU counters
right before and right after the load, excluding this process's start-up.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time

import aiohttp
import orjson
import uvloop


def request_body(mode: str, model: str, chunks: int, interval_ms: float) -> bytes:
    body: dict[str, object] = {
        "model": model,
        "messages": [{"role": "user", "content": "Say something."}],
        "max_tokens": chunks,
    }
    if mode in ("stream", "paced"):
        body["stream"] = True
    if mode == "paced":
        body["bench_interval_ms"] = interval_ms
    return orjson.dumps(body)


async def run(args: argparse.Namespace) -> dict[str, object]:
    body = request_body(args.mode, args.model, args.chunks, args.interval_ms)
    headers = {"Content-Type": "application/json"}
    if args.api_key:
        headers["Authorization"] = f"Bearer {args.api_key}"
    url = args.url.rstrip("/") + "/v1/chat/completions"
    latencies: list[float] = []
    ttfts: list[float] = []
    events = 0
    errors: dict[str, int] = {}
    remaining = args.requests
    timeout = aiohttp.ClientTimeout(total=args.timeout)
    connector = aiohttp.TCPConnector(limit=0)

    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:

        async def one() -> None:
            nonlocal events
            t0 = time.perf_counter()
            first: float | None = None
            try:
                async with session.post(url, data=body, headers=headers) as resp:
                    if resp.status != 200:
                        key = f"http_{resp.status}"
                        errors[key] = errors.get(key, 0) + 1
                        await resp.read()
                        return
                    if args.mode == "json":
                        await resp.read()
                        first = time.perf_counter()
                    else:
                        async for line in resp.content:
                            if line.startswith(b"data:") and not line.startswith(b"data: [DONE]"):
                                if first is None:
                                    first = time.perf_counter()
                                events += 1
            except (aiohttp.ClientError, TimeoutError) as exc:
                key = type(exc).__name__
                errors[key] = errors.get(key, 0) + 1
                return
            latencies.append(time.perf_counter() - t0)
            ttfts.append((first or time.perf_counter()) - t0)

        async def worker() -> None:
            nonlocal remaining
            while remaining > 0:
                remaining -= 1
                await one()

        t_start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(args.concurrency)))
        wall = time.perf_counter() - t_start
    return {
        "latencies_s": latencies,
        "ttfts_s": ttfts,
        "events": events,
        "errors": errors,
        "wall_s": wall,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", required=True)
    parser.add_argument("--mode", choices=["json", "stream", "paced"], required=True)
    parser.add_argument("--requests", type=int, required=True)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--chunks", type=int, default=64)
    parser.add_argument("--interval-ms", type=float, default=10.0)
    parser.add_argument("--model", default="bench-model")
    parser.add_argument("--api-key", default="")
    parser.add_argument("--timeout", type=float, default=60.0)
    parser.add_argument("--no-wait", action="store_true", help="start at once (manual use)")
    args = parser.parse_args()
    if not args.no_wait:
        print("READY", flush=True)
        sys.stdin.readline()
    result = uvloop.run(run(args))
    sys.stdout.write(orjson.dumps(result).decode() + "\n")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
