"""A client that hangs up on the gateway makes the real vLLM abort its request at once,
freeing its KV blocks (DESIGN S9), on every streaming route: completions, Responses and
Anthropic Messages (whose clients close after their first event).

Two clocks are read. The gateway's: each request's access record is written (wall clock,
ms) as its handler unwinds from the client's hang-up, right after it closed the upstream
connection; against the moment that client closed, that is the gateway's part, per
client (median ~10 ms here, under 50 ms). vLLM's: its `vllm:num_requests_running` and
`_waiting`, polled from the closes on, one poll at a time (more would load vLLM's API
server, which handles the aborts); the first poll that reads 0 bounds the moment they
dropped (an upper bound: that poll's end)."""

from __future__ import annotations

import asyncio
import random
import re
import statistics
import time
from dataclasses import dataclass
from typing import Any

import aiohttp
import orjson
import pytest
from conftest import wait_idle
from gateway_proc import GatewayProcess, start_gateway
from loadgen import client_session, completion_body, token_prompt
from machine_stalls import MachineStalls
from vllm_server import VllmServer

pytestmark = pytest.mark.integration

STREAMS = 20
BOUND_S = 0.100
# A round proves something only when the 20 streams were in vLLM together: on this
# 2-core VM that failed in up to 7 rounds of one run (eight runs of each, 2026-12-06,
# before and after the stream head went early), and 6 rounds were not always enough.
ROUNDS = 12
# Until all 20 are in vLLM together; they outgrow its KV cache ~1.5 s after starting.
SETUP_S = 3.0
# A fixed cap above STREAMS, so that all 20 run at once on vLLM (the adaptive limiter would
# rightly hold some back); this test is about the relay, not the limiter.
POLICY = """
tenants:
  - {name: chat-app, apiKeys: [sk-demo-p0], priority: 0}
limiter: {algorithm: fixed, fixedLimit: 32}
"""
# Running and waiting: 20 requests outgrow vLLM's 31 KV blocks after ~112 tokens each, and
# then some wait (preempted); all 20 must be gone from both.
_IN_ENGINE = re.compile(rb"^vllm:num_requests_(?:running|waiting)\{[^}]*\} (\S+)$", re.M)


@dataclass
class Round:
    dropped_by_s: float  # upper bound: the end of the first poll that read 0
    miss_proven: bool  # a poll that began after BOUND_S still read requests in vLLM
    reaction_ms: list[float]  # per client: its close -> the gateway's access record
    trace: list[tuple[int, int, int]]  # polls from the closes: (start ms, end ms, count)
    stalled_s: float  # how long the machine ran nothing of this test while it measured


def _stream_request(
    route: str, model: str, rng: random.Random, long_words: str
) -> tuple[str, Any, dict[str, str]]:
    """(path, body, headers) of a long stream on the route: 16 prompt tokens (about as many
    words on the text routes) and up to 1,500 tokens of answer (none ends before the 20 are
    in vLLM together, however fast the machine: they are aborted long before). vLLM's
    Messages route takes no `ignore_eos`, so its streams all ask with `long_words`, a
    prompt whose greedy answer is known to run to its limit."""
    words = " ".join(str(rng.randrange(1000)) for _ in range(12))
    if route == "completions":
        body: Any = completion_body(model, token_prompt(rng, 16), ANSWER_TOKENS)
        return "/v1/completions", body, {"Authorization": "Bearer sk-demo-p0"}
    if route == "responses":
        body = {"model": model, "input": words, "max_output_tokens": ANSWER_TOKENS}
        return "/v1/responses", body | STREAMED, {"Authorization": "Bearer sk-demo-p0"}
    messages = [{"role": "user", "content": long_words}]
    body = {"model": model, "max_tokens": ANSWER_TOKENS, "messages": messages}
    return "/v1/messages", body | STREAMED, {"x-api-key": "sk-demo-p0"}


async def _long_answer_words(s: aiohttp.ClientSession, vllm: VllmServer) -> str:
    """Words whose greedy Messages answer, straight from vLLM, reaches PROBE_TOKENS (the
    tiny random model ends most answers at its end-of-text token sooner or later)."""
    rng = random.Random(7)
    for _ in range(20):
        words = " ".join(str(rng.randrange(1000)) for _ in range(12))
        body = {
            "model": vllm.model,
            "max_tokens": PROBE_TOKENS,
            "temperature": 0,
            "messages": [{"role": "user", "content": words}],
        }
        async with s.post(vllm.url + "/v1/messages", json=body) as r:
            if (await r.json()).get("stop_reason") == "max_tokens":
                return words
    pytest.fail(f"no prompt of 20 ran to {PROBE_TOKENS} tokens on vLLM's Messages route")


# Long enough to outlast the 20 streams' start (SETUP_S at most) on a fast machine
PROBE_TOKENS = 400
ANSWER_TOKENS = 1500  # under max_model_len (2,048) with any route's template
STREAMED = {"stream": True, "ignore_eos": True, "temperature": 0}


async def _one_round(
    s: aiohttp.ClientSession,
    vllm: VllmServer,
    gw: GatewayProcess,
    rng: random.Random,
    stalls: MachineStalls,
    route: str,
    long_words: str,
) -> Round | None:
    """One measurement; None when the 20 streams never were in vLLM together (on a busy
    machine some start late, and the first finish or are preempted before they all run),
    or when some did not start at all."""

    async def in_engine() -> tuple[float, float, float]:
        """(poll start, poll end, running + waiting); no full parse of the ~56 KB page."""
        t = time.monotonic()
        async with s.get(vllm.url + "/metrics") as r:
            body = await r.read()
        return t, time.monotonic(), sum(float(x) for x in _IN_ENGINE.findall(body))

    async def open_stream() -> aiohttp.ClientResponse:
        # 16 + up to 1,500 tokens: one 128-token KV block each for the first ~112 tokens
        # (20 of vLLM's 31 usable blocks), then preempted in turn (still in vLLM, waiting)
        path, body, headers = _stream_request(route, vllm.model, rng, long_words)
        r = await s.post(
            gw.url + path,
            data=orjson.dumps(body),
            headers={**headers, "Content-Type": "application/json"},
        )
        if r.status == 200:
            await r.content.readline()  # its first event: the stream is on its way
        return r

    wait_idle(vllm)
    counted_before = _aborts_counted(gw, route)
    streams = await asyncio.gather(*(open_stream() for _ in range(STREAMS)))
    failed = [(r.status, (await r.read())[:200]) for r in streams if r.status != 200]
    if failed:
        # vLLM's API server, busy streaming the first ones on 2 cores, can leave the
        # others unanswered for seconds (seen on this VM: no head within the deadline,
        # or the connection closed twice, 504 or 502 through the gateway, at 88bbcd7 as
        # now): a start that failed is not what this test measures
        print(f"\n{len(failed)} of the {STREAMS} streams did not start: {failed[:2]}")
        for r in streams:
            r.close()
        return None
    ids = [r.headers["X-Request-Id"] for r in streams]
    deadline = time.monotonic() + SETUP_S
    while (count := (await in_engine())[2]) != STREAMS:
        if time.monotonic() > deadline:
            print(f"\nat most {count:.0f} of the {STREAMS} streams were in vLLM")
            for r in streams:
                r.close()
            return None

    first_close = time.monotonic()
    closed_at: dict[str, float] = {}  # wall clock, as in the gateway's records
    for rid, r in zip(ids, streams, strict=True):
        r.close()
        closed_at[rid] = time.time()
    closed = time.monotonic()  # the last close (all 20 take well under 1 ms)
    # One poll at a time from the closes on, until one reads none running or waiting.
    polls = [await in_engine()]
    while polls[-1][2] != 0:
        assert polls[-1][1] - closed < 5, f"vLLM still held requests 5 s later: {polls[-3:]}"
        polls.append(await in_engine())
    trace = [(round((a - closed) * 1000), round((b - closed) * 1000), int(n)) for a, b, n in polls]
    miss_proven = any(a - closed > BOUND_S and n > 0 for a, _, n in polls)

    # The gateway's part, per client: its access record (status 499, the client went away)
    # against that client's own close. Records are flushed every 0.2 s.
    deadline = time.monotonic() + 5
    while len(records := {i: r for i, r in gw.access_records().items() if i in ids}) < STREAMS:
        assert time.monotonic() < deadline, f"{len(records)} of {STREAMS} access records"
        await asyncio.sleep(0.05)
    assert {rec["status"] for rec in records.values()} == {499}
    reaction_ms = sorted((float(rec["ts"]) - closed_at[rid]) * 1000 for rid, rec in records.items())
    # vLLM does not count aborts in vllm:request_success_total; the gateway counts its own.
    counted = tuple(a - b for a, b in zip(_aborts_counted(gw, route), counted_before, strict=True))
    assert counted == (STREAMS, STREAMS), f"(upstream aborts, cancelled) counted: {counted}"
    stalled = sum(d for _, d in stalls.during(first_close, polls[-1][1]))
    return Round(polls[-1][1] - closed, miss_proven, reaction_ms, trace, stalled)


def _aborts_counted(gw: GatewayProcess, route: str) -> tuple[float, float]:
    """The gateway's (upstream aborts, cancelled requests of the route) counters."""
    m = gw.metrics()
    return (
        m.get('sluice_upstream_aborts_total{backend="backend-0"}', 0.0),
        m.get(f'sluice_requests_total{{outcome="cancelled",priority="0",route="{route}"}}', 0.0),
    )


@pytest.mark.parametrize("route", ["completions", "responses", "messages"])
async def test_twenty_client_closes_free_vllm_within_100ms(vllm: VllmServer, route: str) -> None:
    """20 streams through the gateway, 20 client closes: vLLM runs (or queues) none of
    them 100 ms later. A round proves it when a poll that read 0 ended within 100 ms of the
    closes, and disproves it when a poll that began after 100 ms still read some; when
    vLLM's /metrics answered too slowly to tell either way (one poll can take 50-100 ms on
    a busy 2-core machine), when the 20 streams were never in vLLM together (or some did
    not start: vLLM's API server, busy with the first, had not read them), or when the
    machine stopped running this test for over 100 ms while it measured (machine_stalls.py),
    the round is run again: ROUNDS rounds at most."""
    gw = start_gateway([vllm.url], POLICY)
    rng = random.Random(20)
    rounds: list[Round] = []
    try:
        async with client_session() as s:
            long_words = await _long_answer_words(s, vllm) if route == "messages" else ""
            for _ in range(ROUNDS):
                with MachineStalls() as stalls:
                    r = await _one_round(s, vllm, gw, rng, stalls, route, long_words)
                if r is None:
                    print("the 20 streams were never in vLLM together: once more")
                    continue
                if r.stalled_s > 0:
                    print(
                        f"\nthe machine stalled {r.stalled_s * 1000:.0f} ms while measuring "
                        f"({stalls.summary()}): once more; {r}"
                    )
                    continue
                rounds.append(r)
                print(
                    f"\n{route} round {len(rounds)}: the gateway closed upstream "
                    f"{r.reaction_ms[0]:.0f}-{r.reaction_ms[-1]:.0f} ms (median "
                    f"{statistics.median(r.reaction_ms):.0f}) after each client's close; "
                    f"vLLM running + waiting 20 -> 0 within {r.dropped_by_s * 1000:.0f} ms "
                    f"of the closes; polls (start ms, end ms, count): {r.trace}"
                )
                # ms-resolution timestamps: a record may read up to 1 ms before its close
                assert r.reaction_ms[0] >= -1.0
                assert r.reaction_ms[-1] <= BOUND_S * 1000, f"the gateway was late: {r}"
                assert not r.miss_proven, (
                    f"vLLM still held requests {BOUND_S * 1000:.0f} ms after the closes: {r}"
                )
                if r.dropped_by_s <= BOUND_S:
                    break
        assert rounds and rounds[-1].dropped_by_s <= BOUND_S, (
            f"no round could show vLLM empty within {BOUND_S * 1000:.0f} ms of the closes: {rounds}"
        )
        engine = vllm.metrics()
        assert engine['vllm:request_success_total{finished_reason="abort"}'] == 0
    finally:
        gw.stop()
