"""A small, bounded load generator for OpenAI-compatible servers (vLLM, `sluice sim`, the
gateway): streamed /v1/completions with token-id prompts of an exact length, timed per
request (TTFT, mean inter-token time), plus a /metrics sampler.

    results = await closed_loop(url, model, concurrency=8, requests=32, prompt_len=256,
                                max_tokens=32)
    summarize(results)  # {"ttft_p50_s": ..., "tpot_p50_s": ..., "ok": ..., ...}

Prompts are random token ids (never the tokenizer's specials), different for every request,
so that vLLM's prefix cache cannot share their KV blocks. Every request asks for
`ignore_eos` so that it produces exactly `max_tokens` tokens."""

from __future__ import annotations

import asyncio
import contextlib
import random
import statistics
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import orjson

from sluice.bench.prom_text import gauge_values

FIRST_ID = 3  # 0..2 are <unk>, <s>, </s>
VOCAB = 4096


@dataclass
class Result:
    status: int
    ok: bool  # HTTP 200 and a stream that ended with [DONE] and no error event
    ttft_s: float | None = None
    tpot_s: float | None = None  # (last token - first token) / (tokens - 1)
    tokens: int = 0
    error: str | None = None
    first_bytes: bytes = b""  # the start of the answer, for reporting what a server sent
    headers: dict[str, str] = field(default_factory=dict)


def token_prompt(rng: random.Random, length: int) -> list[int]:
    return [rng.randrange(FIRST_ID, VOCAB) for _ in range(length)]


def completion_body(
    model: str, prompt: list[int] | str, max_tokens: int, *, stream: bool = True
) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "temperature": 0,
        "stream": stream,
    }
    if stream:
        body["stream_options"] = {"include_usage": True}
    return body


# vLLM's server (uvicorn) closes a kept-alive connection 5 s after its last answer
# (vllm/envs.py 0.32: VLLM_HTTP_TIMEOUT_KEEP_ALIVE = 5); aiohttp's client keeps one 15 s by
# default, so a client idle between 5 and 15 s sends its next request on a connection the
# server is closing (ServerDisconnectedError). A client that drops its own after 1 s never
# races the server's close.
CLIENT_KEEPALIVE_S = 1.0


def client_session(
    timeout: aiohttp.ClientTimeout = aiohttp.client.DEFAULT_TIMEOUT,
) -> aiohttp.ClientSession:
    """A load client's session: no connection limit, kept-alive connections dropped well
    before the engine's own keep-alive timeout closes them."""
    connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=CLIENT_KEEPALIVE_S)
    return aiohttp.ClientSession(connector=connector, timeout=timeout)


async def stream_request(
    session: aiohttp.ClientSession,
    url: str,
    body: dict[str, Any],
    headers: dict[str, str] | None = None,
    time_limit: float = 120.0,
) -> Result:
    """POST a streamed completion and time its tokens: TTFT = first token event - start,
    TPOT = (last token event - first) / (tokens - 1)."""
    start = time.monotonic()
    first: float | None = None
    last: float | None = None
    tokens = 0
    try:
        async with asyncio.timeout(time_limit):
            async with session.post(
                url,
                data=orjson.dumps(body),
                headers={"Content-Type": "application/json", **(headers or {})},
            ) as r:
                hdrs = dict(r.headers)
                if r.status != 200:
                    data = await r.read()
                    return Result(
                        r.status,
                        False,
                        error=data[:300].decode("utf-8", "replace"),
                        first_bytes=data[:600],
                        headers=hdrs,
                    )
                head = b""
                buf = b""
                done = False
                reported: int | None = None  # usage.completion_tokens, when sent
                async for chunk in r.content.iter_any():
                    if len(head) < 600:
                        head += chunk[: 600 - len(head)]
                    buf += chunk
                    while b"\n\n" in buf:
                        event, buf = buf.split(b"\n\n", 1)
                        if not event.startswith(b"data: "):
                            continue
                        payload = event[6:]
                        if payload == b"[DONE]":
                            done = True
                            continue
                        obj = orjson.loads(payload)
                        if obj.get("usage"):
                            reported = obj["usage"].get("completion_tokens")
                        if "error" in obj:
                            return Result(
                                200,
                                False,
                                error=str(obj["error"])[:300],
                                first_bytes=head,
                                headers=hdrs,
                            )
                        for choice in obj.get("choices") or ():
                            delta = choice.get("text")
                            if delta is None:
                                delta = (choice.get("delta") or {}).get("content")
                            if delta is not None or choice.get("finish_reason"):
                                now = time.monotonic()
                                if first is None:
                                    first = now
                                last = now
                                tokens += 1
                usage_ok = done
                ttft = None if first is None else first - start
                # vLLM merges tokens into one event when its API server falls behind: count
                # tokens from usage when the server reports it
                tokens = reported or tokens
                tpot = None
                if first is not None and last is not None and tokens > 1:
                    tpot = (last - first) / (tokens - 1)
                return Result(
                    200,
                    usage_ok,
                    ttft,
                    tpot,
                    tokens,
                    None if usage_ok else "stream ended without [DONE]",
                    head,
                    hdrs,
                )
    except (aiohttp.ClientError, TimeoutError) as exc:
        return Result(0, False, error=f"{type(exc).__name__}: {exc}")


async def closed_loop(
    url: str,
    model: str,
    *,
    concurrency: int,
    requests: int,
    prompt_len: int,
    max_tokens: int,
    headers: dict[str, str] | None = None,
    seed: int = 0,
    time_limit: float = 120.0,
) -> list[Result]:
    """`concurrency` workers send `requests` streamed completions in all, back to back."""
    rng = random.Random(seed)
    prompts = [token_prompt(rng, prompt_len) for _ in range(requests)]
    queue = list(range(requests))
    results: list[Result] = []
    async with client_session() as session:

        async def worker() -> None:
            while queue:
                i = queue.pop()
                body = completion_body(model, prompts[i], max_tokens)
                results.append(
                    await stream_request(
                        session, url + "/v1/completions", body, headers, time_limit
                    )
                )

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return results


async def sample_metrics(
    url: str, names: tuple[str, ...], stop: asyncio.Event, every: float = 0.1
) -> list[dict[str, float]]:
    """Poll URL/metrics until `stop` is set; returns {"t": time, name: value...} per poll."""
    samples: list[dict[str, float]] = []
    async with aiohttp.ClientSession() as session:
        while not stop.is_set():
            try:
                async with session.get(url + "/metrics") as r:
                    values = gauge_values(await r.text(), names)
                samples.append({"t": time.monotonic(), **values})
            except aiohttp.ClientError:
                pass
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), every)
    return samples


def p50(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def summarize(results: list[Result]) -> dict[str, Any]:
    ok = [r for r in results if r.ok]
    return {
        "requests": len(results),
        "ok": len(ok),
        "ttft_p50_s": p50([r.ttft_s for r in ok if r.ttft_s is not None]),
        "tpot_p50_s": p50([r.tpot_s for r in ok if r.tpot_s is not None]),
        "errors": sorted({r.error or "" for r in results if not r.ok})[:5],
    }
