"""Overload on a real vLLM with a small KV cache (4,096 tokens in 32 blocks of 128).

A flood sent straight to vLLM makes it preempt; the same flood through Sluice does not,
while P0 requests keep succeeding. vLLM's own admission control (`--max-num-queued-reqs`)
rejects in two forms, and the gateway must treat both as overload, never as a success."""

from __future__ import annotations

import asyncio
import random
import time
from collections import Counter
from typing import Any

import aiohttp
import orjson
import pytest
from conftest import MAX_NUM_QUEUED_REQS, wait_idle
from gateway_proc import GatewayProcess, start_gateway
from loadgen import (
    Result,
    client_session,
    closed_loop,
    completion_body,
    gauge_values,
    stream_request,
    token_prompt,
)
from machine_stalls import MachineStalls
from recording_proxy import RecordingProxy
from vllm_server import VllmServer

pytestmark = pytest.mark.integration

FLOOD = {"concurrency": 32, "requests": 32, "prompt_len": 580, "max_tokens": 128}
_COUNTS = ("vllm:num_requests_running", "vllm:num_requests_waiting")
P0_PROMPT = [{"role": "user", "content": "Quick question: what time is it in Lisbon?"}]


def _preemptions(vllm: VllmServer) -> float:
    return vllm.metrics()["vllm:num_preemptions_total"]


async def _p0_trickle(url: str, model: str, stop: asyncio.Event) -> list[Result]:
    """One short P0 chat stream after another until `stop`."""
    results = []
    async with aiohttp.ClientSession() as s:
        while not stop.is_set():
            body = {
                "model": model,
                "messages": P0_PROMPT,
                "max_tokens": 16,
                "stream": True,
                "ignore_eos": True,
                "stream_options": {"include_usage": True},
            }
            r = await stream_request(
                s,
                url + "/v1/chat/completions",
                body,
                {"Authorization": "Bearer sk-demo-p0"},
                time_limit=30,
            )
            results.append(r)
            await asyncio.sleep(0.2)
    return results


async def test_flood_preempts_direct_but_not_through_sluice(vllm: VllmServer) -> None:
    wait_idle(vllm)
    before = _preemptions(vllm)
    direct = await closed_loop(vllm.url, vllm.model, seed=1, **FLOOD)
    direct_preemptions = _preemptions(vllm) - before
    assert all(r.ok for r in direct)
    assert direct_preemptions > 0, "the flood did not overload vLLM: the test proves nothing"

    wait_idle(vllm)
    gw = start_gateway([vllm.url])
    try:
        before = _preemptions(vllm)
        stop = asyncio.Event()
        p0 = asyncio.create_task(_p0_trickle(gw.url, vllm.model, stop))
        started = time.monotonic()
        via = await closed_loop(
            gw.url, vllm.model, seed=2, headers={"Authorization": "Bearer sk-demo-p1"}, **FLOOD
        )
        took = time.monotonic() - started
        stop.set()
        p0_results = await p0
        sluice_preemptions = _preemptions(vllm) - before
    finally:
        gw.stop()

    ok = [r for r in via if r.ok]
    refused = [r for r in via if r.status in (429, 503)]
    p0_ttft = sorted(r.ttft_s for r in p0_results if r.ttft_s is not None)
    print(
        f"\ndirect: {direct_preemptions:.0f} preemptions; through Sluice: "
        f"{sluice_preemptions:.0f} preemptions, {len(ok)} ok, {len(refused)} refused "
        f"in {took:.1f} s; P0: {sum(r.ok for r in p0_results)}/{len(p0_results)} ok, "
        f"TTFT p50 {p0_ttft[len(p0_ttft) // 2]:.2f} s max {p0_ttft[-1]:.2f} s"
    )
    assert sluice_preemptions == 0
    # every flood request was served, or refused with an overload answer the client can
    # retry on; nothing failed otherwise
    assert len(ok) + len(refused) == len(via), Counter((r.status, r.error) for r in via)
    assert all("retry-after" in {k.lower() for k in r.headers} for r in refused)
    assert len(ok) >= len(via) // 2
    assert p0_results and all(r.ok for r in p0_results), [r.error for r in p0_results]
    _assert_never_out_of_service(gw)


async def _hold(
    session: aiohttp.ClientSession,
    vllm: VllmServer,
    held: list[aiohttp.ClientResponse],
    n: int,
    rng: random.Random,
) -> None:
    """Make vLLM hold exactly `n` requests: long streams straight to it, open (HTTP 200)
    and never read. They outnumber its 31 usable KV blocks, so most of them wait or churn;
    one that finishes all the same (a slow run) is replaced."""
    deadline = time.monotonic() + 20
    while (now := await _unfinished(session, vllm)) != n:
        assert time.monotonic() < deadline, f"vLLM holds {now} requests, not {n}"
        if now > n:  # aborts still on their way
            await asyncio.sleep(0.05)
            continue
        for _ in range(int(n - now)):
            body = completion_body(vllm.model, token_prompt(rng, 16), 2000)
            try:
                r = await session.post(
                    vllm.url + "/v1/completions",
                    data=orjson.dumps(body),
                    headers={"Content-Type": "application/json"},
                )
            except aiohttp.ClientOSError:
                # a kept-alive connection vLLM closed as the request went out on it (after
                # a machine stall, its keep-alive timer can beat ours): nothing was sent,
                # the loop counts again and sends what is missing
                break
            if r.status == 503:  # earlier requests are still being aborted
                r.close()
                break
            assert r.status == 200, await r.read()
            held.append(r)
        await asyncio.sleep(0.1)  # let vLLM count them


# A fixed cap far above vLLM's: the gateway forwards a whole burst at once, so that vLLM's
# own refusals (not the gateway's limiter) are what this test meets.
FIXED_POLICY = """
tenants:
  - {name: chat-app, apiKeys: [sk-demo-p0], priority: 0}
limiter: {algorithm: fixed, fixedLimit: 64}
"""
# Requests that vLLM admits in this test queue behind the held ones. Through the gateway
# they carry a deadline (X-Request-Timeout), so that the gateway answers each of them
# itself (504 at its upstream deadline); a client straight on vLLM gives up.
DEADLINE_S = 4
DIRECT_GIVE_UP_S = 8.0
# The clients' own limit only guards against a hang: far above the gateway's deadline,
# because this VM stops running every process but vLLM's for up to ~10 s at a time under
# this load, after which the client's timer and the gateway's, both overdue, race
# (tests/vllm/machine_stalls.py). CI once (2026-12-06) saw a whole round of 24 clients give
# up at 30 s in a run whose process stalled for 20-30 s in all.
GIVE_UP_S = 60.0
# The gateway's overload refusals: vLLM refused (after one more try), or the gateway's own
# queue held a request until its deadline (vLLM's scraped KV usage and queue say "full").
# Never `503 no_backend`: a vLLM that refuses is overloaded, not gone, and stays in service
# (tests/integration/test_backend_refusals.py has the same with a fake vLLM, in `make test`).
OVERLOAD_ANSWERS = {(503, "backend_overloaded"), (429, "queue_timeout")}


def _short_streams(model: str, rng: random.Random, n: int) -> list[dict[str, Any]]:
    """Half completions, half chat: both of vLLM's streaming paths."""
    bodies: list[dict[str, Any]] = []
    for i in range(n):
        if i % 2:
            bodies.append(completion_body(model, token_prompt(rng, 16), 4))
        else:
            bodies.append({"model": model, "messages": P0_PROMPT, "max_tokens": 4, "stream": True})
    return bodies


async def _burst(
    s: aiohttp.ClientSession,
    url: str,
    bodies: list[dict[str, Any]],
    headers: dict[str, str],
    give_up_s: float = GIVE_UP_S,
) -> list[Result]:
    paths = ["/v1/chat/completions" if "messages" in b else "/v1/completions" for b in bodies]
    return await asyncio.gather(
        *(
            stream_request(s, url + path, body, headers, time_limit=give_up_s)
            for path, body in zip(paths, bodies, strict=True)
        )
    )


def _kind(r: Result) -> str:
    if r.ok:
        return "ok"
    if r.status == 200:
        return "200+error event"
    if r.status == 0:
        return "gave up"
    code = orjson.loads(r.first_bytes)["error"]["code"] if r.first_bytes[:1] == b"{" else ""
    return f"{r.status} {code}".strip()


# Up to 3 rounds of (fill vLLM: up to 20 s; a burst: up to GIVE_UP_S), after a first fill:
# past the suite's 120 s when the machine stalls (CI timed out there once, 2026-12-02).
@pytest.mark.timeout(360, func_only=True)
async def test_vllm_admission_rejections_are_overload_for_sluice(vllm: VllmServer) -> None:
    wait_idle(vllm)
    rng = random.Random(3)
    key = {"Authorization": "Bearer sk-demo-p0", "X-Request-Timeout": str(DEADLINE_S)}
    whole = completion_body(vllm.model, token_prompt(rng, 16), 4, stream=False)
    with MachineStalls(min_s=0.5) as stalls:
        async with (
            client_session() as s,
            RecordingProxy(vllm.url) as proxy,
        ):
            # in a thread: the proxy on this loop must answer the gateway's start-up checks
            gw = await asyncio.to_thread(start_gateway, [proxy.url], FIXED_POLICY)
            held: list[aiohttp.ClientResponse] = []
            await _hold(s, vllm, held, MAX_NUM_QUEUED_REQS, rng)
            try:
                # 1. vLLM full: its early check answers 503 and a JSON error at once...
                async with s.post(vllm.url + "/v1/completions", json=whole) as r:
                    direct_503 = (r.status, await r.read())
                # ...which the gateway answers as overload, for a whole answer and a stream.
                async with s.post(gw.url + "/v1/completions", json=whole, headers=key) as r:
                    single = (r.status, dict(r.headers), await r.read())
                stream = (await _burst(s, gw.url, _short_streams(vllm.model, rng, 1), key))[0]

                # 2. Four free places and a burst of 24 streams: they pass vLLM's early check
                # together, and those beyond the four are refused after the 200 went out.
                await _release(s, vllm, held, 4, rng)
                direct = await _burst(
                    s, vllm.url, _short_streams(vllm.model, rng, 24), {}, DIRECT_GIVE_UP_S
                )

                # 3. The same burst through the gateway (which tries each refused one once more).
                # The late refusal is a race inside vLLM: up to 3 rounds until one reached the
                # gateway; every answer of every round is checked below.
                proxy.answers.clear()
                via: list[Result] = []
                # (s to fill vLLM, s of the burst, s the machine stalled during the burst)
                rounds: list[tuple[float, float, float]] = []
                for _ in range(3):
                    t0 = time.monotonic()
                    await _hold(s, vllm, held, MAX_NUM_QUEUED_REQS - 4, rng)
                    t1 = time.monotonic()
                    via += await _burst(s, gw.url, _short_streams(vllm.model, rng, 24), key)
                    t2 = time.monotonic()
                    stalled = sum(gap for _, gap in stalls.during(t1, t2))
                    rounds.append((round(t1 - t0, 1), round(t2 - t1, 1), round(stalled, 1)))
                    if any(a.sse_error for a in proxy.answers):
                        break
                gw_metrics = await asyncio.to_thread(gw.metrics)
            finally:
                for r in held:
                    r.close()
                await asyncio.to_thread(gw.stop)

    upstream = Counter("200+error event" if a.sse_error else str(a.status) for a in proxy.answers)
    event = next((r.first_bytes for r in direct if _kind(r) == "200+error event"), b"")
    print(
        f"\nvLLM full, a whole request: {direct_503[0]} {direct_503[1]!r}"
        f"\ndirect burst into 4 free places: {dict(Counter(map(_kind, direct)))}; "
        f"first error event: {event!r}"
        f"\nthrough Sluice: vLLM answered {dict(upstream)}; "
        f"the clients got {dict(Counter(map(_kind, via)))}; "
        f"rounds (fill s, burst s, stalled s): {rounds}"
        f"\n{stalls.summary()}"
    )
    assert direct_503[0] == 503 and orjson.loads(direct_503[1])["error"]["code"] == 503
    assert event.startswith(b'data: {"error"'), "vLLM did not answer 200 + an error event"
    assert upstream["200+error event"] > 0, "no 200 + error event reached the gateway"

    # vLLM's 503 is overload for the gateway: it answers with an overload refusal
    for status, headers, data in (single, (stream.status, stream.headers, stream.first_bytes)):
        code = orjson.loads(data)["error"]["code"]
        assert (status, code) in OVERLOAD_ANSWERS, data
        assert int(headers["Retry-After"]) >= 1
    # No refusal was passed on as a success: every client got an overload answer with
    # Retry-After, a whole stream, or (admitted by vLLM, queued behind the held requests)
    # the gateway's 504 at its deadline.
    kinds = Counter(map(_kind, via))
    assert kinds["200+error event"] == 0
    allowed = {"ok", "504 upstream_timeout"} | {f"{st} {code}" for st, code in OVERLOAD_ANSWERS}
    access = [line for line in gw.output if "sluice.access" in line]
    gave_up = Counter(r.error for r in via if _kind(r) == "gave up")
    # a message, not a tuple: pytest shortens a tuple's repr, and CI shows only the summary
    assert set(kinds) <= allowed, (
        f"{dict(kinds)}; gave up: {dict(gave_up)}; rounds (fill s, burst s, stalled s): "
        f"{rounds}; {stalls.summary()}\n" + "\n".join(access[-30:])
    )
    for r in via:
        if r.status in (429, 503):
            assert int(r.headers["Retry-After"]) >= 1
    assert gw_metrics['sluice_upstream_errors_total{backend="backend-0",kind="overloaded"}'] > 0
    _assert_never_out_of_service(gw)


def _assert_never_out_of_service(gw: GatewayProcess) -> None:
    log = [line for line in gw.output if "sluice.backends" in line]
    assert not any("out of service" in line for line in log), "\n".join(log)


async def _release(
    s: aiohttp.ClientSession,
    vllm: VllmServer,
    held: list[aiohttp.ClientResponse],
    n: int,
    rng: random.Random,
) -> None:
    """Close `n` held streams: vLLM then holds `n` fewer requests."""
    target = await _unfinished(s, vllm) - n
    for r in held[-n:]:
        r.close()
    del held[-n:]
    await _hold(s, vllm, held, int(target), rng)


async def _unfinished(s: aiohttp.ClientSession, vllm: VllmServer) -> float:
    """Requests vLLM holds: running + waiting."""
    async with s.get(vllm.url + "/metrics") as r:
        m = gauge_values(await r.text(), _COUNTS)
    return sum(m.values())
