"""What a P0 reserve can buy at best: the running count against P0's first-token waits of a
threshold policy on an idealised engine, to put the measured limiter beside.

The engine has `slots` request slots (the sweet spot: past it, preemptions) and every
request holds one for `service` seconds whatever the batch (the real step time grows with
the batch, so this is optimistic for fuller engines). P1/P2 form an endless backlog (the
flood refuses most of them) and are started while fewer than `threshold` requests run; P0
arrives as a Poisson stream at `p0_rate` per second, starts at once while a slot is free,
else waits for the next end (first come, first served). A P0 request is on time when it
waited at most `wait` seconds (its TTFT objective less the engine's own first token).

    .venv/bin/python bench/reserve_frontier.py              # the flood's figures
    .venv/bin/python bench/reserve_frontier.py --slots 12 --p0-rate 1.3 --service 6

The flood (`sluice bench flood`): sweet spot 12, P0 1.3/s (78 in 60 s) of 112-token
answers at about 6 s each, P0's TTFT objective 1 s of which the engine's first token takes
0.13-0.36 s. docs/bench.md ("What a reserve can buy at best") has the table it printed and
the measured variants beside it.
"""

from __future__ import annotations

import argparse
import heapq
import random
from collections import deque
from dataclasses import dataclass


@dataclass(frozen=True)
class Point:
    slots: int
    threshold: int
    running_mean: float
    p0_on_time: float


def simulate(
    slots: int,
    threshold: int,
    *,
    p0_rate: float,
    service: float,
    wait: float,
    horizon: float,
    service_sigma: float,
    seed: int,
) -> Point:
    """One long run of the threshold policy (module docstring); `service_sigma` the
    lognormal spread of the service time (0: every request takes `service`)."""
    rng = random.Random(seed)
    # a lognormal of median m has mean m * exp(sigma^2 / 2): keep the mean at `service`
    median = service / (2.718281828459045 ** (service_sigma**2 / 2))

    def hold() -> float:
        return median * rng.lognormvariate(0.0, service_sigma) if service_sigma else service

    now = last = area = 0.0
    running = 0
    ends: list[float] = []
    waiting: deque[float] = deque()
    on_time = started = 0
    next_p0 = rng.expovariate(p0_rate)
    while running < threshold:  # the P1/P2 backlog is there from the start
        running += 1
        heapq.heappush(ends, hold())
    while now < horizon:
        if ends and ends[0] <= next_p0:
            now = heapq.heappop(ends)
            area += running * (now - last)
            last = now
            running -= 1
            if waiting:
                arrived = waiting.popleft()
                on_time += now - arrived <= wait
                started += 1
                running += 1
                heapq.heappush(ends, now + hold())
        else:
            now = next_p0
            area += running * (now - last)
            last = now
            next_p0 = now + rng.expovariate(p0_rate)
            if running < slots:
                running += 1
                on_time += 1
                started += 1
                heapq.heappush(ends, now + hold())
            else:
                waiting.append(now)
        while running < threshold and not waiting:  # the P1/P2 backlog fills to the threshold
            running += 1
            heapq.heappush(ends, now + hold())
    return Point(slots, threshold, area / now, on_time / max(1, started))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--slots", type=int, nargs="+", default=[11, 12, 13])
    ap.add_argument("--thresholds", type=int, nargs="+", default=[7, 8, 9, 10])
    ap.add_argument("--p0-rate", type=float, default=1.3)
    ap.add_argument("--service", type=float, default=6.0)
    ap.add_argument("--service-sigma", type=float, default=0.0)
    ap.add_argument("--wait", type=float, default=0.8)
    ap.add_argument("--horizon", type=float, default=200_000.0)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--sweet-spot", type=int, default=12, help="what the running mean is against")
    args = ap.parse_args()
    print("| P0 may fill (slots) | P1/P2 fill to | running mean | of the sweet spot | P0 on time |")
    print("|---|---|---|---|---|")
    for n in args.slots:
        for t in args.thresholds:
            if t > n:
                continue
            p = simulate(
                n,
                t,
                p0_rate=args.p0_rate,
                service=args.service,
                wait=args.wait,
                horizon=args.horizon,
                service_sigma=args.service_sigma,
                seed=args.seed,
            )
            share = p.running_mean / args.sweet_spot
            print(
                f"| {n} | {t} | {p.running_mean:.2f} | {100 * share:.0f} % "
                f"| {100 * p.p0_on_time:.1f} % |",
                flush=True,
            )


if __name__ == "__main__":
    main()
