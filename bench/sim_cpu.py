"""CPU cost of one `sluice sim` process serving N concurrent streams at real speed.

Starts `sluice sim` (h100-llama3-8b, speed 1), keeps N streaming chat requests open
(closed loop: each finished stream is replaced at once) and reads the simulator's CPU
time from /proc/PID/stat over a measurement window. Also checks that the simulator kept
real time: the inter-token latency seen by the clients must match the engine's own.

    .venv/bin/python bench/sim_cpu.py [--streams 128] [--seconds 20] [--out FILE.json]

This is a benchmark, not a test: it reports figures, it does not assert them.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import subprocess
import sys
import time
from pathlib import Path

import aiohttp

from sluice.bench.procfs import cpu_seconds

READY = re.compile(r"serving model .* on (http://\S+)")


def start_sim(profile: str, extra: list[str]) -> tuple[subprocess.Popen[str], str]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "sluice.cli", "sim", "--port", "0", "--profile", profile, *extra],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()
    match = READY.search(line)
    if not match:
        proc.kill()
        raise SystemExit(f"sluice sim did not start: {line}{proc.stdout.read()}")
    return proc, match.group(1)


class Load:
    def __init__(self, url: str, body: dict[str, object]) -> None:
        self.url = url
        self.body = body
        self.tokens = 0
        self.gaps_sum = 0.0  # client-side inter-token gaps
        self.gaps = 0
        self.completed = 0
        self.measuring = False

    async def stream_forever(self, session: aiohttp.ClientSession) -> None:
        loop = asyncio.get_running_loop()
        while True:
            async with session.post(self.url + "/v1/chat/completions", json=self.body) as r:
                last = None
                async for line in r.content:
                    if not line.startswith(b'data: {"id"'):
                        continue
                    now = loop.time()
                    if self.measuring:
                        self.tokens += 1
                        if last is not None:
                            self.gaps_sum += now - last
                            self.gaps += 1
                    last = now
            if self.measuring:
                self.completed += 1


async def metric(session: aiohttp.ClientSession, url: str, name: str) -> float:
    async with session.get(url + "/metrics") as r:
        for line in (await r.text()).splitlines():
            if line.startswith(name + "{") or line.startswith(name + " "):
                return float(line.rsplit(" ", 1)[1])
    return 0.0


async def run(args: argparse.Namespace) -> dict[str, object]:
    proc, url = start_sim(args.profile, ["--speed", str(args.speed)])
    try:
        # idle cost first: a simulator with nothing to do must not spin
        await asyncio.sleep(0.5)
        c0, t0 = cpu_seconds([proc.pid]), time.monotonic()
        await asyncio.sleep(args.idle_seconds)
        idle_cores = (cpu_seconds([proc.pid]) - c0) / (time.monotonic() - t0)

        body = {
            "model": "sluice-sim",
            "messages": [{"role": "user", "content": "x" * args.prompt_chars}],
            "max_tokens": args.max_tokens,
            "ignore_eos": True,
            "stream": True,
        }
        load = Load(url, body)
        connector = aiohttp.TCPConnector(limit=args.streams + 8)
        async with aiohttp.ClientSession(connector=connector) as session:
            tasks = [asyncio.create_task(load.stream_forever(session)) for _ in range(args.streams)]
            await asyncio.sleep(args.warmup)
            itl_sum0 = await metric(session, url, "vllm:inter_token_latency_seconds_sum")
            itl_n0 = await metric(session, url, "vllm:inter_token_latency_seconds_count")
            load.measuring = True
            c0, t0 = cpu_seconds([proc.pid]), time.monotonic()
            await asyncio.sleep(args.seconds)
            c1, t1 = cpu_seconds([proc.pid]), time.monotonic()
            load.measuring = False
            itl_sum1 = await metric(session, url, "vllm:inter_token_latency_seconds_sum")
            itl_n1 = await metric(session, url, "vllm:inter_token_latency_seconds_count")
            running = await metric(session, url, "vllm:num_requests_running")
            kv = await metric(session, url, "vllm:kv_cache_usage_perc")
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        wall = t1 - t0
        engine_itl = (itl_sum1 - itl_sum0) / max(1.0, itl_n1 - itl_n0)
        client_itl = load.gaps_sum / max(1, load.gaps)
        return {
            "profile": args.profile,
            "speed": args.speed,
            "streams": args.streams,
            "seconds": round(wall, 2),
            "sim_cpu_cores": round((c1 - c0) / wall, 3),
            "sim_idle_cpu_cores": round(idle_cores, 4),
            "tokens_per_s": round(load.tokens / wall, 1),
            "requests_completed": load.completed,
            "running_at_end": running,
            "kv_usage_at_end": round(kv, 3),
            "engine_itl_ms": round(engine_itl * 1000, 2),
            "client_itl_ms": round(client_itl * 1000, 2),
            "real_time_ratio": round(engine_itl / client_itl, 3) if client_itl else None,
        }
    finally:
        proc.terminate()
        proc.wait(10)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--streams", type=int, default=128)
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--warmup", type=float, default=5.0)
    parser.add_argument("--idle-seconds", type=float, default=3.0)
    parser.add_argument("--profile", default="h100-llama3-8b")
    parser.add_argument("--speed", type=float, default=1.0)
    parser.add_argument("--prompt-chars", type=int, default=4000)
    parser.add_argument("--max-tokens", type=int, default=500)
    parser.add_argument("--out", type=Path, help="also write the figures as JSON here")
    args = parser.parse_args()
    try:
        import uvloop

        result = uvloop.run(run(args))
    except ImportError:
        result = asyncio.run(run(args))
    for key, value in result.items():
        print(f"{key:>22}: {value}")
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
