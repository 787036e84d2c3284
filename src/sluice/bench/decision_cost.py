"""What one admission decision costs the core as a gateway's traffic grows from one to
sixteen replicas' worth (issue 20): the Controller alone, fed by a bare event loop.

`sluice bench fleet` splits a fleet's traffic over R replicas; a replica that takes over
the traffic of others (a rolling restart, replicas lost, least-connections sending it
more) must not get slower per decision as its queues grow. Here one Controller with the
`sluice` policy's defaults sits in front of `backends` stand-in engines, each a plain
server: a request holds its estimated KV footprint from dispatch to its end, its first
token comes `ttft_s` after dispatch, its end after its output at `tpot_s` per token, and
a scrape every `scrape_s` reports running requests and KV usage as a vLLM would. Traffic
is `replicas` x `per_replica_rps` Poisson arrivals, the P0/P1/P2 mix of the built-in
scenarios; by default 16 replicas' worth is 3x what the stand-ins serve, so the queues
fill (to their `maxQueueSize`) and the drop policies and Retry-After work as in a burst.

Only the CPU time inside the Controller's calls is counted (`time.thread_time_ns`
around each): arrive, step, on_first_token and on_finish divided by the admission
decisions (arrivals), and apart from them on_metrics (and the step after a scrape round)
per backend scraped, which a gateway pays per scrape whatever its traffic. The calls are
deterministic (seeded); the nanoseconds move with the machine's load (caches, frequency),
so the rows run in a rotating order over `rounds` rounds and each row keeps its median.

Run: python -m sluice.bench.decision_cost [--replicas 1,2,4,8,16] [--rounds 3]
"""

from __future__ import annotations

import argparse
import heapq
import math
import random
import statistics
import time
from collections.abc import Sequence
from typing import Any

from sluice.config import Policy
from sluice.core.clock import FakeClock
from sluice.core.controller import Controller
from sluice.core.types import BackendMetrics, Outcome, RequestInfo

MIX = ((0, 0.2), (1, 0.4), (2, 0.4))
KV_TOKENS = 32_768  # per stand-in engine (2,048 blocks of 16)
PROMPT_MEDIAN, OUTPUT_MEDIAN = 500, 200

_ARRIVE, _FIRST, _END, _SCRAPE, _WAKE = range(5)


def _lognormal(rng: random.Random, median: float, sigma: float, lo: int, hi: int) -> int:
    return max(lo, min(hi, round(median * math.exp(rng.gauss(0.0, sigma)))))


def run_once(
    replicas: int,
    *,
    backends: int = 64,
    per_replica_rps: float | None = None,
    duration_s: float = 20.0,
    ttft_s: float = 0.2,
    tpot_s: float = 0.02,
    scrape_s: float = 0.25,
    seed: int = 1,
) -> dict[str, Any]:
    """One controller at `replicas` replicas' worth of traffic; its cost per decision."""
    # what the stand-ins serve: KV-bound at 80 % of each cache, a mean request holding
    # about prompt + output tokens for ttft + output x tpot seconds
    hold = PROMPT_MEDIAN + OUTPUT_MEDIAN * 1.4
    per_backend = 0.8 * KV_TOKENS / hold / (ttft_s + OUTPUT_MEDIAN * 1.4 * tpot_s)
    if per_replica_rps is None:
        per_replica_rps = 3.0 * per_backend * backends / 16
    rate = replicas * per_replica_rps
    policy = Policy.model_validate({"limiter": {"algorithm": "sluice", "maxLimit": 1024}})
    clock = FakeClock()
    names = [f"b{i}" for i in range(backends)]
    ctrl = Controller(policy.core_settings(), clock, names)
    for n in names:
        ctrl.set_backend_models(n, ["m"])
        ctrl.set_backend_health(n, True)
    rng = random.Random(f"{seed}/{replicas}")
    heap: list[tuple[float, int, int, Any]] = []
    seq = 0

    def push(t: float, kind: int, payload: Any) -> None:
        nonlocal seq
        seq += 1
        heapq.heappush(heap, (t, seq, kind, payload))

    t = 0.0
    n_arrivals = 0
    while True:
        t += rng.expovariate(rate)
        if t >= duration_s:
            break
        push(t, _ARRIVE, n_arrivals)
        n_arrivals += 1
    push(0.0, _SCRAPE, None)
    held: dict[str, int] = {}  # in flight: request id -> tokens held
    on: dict[str, tuple[str, int]] = {}  # request id -> (backend, output tokens)
    running = dict.fromkeys(names, 0)
    kv = dict.fromkeys(names, 0)
    wake_at: list[float | None] = [None]
    ns = 0
    calls = 0
    scrape_ns = 0
    scrapes = 0
    queued_sum = 0
    queued_max = 0
    perf = time.thread_time_ns  # CPU time: a busy machine's waits are not counted

    def apply(step_assignments: Sequence[Any], rejections: int, at: float | None) -> None:
        for a in step_assignments:
            rid = a.request_id
            prompt, output = pending.pop(rid)
            b = a.backend
            held[rid] = prompt + output
            on[rid] = (b, output)
            running[b] += 1
            kv[b] += prompt + output
            push(now + ttft_s, _FIRST, rid)
        if at is not None and (wake_at[0] is None or at < wake_at[0]):
            wake_at[0] = at
            push(at, _WAKE, at)

    pending: dict[str, tuple[int, int]] = {}
    while heap:
        now, _, kind, payload = heapq.heappop(heap)
        clock.set(now)
        if kind == _ARRIVE:
            rid = f"r{payload}"
            u = rng.random()
            prio = 0 if u < MIX[0][1] else 1 if u < MIX[0][1] + MIX[1][1] else 2
            prompt = _lognormal(rng, PROMPT_MEDIAN, 0.6, 16, 4000)
            output = _lognormal(rng, OUTPUT_MEDIAN, 0.8, 8, 1024)
            info = RequestInfo(rid, f"t{prio}", prio, "m", prompt, 1024)
            pending[rid] = (prompt, output)
            t0 = perf()
            adm = ctrl.arrive(info)
            step = ctrl.step()
            ns += perf() - t0
            calls += 2
            if not adm.admitted:
                pending.pop(rid)
            q = sum(len(c) for c in ctrl._queues)  # a benchmark peeks
            queued_sum += q
            queued_max = max(queued_max, q)
        elif kind == _FIRST:
            if payload not in on:
                continue
            t0 = perf()
            ctrl.on_first_token(payload)
            ns += perf() - t0
            calls += 1
            push(now + on[payload][1] * tpot_s, _END, payload)
            continue
        elif kind == _END:
            b, output = on.pop(payload)
            running[b] -= 1
            kv[b] -= held.pop(payload)
            t0 = perf()
            ctrl.on_finish(payload, Outcome.OK, prompt_tokens=0, completion_tokens=output)
            step = ctrl.step()
            ns += perf() - t0
            calls += 2
        elif kind == _SCRAPE:
            t0 = perf()
            for b in names:
                ctrl.on_metrics(
                    b,
                    BackendMetrics(
                        at=now,
                        running=float(running[b]),
                        waiting=0.0,
                        kv_usage=min(1.0, kv[b] / KV_TOKENS),
                        num_gpu_blocks=KV_TOKENS // 16,
                        block_size=16,
                    ),
                )
            step = ctrl.step()
            scrape_ns += perf() - t0
            scrapes += backends
            if now < duration_s:
                push(now + scrape_s, _SCRAPE, None)
        else:  # _WAKE
            if wake_at[0] != payload:
                continue
            wake_at[0] = None
            t0 = perf()
            step = ctrl.step()
            ns += perf() - t0
            calls += 1
        for rej in step.rejections:
            pending.pop(rej.request_id, None)
        apply(step.assignments, len(step.rejections), step.wake_at)
    snap = ctrl.snapshot()
    return {
        "replicas": replicas,
        "offered_rps": round(rate, 1),
        "decisions": n_arrivals,
        "core_calls": calls,
        "core_ns_per_decision": ns / max(1, n_arrivals),
        "core_ns_per_backend_scrape": scrape_ns / max(1, scrapes),
        "queued_mean": round(queued_sum / max(1, n_arrivals), 1),
        "queued_max": queued_max,
        "dispatched": sum(c.dispatched for c in snap.classes.values()),
    }


def measure(
    replicas: Sequence[int] = (1, 2, 4, 8, 16), rounds: int = 3, **kwargs: Any
) -> dict[str, Any]:
    """Every row `rounds` times in a rotating order; each row's median cost."""
    cpu0, wall0 = time.process_time(), time.perf_counter()
    runs: dict[int, list[dict[str, Any]]] = {r: [] for r in replicas}
    order = list(replicas)
    for k in range(rounds):
        for r in order[k % len(order) :] + order[: k % len(order)]:
            runs[r].append(run_once(r, **kwargs))
    rows = []
    for r in replicas:
        first = runs[r][0]
        rows.append(
            {
                **{k: v for k, v in first.items() if not k.startswith("core_ns")},
                "core_us_per_decision": round(
                    statistics.median(x["core_ns_per_decision"] for x in runs[r]) / 1000, 2
                ),
                "core_us_per_decision_rounds": [
                    round(x["core_ns_per_decision"] / 1000, 2) for x in runs[r]
                ],
                "core_us_per_backend_scrape": round(
                    statistics.median(x["core_ns_per_backend_scrape"] for x in runs[r]) / 1000,
                    2,
                ),
            }
        )
    base = rows[0]["core_us_per_decision"]
    for row in rows:
        row["ratio_to_first"] = round(row["core_us_per_decision"] / base, 2)
        row["log2_queue"] = round(math.log2(2 + row["queued_mean"]), 2)
    cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
    return {
        "rows": rows,
        "cpu_s": round(cpu, 2),
        "wall_s": round(wall, 2),
        "cpu_share_of_wall": round(cpu / wall, 2) if wall else None,
    }


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--replicas", default="1,2,4,8,16", help="rows: replicas' worth of traffic")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--duration", type=float, default=20.0, help="virtual seconds per row")
    args = p.parse_args(argv)
    reps = [int(x) for x in args.replicas.split(",")]
    out = measure(reps, args.rounds, duration_s=args.duration)
    print(f"{'R':>3} {'offered/s':>9} {'decisions':>9} {'queued':>7} {'us/decision':>11} ratio")
    for row in out["rows"]:
        print(
            f"{row['replicas']:>3} {row['offered_rps']:>9} {row['decisions']:>9} "
            f"{row['queued_mean']:>7} {row['core_us_per_decision']:>11} {row['ratio_to_first']}"
        )
    print(f"cpu {out['cpu_s']} s of {out['wall_s']} s wall")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
