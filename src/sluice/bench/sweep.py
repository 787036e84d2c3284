"""The sweet spot by a closed-loop sweep: keep `c` requests in flight on one backend, for
each `c` of a list, and measure what it delivers -- in virtual time (`bench.capacity`'s
closed loop) and against a real `sluice sim` process, side by side.

Per level: completed requests/s and output tokens/s after the warm-up, preemptions, the
clients' TPOT p95 and the engine's mean running count. The **sweet spot** is the largest
level with no preemption and TPOT p95 within the P0 TPOT SLO (docs/bench.md, "Capacity");
`knee` is where throughput stops rising: the smallest level within 3 % of the best
tokens/s. The first phase's request mix of the scenario (real-size, its `real` section)
is used, as `sluice bench SCENARIO --sweep` does.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable
from typing import Any

import aiohttp
import orjson

from sluice.bench.capacity import closed_loop
from sluice.bench.scenario import Scenario
from sluice.bench.workload import draw_length

WARMUP_S = 10.0
MEASURE_S = 30.0
KNEE_TOLERANCE = 0.03

Progress = Callable[[str, float], None]


def default_levels(sweet_spot: int) -> list[int]:
    lo = max(1, round(sweet_spot * 0.5))
    hi = max(lo + 2, round(sweet_spot * 1.5))
    step = max(1, (hi - lo) // 10)
    return list(range(lo, hi + 1, step))


def _summarise(rows: list[dict[str, Any]], tpot_slo: float | None) -> dict[str, Any]:
    ok = [
        r["concurrency"]
        for r in rows
        if r["preemptions"] == 0 and (tpot_slo is None or (r["tpot_p95_s"] or 0) <= tpot_slo)
    ]
    best = max((r["tokens_per_s"] for r in rows), default=0.0)
    knee = next(
        (r["concurrency"] for r in rows if r["tokens_per_s"] >= (1 - KNEE_TOLERANCE) * best), None
    )
    first_preempt = next((r["concurrency"] for r in rows if r["preemptions"] > 0), None)
    return {
        "sweet_spot": max(ok) if ok else None,
        "knee": knee,
        "preemptions_from": first_preempt,
        "levels": rows,
    }


def sweep_virtual(scenario: Scenario, levels: list[int], *, horizon: float) -> dict[str, Any]:
    phase = scenario.phases[0]
    profile = scenario.spec.backends.build_profile()
    rows = []
    for c in levels:
        r = closed_loop(
            profile,
            phase.prompt,
            phase.output,
            phase.max_tokens,
            c,
            warmup=WARMUP_S,
            horizon=WARMUP_S + horizon,
        )
        rows.append(
            {
                "concurrency": c,
                "rps": round(r.rps, 3),
                "tokens_per_s": round(r.tokens_per_s, 1),
                "preemptions": r.preemptions,
                "tpot_p95_s": round(r.tpot_p95_s, 4),
                "running_mean": float(c),
            }
        )
    return _summarise(rows, scenario.slos["P0"].tpot)


async def _closed_loop_real(
    url: str,
    model: str,
    scenario: Scenario,
    concurrency: int,
    horizon: float,
    seed: int,
) -> dict[str, Any]:
    from sluice.bench.prom_text import first, series

    phase = scenario.phases[0]
    rng = random.Random(f"{seed}/sweep/{concurrency}")
    max_model_len = scenario.spec.backends.build_profile().max_model_len
    t0 = time.monotonic()
    measure_from = t0 + WARMUP_S
    end = measure_from + horizon
    done = 0
    tokens = 0
    tpots: list[float] = []

    async def one(session: aiohttp.ClientSession) -> None:
        nonlocal done, tokens
        max_tokens = min(phase.max_tokens, max_model_len - 1)
        while time.monotonic() < end:
            prompt = min(draw_length(phase.prompt, rng), max_model_len - max_tokens)
            out = min(draw_length(phase.output, rng), max_tokens)
            body = orjson.dumps(
                {
                    "model": model,
                    "prompt": [7] * max(1, prompt),
                    "max_tokens": max(1, out),
                    "ignore_eos": True,
                    "stream": True,
                }
            )
            first = last = None
            n = 0
            async with session.post(f"{url}/v1/completions", data=body) as resp:
                async for line in resp.content:
                    if line.startswith(b"data: ") and b'"text":"' in line:
                        now = time.monotonic()
                        first = first or now
                        last = now
                        n += 1
            if last is not None and last >= measure_from and last < end:
                done += 1
                tokens += n
                if n >= 2 and first is not None:
                    tpots.append((last - first) / (n - 1))

    async def watch(session: aiohttp.ClientSession) -> tuple[float, float, list[float]]:
        pre0 = pre1 = 0.0
        running: list[float] = []
        while time.monotonic() < end:
            async with session.get(f"{url}/metrics") as r:
                m = series(await r.text())
            now = time.monotonic()
            pre = first(m, "vllm:num_preemptions_total") or 0.0
            if now < measure_from:
                pre0 = pre
            else:
                pre1 = pre
                running.append(first(m, "vllm:num_requests_running") or 0.0)
            await asyncio.sleep(0.25)
        return pre0, pre1, running

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        watcher = asyncio.create_task(watch(session))
        await asyncio.gather(*(one(session) for _ in range(concurrency)))
        pre0, pre1, running = await watcher
    tpots.sort()
    return {
        "concurrency": concurrency,
        "rps": round(done / horizon, 3),
        "tokens_per_s": round(tokens / horizon, 1),
        "preemptions": int(pre1 - pre0),
        "tpot_p95_s": round(tpots[int(0.95 * (len(tpots) - 1))], 4) if tpots else None,
        "running_mean": round(sum(running) / len(running), 2) if running else None,
    }


def sweep_real(
    scenario: Scenario,
    levels: list[int],
    *,
    horizon: float,
    seed: int,
    progress: Progress | None = None,
) -> dict[str, Any]:
    """One fresh simulator per level (the scenario's real backends' profile and speed)."""
    import uvloop

    from sluice.bench.procfs import CpuSampler
    from sluice.bench.real import _model_name, start_sims

    one = scenario.spec.model_copy(
        update={"backends": scenario.spec.backends.model_copy(update={"count": 1})}
    )
    single = Scenario(spec=one, phases=scenario.phases, slos=scenario.slos, source=scenario.source)
    rows = []
    samples: list[float] = []
    for i, c in enumerate(levels):
        if progress is not None:
            progress(f"real sweep: {c} in flight", i / len(levels))
        procs, urls = start_sims(single)
        try:
            model = uvloop.run(_model_name(urls[0]))
            cpu = CpuSampler()

            async def run(
                c: int = c, model: str = model, url: str = urls[0], cpu: CpuSampler = cpu
            ) -> dict[str, Any]:
                task = asyncio.create_task(_closed_loop_real(url, model, single, c, horizon, seed))
                while not task.done():
                    await asyncio.sleep(1.0)
                    cpu.sample()
                return await task

            row = uvloop.run(run())
            row["cpu_busy_max"] = round(max(cpu.samples), 3) if cpu.samples else None
            samples += cpu.samples
            rows.append(row)
        finally:
            for p in procs:
                p.stop()
    out = _summarise(rows, scenario.slos["P0"].tpot)
    from sluice.bench.procfs import cpu_summary

    out["cpu"] = cpu_summary(samples)
    return out
