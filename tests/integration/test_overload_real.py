"""Overload protection with real processes: two `sluice sim --profile tiny` backends
flooded at about 3x what they sustain, 20% P0 (streaming), 40% P1, 40% P2.

Straight to the simulators the flood fills their KV caches and they preempt; through the
gateway they never preempt, every P0 request succeeds, P2 is refused before P1 (and P0 is
not refused at all), and every refusal carries a Retry-After.

Capacity here: each request is ~260 prompt + 150 output tokens; a tiny backend (4,096 KV
tokens) runs about 8 of them at once, ~1.5-2 s each at --speed 0.5 on this shared machine,
so the two sustain ~4-5 requests/s; the flood offers 13/s."""

from __future__ import annotations

import asyncio
import random
import time
from collections import Counter
from dataclasses import dataclass

import httpx
import pytest
from conftest import SimFactory, SimProcess
from gateway_proc import start_gateway

pytestmark = pytest.mark.integration

RATE_PER_S = 13.0
DURATION_S = 10.0
KEYS = {0: "sk-demo-p0", 1: "sk-demo-p1", 2: "sk-demo-p2"}
BODY = {
    "model": "sluice-sim",
    "messages": [{"role": "user", "content": "word " * 200}],
    "max_tokens": 150,
    "ignore_eos": True,
}


@dataclass
class Answer:
    priority: int
    sent: float
    status: int | str
    code: str | None = None
    retry_after: str | None = None


async def _flood(urls: list[str], cancel_at_end: bool) -> list[Answer]:
    rng = random.Random(7)
    answers: list[Answer] = []
    limits = httpx.Limits(max_connections=1000)
    async with httpx.AsyncClient(timeout=120, limits=limits) as client:

        async def one(i: int, priority: int) -> None:
            url = urls[i % len(urls)] + "/v1/chat/completions"
            headers = {"Authorization": f"Bearer {KEYS[priority]}"}
            sent = time.monotonic()
            try:
                if priority == 0:
                    async with client.stream(
                        "POST", url, headers=headers, json={**BODY, "stream": True}
                    ) as r:
                        if r.status_code == 200:
                            async for _ in r.aiter_lines():
                                pass
                        else:
                            await r.aread()
                else:
                    r = await client.post(url, headers=headers, json=BODY)
            except httpx.HTTPError as exc:
                answers.append(Answer(priority, sent, type(exc).__name__))
                return
            code = r.json()["error"]["code"] if r.status_code >= 400 else None
            answers.append(
                Answer(priority, sent, r.status_code, code, r.headers.get("Retry-After"))
            )

        tasks = []
        start = time.monotonic()
        i = 0
        while time.monotonic() - start < DURATION_S:
            priority = rng.choices((0, 1, 2), (0.2, 0.4, 0.4))[0]
            tasks.append(asyncio.create_task(one(i, priority)))
            i += 1
            await asyncio.sleep(rng.expovariate(RATE_PER_S))
        if cancel_at_end:
            # The direct arm only has to show the preemptions; hanging up aborts the rest.
            await asyncio.sleep(2.0)
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        else:
            await asyncio.gather(*tasks)
    return answers


def _preemptions(sims: list[SimProcess]) -> float:
    return sum(s.metrics().get("vllm:num_preemptions_total", 0.0) for s in sims)


async def test_flood_through_the_gateway_vs_direct(sim_factory: SimFactory) -> None:
    sims = [sim_factory("--profile", "tiny", "--speed", "0.5", "--seed", str(i)) for i in range(2)]

    before = _preemptions(sims)
    await _flood([s.url for s in sims], cancel_at_end=True)
    direct_preemptions = _preemptions(sims) - before

    gw = start_gateway([s.url for s in sims])
    try:
        before = _preemptions(sims)
        answers = await _flood([gw.url], cancel_at_end=False)
        gateway_preemptions = _preemptions(sims) - before
    finally:
        gw.stop()

    by_class = {
        p: Counter(str(a.status) if a.code is None else a.code for a in answers if a.priority == p)
        for p in (0, 1, 2)
    }
    print(
        f"\ndirect: {direct_preemptions:.0f} preemptions; through Sluice: "
        f"{gateway_preemptions:.0f}; answers by class: {by_class}"
    )
    assert direct_preemptions > 0
    assert gateway_preemptions == 0

    p0 = [a for a in answers if a.priority == 0]
    assert sum(a.status == 200 for a in p0) >= 0.99 * len(p0), by_class[0]
    refused = [a for a in answers if a.status in (429, 503)]
    assert refused and all(a.retry_after and int(a.retry_after) >= 1 for a in refused)
    first = {
        p: min((a.sent for a in refused if a.priority == p), default=float("inf"))
        for p in (0, 1, 2)
    }
    assert first[2] <= first[1] < first[0], first
    assert not [a for a in answers if a.status not in (200, 429)], Counter(
        a.status for a in answers
    )
