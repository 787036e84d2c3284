"""TTFT and TPOT against concurrency, from the simulator's engine in virtual time.

For each concurrency C, C closed-loop clients each keep one request in the engine (a
finished request is replaced at once by a new one). After a warm-up of C completions,
the next completions are measured. Writes docs/img/sim_<profile>_curves.png and prints
the table.

    .venv/bin/python scripts/sim_curves.py [--profile h100-llama3-8b] [--out DIR]
"""

from __future__ import annotations

import argparse
import heapq
import random
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

from sluice.sim.engine import Engine, EngineRequest
from sluice.sim.profiles import PROFILES, Profile

# (label, prompt tokens, output tokens) per profile
WORKLOADS: dict[str, list[tuple[str, int, int]]] = {
    "h100-llama3-8b": [("prompt 1k, output 256", 1024, 256), ("prompt 4k, output 256", 4096, 256)],
    "tiny": [("prompt 100, output 100", 100, 100), ("prompt 400, output 100", 400, 100)],
}
CONCURRENCY: dict[str, list[int]] = {
    "h100-llama3-8b": [1, 2, 4, 8, 16, 32, 64, 128, 256, 384, 512, 768, 1024],
    "tiny": [1, 2, 4, 8, 12, 16, 24, 32, 48, 64],
}


@dataclass
class Point:
    concurrency: int
    ttft_p50: float
    ttft_p95: float
    tpot_p50: float
    tpot_p95: float
    tokens_per_s: float
    kv_usage: float
    preemptions_per_request: float


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def closed_loop(
    profile: Profile, concurrency: int, prompt: int, output: int, *, seed: int = 0
) -> Point:
    """C clients in a closed loop; request sizes vary +-50% around (prompt, output) and the
    clients start at random moments within the first second, so they do not move in step."""
    rng = random.Random(seed)
    engine = Engine(profile, seed=seed)
    arrivals: list[tuple[float, int]] = []  # (time, request number), a heap
    counter = 0

    def schedule(at: float) -> None:
        nonlocal counter
        heapq.heappush(arrivals, (at, counter))
        counter += 1

    def submit(at: float, number: int) -> None:
        p = max(1, round(prompt * rng.uniform(0.5, 1.5)))
        o = max(1, round(output * rng.uniform(0.5, 1.5)))
        engine.submit(EngineRequest(f"r{number}", p, o, o), at)

    for _ in range(concurrency):
        schedule(rng.uniform(0.0, 1.0))
    warmup = concurrency
    measure = max(2 * concurrency, 200)
    done = 0
    ttft: list[float] = []
    tpot: list[float] = []
    preemptions = 0
    tokens = 0
    kv_time = 0.0
    start = end = now = 0.0
    while done < warmup + measure:
        while arrivals and arrivals[0][0] <= now:
            at, number = heapq.heappop(arrivals)
            submit(at, number)
        if not engine.has_work():
            now = arrivals[0][0]  # idle until the next client sends
            continue
        result = engine.step(now)
        if done >= warmup:
            tokens += result.num_generation_tokens
            kv_time += engine.kv_usage * result.duration
        now = result.end
        for stats in result.finished:
            done += 1
            if done == warmup:
                start = now
            elif done > warmup:
                ttft.append(stats.ttft or 0.0)
                tpot.append(stats.time_per_output_token or 0.0)
                preemptions += stats.num_preemptions
            schedule(now)  # the client sends its next request at once
        end = now
    span = max(end - start, 1e-9)
    return Point(
        concurrency=concurrency,
        ttft_p50=statistics.median(ttft),
        ttft_p95=pct(ttft, 0.95),
        tpot_p50=statistics.median(tpot),
        tpot_p95=pct(tpot, 0.95),
        tokens_per_s=tokens / span,
        kv_usage=kv_time / span,
        preemptions_per_request=preemptions / len(ttft),
    )


def plot(profile: Profile, series: dict[str, list[Point]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(11, 8))
    (ax_ttft, ax_tpot), (ax_tput, ax_kv) = axes
    ax_preempt = ax_kv.twinx()
    for label, points in series.items():
        c = [p.concurrency for p in points]
        (line,) = ax_ttft.plot(c, [p.ttft_p50 for p in points], marker="o", label=f"{label} p50")
        ax_ttft.plot(c, [p.ttft_p95 for p in points], ls="--", color=line.get_color(), label="p95")
        ax_tpot.plot(c, [p.tpot_p50 * 1000 for p in points], marker="o", color=line.get_color())
        ax_tpot.plot(c, [p.tpot_p95 * 1000 for p in points], ls="--", color=line.get_color())
        ax_tput.plot(c, [p.tokens_per_s for p in points], marker="o", color=line.get_color())
        ax_kv.plot(c, [p.kv_usage for p in points], marker="o", color=line.get_color())
        preempt = [p.preemptions_per_request for p in points]
        ax_preempt.plot(c, preempt, ls=":", marker="x", color=line.get_color())
    ax_preempt.set_ylabel("preemptions per request (dotted)")
    ax_ttft.set(title="TTFT", ylabel="seconds", yscale="log")
    ax_tpot.set(title="TPOT (time per output token)", ylabel="ms")
    ax_tput.set(title="Generation throughput", ylabel="tokens / s")
    ax_kv.set(title="KV-cache usage (solid)", ylabel="fraction of blocks", ylim=(0, 1.05))
    for ax in axes.flat:
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent requests")
        ax.grid(True, alpha=0.3)
    ax_ttft.legend(fontsize=8)
    fig.suptitle(
        f"sluice sim, profile {profile.name}: closed loop, virtual time "
        f"({profile.num_gpu_blocks} KV blocks x {profile.block_size}, "
        f"max_num_seqs {profile.max_num_seqs})"
    )
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--profile", default="h100-llama3-8b", choices=sorted(WORKLOADS))
    parser.add_argument("--out", type=Path, default=Path("docs/img"))
    args = parser.parse_args()
    profile = PROFILES[args.profile]
    series: dict[str, list[Point]] = {}
    print(f"profile {profile.name}")
    header = "conc  ttft_p50  ttft_p95  tpot_p50  tpot_p95   tok/s   kv  preempt/req"
    for label, prompt, output in WORKLOADS[args.profile]:
        print(f"\n{label}\n{header}")
        points = []
        for c in CONCURRENCY[args.profile]:
            p = closed_loop(profile, c, prompt, output)
            points.append(p)
            print(
                f"{c:4d} {p.ttft_p50:8.3f}s {p.ttft_p95:8.3f}s {p.tpot_p50 * 1000:7.1f}ms "
                f"{p.tpot_p95 * 1000:7.1f}ms {p.tokens_per_s:7.0f} {p.kv_usage:4.2f} "
                f"{p.preemptions_per_request:8.2f}"
            )
        series[label] = points
    path = args.out / f"sim_{profile.name.replace('-', '_')}_curves.png"
    plot(profile, series, path)
    print(f"\nwrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
