"""Capacity: what one backend sustains at its sweet spot, measured in virtual time.

The sweet spot of an engine for a request mix is the largest number of concurrent
requests it can hold without preempting any and while keeping the 95th percentile of
time per output token within the P0 TPOT SLO (when there is one). We find it by bisection
over closed-loop runs of a single engine (keep `c` requests in flight, drawn from the
mix, for `horizon` s of virtual time; judge the part after `warmup`). Capacity is the
completed requests per second at that concurrency. A scenario's `rate: 0.7` means 0.7 x
(capacity x number of backends) for the phase's own mix. docs/bench.md explains why.

With several routes (scenario `routes`), the closed loop draws each request's route by its
share, and a pooling route's requests (embeddings: prefill-only) are what they are in the
run: their prompt, no output; the sweet spot and capacity are then those of the whole mix.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from functools import lru_cache

from sluice.bench.scenario import ResolvedPhase, RouteMix, _LengthDist
from sluice.bench.workload import draw_length
from sluice.sim.engine import Engine, EngineRequest
from sluice.sim.profiles import Profile

WARMUP_S = 15.0
HORIZON_S = 60.0

# A route mix as calibration takes it: (share, pooling, prompt or None for the phase's).
Routes = tuple[tuple[float, bool, _LengthDist | None], ...]


@dataclass(frozen=True, slots=True)
class Capacity:
    sweet_spot: int  # concurrent requests per backend
    rps: float  # completed requests per second per backend at the sweet spot
    tokens_per_s: float  # output tokens per second per backend at the sweet spot


@dataclass(frozen=True, slots=True)
class ClosedLoopResult:
    concurrency: int
    rps: float
    tokens_per_s: float
    preemptions: int
    tpot_p95_s: float
    kv_usage_max: float


def closed_loop(
    profile: Profile,
    prompt: _LengthDist,
    output: _LengthDist,
    max_tokens: int,
    concurrency: int,
    *,
    seed: int = 0,
    warmup: float = WARMUP_S,
    horizon: float = HORIZON_S,
    routes: Routes = (),
) -> ClosedLoopResult:
    """Keep `concurrency` requests in flight on one engine; measure after `warmup`."""
    engine = Engine(profile, seed=seed)
    rng = random.Random(f"{seed}/calibration")
    rng_route = random.Random(f"{seed}/calibration-route")  # drawn only with `routes`
    shares = [share for share, _, _ in routes]
    max_tokens = min(max_tokens, profile.max_model_len - 1)
    t = 0.0
    n = 0
    inflight = 0
    done = 0
    gen0 = 0
    t_start: float | None = None
    tpots: list[float] = []
    preempt0 = 0
    kv_max = 0.0
    while t < horizon:
        while inflight < concurrency:
            if routes:
                _, pooling, own = rng_route.choices(routes, shares)[0]
                if pooling:
                    p = min(draw_length(own or prompt, rng_route), profile.max_model_len)
                    engine.submit(EngineRequest(f"c{n}", max(1, p), 1, 1, pooling=True), t)
                    n += 1
                    inflight += 1
                    continue
                if own is not None:
                    p = min(draw_length(own, rng_route), profile.max_model_len - max_tokens)
                    o = min(draw_length(output, rng), max_tokens)
                    engine.submit(EngineRequest(f"c{n}", max(1, p), max_tokens, max(1, o)), t)
                    n += 1
                    inflight += 1
                    continue
            p = min(draw_length(prompt, rng), profile.max_model_len - max_tokens)
            o = min(draw_length(output, rng), max_tokens)
            engine.submit(EngineRequest(f"c{n}", max(1, p), max_tokens, max(1, o)), t)
            n += 1
            inflight += 1
        result = engine.step(t)
        t = result.end
        if t_start is None and t >= warmup:
            snap = engine.snapshot()
            t_start, gen0, preempt0 = t, snap.generation_tokens_total, snap.num_preemptions_total
        if t_start is not None:
            kv_max = max(kv_max, engine.kv_usage)
        for f in result.finished:
            inflight -= 1
            if t_start is not None:
                done += 1
                tpot = f.time_per_output_token
                if tpot is not None:
                    tpots.append(tpot)
    snap = engine.snapshot()
    span = max(1e-9, t - (t_start or 0.0))
    tpots.sort()
    return ClosedLoopResult(
        concurrency=concurrency,
        rps=done / span,
        tokens_per_s=(snap.generation_tokens_total - gen0) / span,
        preemptions=snap.num_preemptions_total - preempt0,
        tpot_p95_s=tpots[int(0.95 * (len(tpots) - 1))] if tpots else 0.0,
        kv_usage_max=kv_max,
    )


@lru_cache(maxsize=64)
def _calibrate(
    profile: Profile,
    prompt: _LengthDist,
    output: _LengthDist,
    max_tokens: int,
    tpot_slo: float | None,
    seed: int,
    routes: Routes = (),
) -> Capacity:
    def ok(r: ClosedLoopResult) -> bool:
        return r.preemptions == 0 and (tpot_slo is None or r.tpot_p95_s <= tpot_slo)

    mean_prompt = max(1.0, min(prompt.mean_estimate, profile.max_model_len))
    hi = max(2, min(profile.max_num_seqs, int(profile.kv_capacity_tokens / mean_prompt) + 1))
    results: dict[int, ClosedLoopResult] = {}

    def run(c: int) -> ClosedLoopResult:
        if c not in results:
            results[c] = closed_loop(
                profile, prompt, output, max_tokens, c, seed=seed, routes=routes
            )
        return results[c]

    lo = 1
    if ok(run(hi)):
        lo = hi
    else:
        # bisection to 3 % (the throughput is flat near the sweet spot)
        while hi - lo > max(1, lo // 32):
            mid = (lo + hi) // 2
            if ok(run(mid)):
                lo = mid
            else:
                hi = mid
    best = run(lo)
    return Capacity(sweet_spot=lo, rps=best.rps, tokens_per_s=best.tokens_per_s)


def calibrate(
    profile: Profile,
    phase: ResolvedPhase,
    tpot_slo: float | None,
    *,
    seed: int = 0,
    routes: dict[str, RouteMix] | None = None,
) -> Capacity:
    """The sweet spot and capacity of one backend for the phase's request mix (over its
    routes, when there are several or one differs from plain generation)."""
    mix: Routes = ()
    if routes and (len(routes) > 1 or any(r.pooling or r.prompt for r in routes.values())):
        mix = tuple((r.share, r.pooling, r.prompt) for r in routes.values())
    return _calibrate(profile, phase.prompt, phase.output, phase.max_tokens, tpot_slo, seed, mix)
