"""What the gateway adds to a streamed chat request's first token, side by side in one run:
one `sluice sim`, `sluice serve` in front of it, and requests sent one at a time,
alternating between the simulator itself and the gateway (the order within each pair
drawn at random), so both arms see the same engine, the same machine load and the same
moment. Optional background streams (`--background N` through each gateway arm, each of
`--output-tokens` tokens) keep the relay busy as guidellm's decoding streams do.
`--compare-src DIR` adds a third arm, `base`: a gateway run from another source tree's
src/ (e.g. `git archive` of the commit before a change), so that a change is measured
before and after in the same run.

    python bench/adversarial/ttft_pair.py [--pairs 200] [--gap-ms 50] [--background 0]
        [--profile h100-llama3-8b] [--prompt-tokens 256] [--output-tokens 16]
        [--compare-src /tmp/base/src] [--client httpx]

TTFT is what guidellm measures: from sending the request to the first event that
carries content. `--client httpx` times the measured requests as guidellm 0.8.1 itself
does (httpx, the clock started at the request head's write): through the gateway, httpx
also reads the answer's head on the first token's time (docs/operations.md).
Also reported: the time to the answer's head (status line). Prints
one JSON object: per arm the median, mean, p90 of each, and the median of the per-round
difference (each gateway minus direct), with the machine's busy fraction."""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
import httpx
import orjson
import uvloop

sys.path.insert(0, str(Path(__file__).resolve().parent))
from stack import BusySampler, start_gateway, start_sim

KEY = "sk-ttft-1"
POLICY = """
tenants: [{{name: bench, apiKeys: [{key}], priority: 0}}]
backends: [{{name: sim, url: "{sim}"}}]
"""
# ~1 token per word for the simulator's tokenizer (about 1.3 for a BPE one)
_WORDS = ["the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog", "while", "hums"]


def body(prompt_tokens: int, output_tokens: int, salt: int) -> bytes:
    words = [_WORDS[(salt + i) % len(_WORDS)] for i in range(prompt_tokens)]
    return orjson.dumps(
        {
            "model": "sluice-sim",
            "messages": [{"role": "user", "content": " ".join(words)}],
            "max_tokens": output_tokens,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
    )


async def one(
    session: aiohttp.ClientSession, url: str, data: bytes, key: str | None
) -> tuple[float, float]:
    """(seconds to the answer's head, seconds to the first content event)."""
    headers = {"Content-Type": "application/json"}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    t0 = time.perf_counter()
    first = 0.0
    async with session.post(url + "/v1/chat/completions", data=data, headers=headers) as up:
        head = time.perf_counter() - t0
        if up.status != 200:
            raise RuntimeError(f"{url}: HTTP {up.status}: {(await up.read())[:200]!r}")
        async for line in up.content:
            # the first event with content (the role's own event has "content":"")
            if not first and b'"content":"' in line and b'"content":""' not in line:
                first = time.perf_counter() - t0
    return head, first


async def one_httpx(
    client: httpx.AsyncClient, url: str, data: bytes, key: str | None
) -> tuple[float, float]:
    """As `one`, the way guidellm 0.8.1 times it (guidellm/backends/openai/http.py,
    `_resolve_streaming` and `_trace_request_start`): httpx's stream, its clock started at
    the request head's write (the `send_request_headers.started` trace), its lines read
    with `aiter_lines`."""
    headers = {"Content-Type": "application/json"}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    t0 = 0.0

    async def trace(event: str, info: dict[str, Any]) -> None:
        nonlocal t0
        if not t0 and event.endswith(".send_request_headers.started"):
            t0 = time.perf_counter()

    first = 0.0
    async with client.stream(
        "POST",
        url + "/v1/chat/completions",
        content=data,
        headers=headers,
        extensions={"trace": trace},
    ) as up:
        head = time.perf_counter() - t0
        if up.status_code != 200:
            raise RuntimeError(f"{url}: HTTP {up.status_code}: {(await up.aread())[:200]!r}")
        async for line in up.aiter_lines():
            if not first and '"content":"' in line and '"content":""' not in line:
                first = time.perf_counter() - t0
    return head, first


def _stats(values: list[float]) -> dict[str, float]:
    ms = sorted(v * 1000 for v in values)
    return {
        "median": round(statistics.median(ms), 3),
        "mean": round(statistics.fmean(ms), 3),
        "p90": round(ms[int(0.9 * (len(ms) - 1))], 3),
    }


async def measure(args: argparse.Namespace, urls: dict[str, str]) -> dict[str, Any]:
    rng = random.Random(args.seed)
    arms = {name: (url, None if name == "direct" else KEY) for name, url in urls.items()}
    heads: dict[str, list[float]] = {a: [] for a in arms}
    firsts: dict[str, list[float]] = {a: [] for a in arms}
    connector = aiohttp.TCPConnector(limit=0)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with (
        aiohttp.ClientSession(connector=connector) as session,
        httpx.AsyncClient(limits=limits, timeout=60) as client,
    ):

        async def timed(url: str, data: bytes, key: str | None) -> tuple[float, float]:
            if args.client == "httpx":
                return await one_httpx(client, url, data, key)
            return await one(session, url, data, key)

        stop = asyncio.Event()

        async def background(url: str) -> None:
            data = body(args.prompt_tokens, args.output_tokens, 3)
            while not stop.is_set():
                await one(session, url, data, KEY)

        # as many through each gateway arm (the direct arm's engine sees them all)
        bg = [
            asyncio.create_task(background(url))
            for name, url in urls.items()
            if name != "direct"
            for _ in range(args.background)
        ]
        for url, key in arms.values():  # warm both connections (and the limiter)
            for i in range(5):
                await timed(url, body(args.prompt_tokens, 4, i), key)
        for i in range(args.pairs):
            order = list(arms)
            rng.shuffle(order)
            for name in order:
                url, key = arms[name]
                head, first = await timed(url, body(args.prompt_tokens, args.output_tokens, i), key)
                heads[name].append(head)
                firsts[name].append(first)
                await asyncio.sleep(args.gap_ms / 1000)
        stop.set()
        await asyncio.gather(*bg)
    direct_ttft = firsts["direct"]
    gateways = [a for a in arms if a != "direct"]
    return {
        "ttft_ms": {a: _stats(v) for a, v in firsts.items()},
        "head_ms": {a: _stats(v) for a, v in heads.items()},
        "ttft_added_ms_median_of_rounds": {
            a: round(statistics.median(map(float.__sub__, firsts[a], direct_ttft)) * 1000, 3)
            for a in gateways
        },
        "ttft_ratio_median": {
            a: round(statistics.median(firsts[a]) / statistics.median(direct_ttft), 3)
            for a in gateways
        },
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--pairs", type=int, default=200)
    p.add_argument("--gap-ms", type=float, default=50.0, help="idle time after each request")
    p.add_argument("--background", type=int, default=0, help="streams kept going, per gateway")
    p.add_argument("--profile", default="h100-llama3-8b")
    p.add_argument("--prompt-tokens", type=int, default=256)
    p.add_argument("--output-tokens", type=int, default=16)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument(
        "--client",
        choices=("aiohttp", "httpx"),
        default="aiohttp",
        help="the measured requests' client (httpx: as guidellm times them)",
    )
    p.add_argument("--gateway-arg", action="append", default=[], help="passed to sluice serve")
    p.add_argument("--compare-src", type=Path, help="a `base` arm: the gateway from this src/")
    args = p.parse_args()
    sim = start_sim("--profile", args.profile, "--seed", "7")
    policy = POLICY.format(key=KEY, sim=sim.url)
    sources = {"sluice": None, "base": args.compare_src} if args.compare_src else {"sluice": None}
    gateways = {
        name: start_gateway(
            policy,
            Path(tempfile.mkdtemp(prefix=f"sluice-ttft-{name}-")),
            "--no-access-log",
            *args.gateway_arg,
            src=src,
        )
        for name, src in sources.items()
    }
    try:
        urls = {"direct": sim.url, **{name: gw.url for name, gw in gateways.items()}}
        with BusySampler() as busy:
            result = uvloop.run(measure(args, urls))
    finally:
        for gw in gateways.values():
            gw.stop()
        sim.stop()
    result["settings"] = {k: str(v) for k, v in vars(args).items() if k != "gateway_arg"}
    result["busy_fraction_mean"] = round(statistics.fmean(busy.samples or [0.0]), 3)
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
