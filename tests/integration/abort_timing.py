"""How fast the backend aborts a stream whose client closed: N streaming clients through
the gateway read until their first event (or token), wait for the others, then all
close; a separate process polls the backend's abort counter
(`vllm:request_success_total{finished_reason="abort"}`) over a warm connection and stamps
each reading with the system-wide monotonic clock (this process is busy closing N
streams and would delay its own readings). The k-th abort the backend counted answers
the k-th close: the delays, sorted, are returned (and their p50/p99 printed)."""

from __future__ import annotations

import asyncio
import statistics
import sys
import time
from collections.abc import Callable

import httpx
from conftest import SimProcess
from gateway_proc import GatewayProcess

ABORTS = 'vllm:request_success_total{finished_reason="abort"}'

_POLLER = """
import sys, time, httpx
from prometheus_client.parser import text_string_to_metric_families
url, key, target = sys.argv[1], sys.argv[2].split("{")[0], float(sys.argv[3])
def aborts(http):
    total = 0.0
    for fam in text_string_to_metric_families(http.get(url + "/metrics").text):
        for s in fam.samples:
            if s.name == key and s.labels.get("finished_reason") == "abort":
                total += s.value
    return total
with httpx.Client(timeout=5) as http:
    aborts(http)
    print("ready", flush=True)
    end = time.monotonic() + 3
    while time.monotonic() < end:
        count = aborts(http)
        print(time.monotonic(), count, flush=True)
        if count >= target:
            break
"""


async def abort_delays(
    sim: SimProcess,
    gw: GatewayProcess,
    path: str,
    body: dict[str, object],
    headers: dict[str, str],
    started: Callable[[str], bool],
    n: int = 50,
) -> list[float]:
    """Seconds from each client's close to the backend's abort, sorted. `started` says of
    a line of the stream that the client has what it waited for (then it stops reading)."""
    first_events = 0
    all_started = asyncio.Event()
    close = asyncio.Event()
    closed_at: list[float] = []
    limits = httpx.Limits(max_connections=n + 5)
    async with httpx.AsyncClient(timeout=30, limits=limits) as client:

        async def one() -> None:
            nonlocal first_events
            async with client.stream("POST", gw.url + path, headers=headers, json=body) as r:
                assert r.status_code == 200
                # Keep the iterator: closing it would close the connection early.
                lines = r.aiter_lines()
                async for line in lines:
                    if started(line):
                        break
                first_events += 1
                if first_events == n:
                    all_started.set()
                await close.wait()
            closed_at.append(time.monotonic())  # the connection is closed here

        tasks = [asyncio.create_task(one()) for _ in range(n)]
        await asyncio.wait_for(all_started.wait(), 30)
        before = sim.metrics()
        assert before["vllm:num_requests_running"] == n
        poller = await asyncio.create_subprocess_exec(
            sys.executable,
            "-c",
            _POLLER,
            sim.url,
            ABORTS,
            str(before.get(ABORTS, 0) + n),
            stdout=asyncio.subprocess.PIPE,
        )
        assert poller.stdout is not None
        assert (await poller.stdout.readline()).strip() == b"ready"
        close.set()
        await asyncio.gather(*tasks)
        out = (await asyncio.wait_for(poller.communicate(), 10))[0].decode()
    samples = [
        (float(t), int(float(c) - before.get(ABORTS, 0)))
        for t, c in (line.split() for line in out.splitlines())
    ]
    assert samples and samples[-1][1] == n, f"only {samples[-1][1]} of {n} aborted"
    closes = sorted(closed_at)
    delays = []
    for k in range(1, n + 1):
        seen_at = next(t for t, count in samples if count >= k)
        delays.append(max(0.0, seen_at - closes[k - 1]))
    delays.sort()
    p50, p99 = statistics.median(delays), delays[int(0.99 * n) - 1]
    print(
        f"\n{path}: abort after client close: p50 {p50 * 1000:.1f} ms, p99 {p99 * 1000:.1f} ms, "
        f"max {delays[-1] * 1000:.1f} ms"
    )
    return delays
