"""The workload: an open-loop list of client requests drawn from a scenario, seeded and
deterministic, so every arm of a benchmark faces exactly the same clients.

Arrivals are Poisson (or evenly spaced: `process: uniform`) with a rate that is constant
within each phase. Each request gets a class from the phase's mix, a tenant of that class
(by `share`), a prompt and an output length from the phase's distributions, and its
client's behaviour (deadline, cancel after N tokens, retries). Each aspect draws from its
own random stream, so changing one (say the cancel share) leaves the others as they were.
With `process: uniform` the class and tenant choices are exact shares too (smooth weighted
round robin), which makes small workloads exactly predictable."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

from sluice.bench.scenario import (
    CLASSES,
    ClientBehaviour,
    ResolvedPhase,
    Retry,
    Scenario,
    TenantSpec,
    _LengthDist,
)

_MASK64 = (1 << 64) - 1


@dataclass(slots=True)
class ClientRequest:
    """One logical request of one client (its retries are attempts of the same request)."""

    index: int
    request_id: str
    arrival: float  # of the first attempt
    phase: int
    priority: int
    tenant: str
    weight: float
    prompt_tokens: int
    max_tokens: int
    output_tokens: int  # what the engine will generate (stop reached), <= max_tokens
    cancel_after: int | None  # the client leaves after this many tokens
    deadline: float | None  # seconds per attempt before the client gives up
    retry: Retry
    route: str = "chat"  # which API route it is sent to (scenario `routes`)
    pooling: bool = False  # prefill-only (embeddings): no output, done when its prompt is

    @property
    def class_name(self) -> str:
        return CLASSES[self.priority]


def unit_hash(seed: int, index: int, salt: int = 0) -> float:
    """A deterministic uniform draw in [0, 1) from three integers (splitmix64), for
    per-attempt jitter that does not depend on the order in which an arm asks for it."""
    z = seed * 0x9E3779B97F4A7C15 + index * 0xBF58476D1CE4E5B9 + salt * 0x94D049BB133111EB
    z &= _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    z ^= z >> 31
    return (z >> 11) / float(1 << 53)


def draw_length(dist: _LengthDist, rng: random.Random) -> int:
    if dist.dist == "fixed":
        v = dist.value or 1
    elif dist.dist == "uniform":
        v = rng.randint(dist.low or 1, dist.high or 1)
    else:
        v = round((dist.median or 1.0) * math.exp(rng.gauss(0.0, dist.sigma)))
    v = max(dist.min, v)
    if dist.max is not None:
        v = min(dist.max, v)
    return v


class _SmoothRoundRobin:
    """Nginx's smooth weighted round robin: exact shares, evenly interleaved."""

    def __init__(self, weights: dict[str, float]) -> None:
        self._weights = {k: w for k, w in weights.items() if w > 0}
        self._current = dict.fromkeys(self._weights, 0.0)
        self._total = sum(self._weights.values())

    def next(self) -> str:
        for k, w in self._weights.items():
            self._current[k] += w
        best = max(self._current, key=self._current.__getitem__)
        self._current[best] -= self._total
        return best


def _weighted_choice(weights: dict[str, float], rng: random.Random) -> str:
    return pick_by_weight(weights, rng.random())


def pick_by_weight(weights: dict[str, float], u: float) -> str:
    """The key whose share of the weights' total holds `u` in [0, 1), in their order."""
    total = sum(weights.values())
    x = u * total
    last = ""
    for k, w in weights.items():
        if w <= 0:
            continue
        last = k
        x -= w
        if x < 0:
            return k
    return last


def arrival_times(phase: ResolvedPhase, rate_rps: float, rng: random.Random) -> list[float]:
    """Arrival times within [phase.start, phase.end) at `rate_rps`."""
    if rate_rps <= 0:
        return []
    times: list[float] = []
    if phase.process == "uniform":
        n = round((phase.end - phase.start) * rate_rps)
        gap = 1.0 / rate_rps
        return [phase.start + i * gap for i in range(n)]
    t = phase.start
    while True:
        t += rng.expovariate(rate_rps)
        if t >= phase.end:
            return times
        times.append(t)


def generate(
    scenario: Scenario,
    rates_rps: list[float],
    *,
    seed: int,
    max_model_len: int,
) -> list[ClientRequest]:
    """The scenario's requests in arrival order. `rates_rps[i]` is phase i's offered rate in
    requests per second (all backends together); prompts are cut so that prompt +
    max_tokens fits `max_model_len` (a request the engine would refuse is no load test)."""
    if len(rates_rps) != len(scenario.phases):
        raise ValueError("need one rate per phase")
    rng_arrivals = random.Random(f"{seed}/arrivals")
    rng_class = random.Random(f"{seed}/class")
    rng_lengths = random.Random(f"{seed}/lengths")
    rng_clients = random.Random(f"{seed}/clients")
    # A draw of its own, and none at all with one route: the workloads of scenarios
    # without `routes` stay as they were.
    rng_route = random.Random(f"{seed}/route")
    routes = scenario.spec.routes
    route_shares = {name: r.share for name, r in routes.items()}
    tenants_by_class: dict[int, list[TenantSpec]] = {}
    for t in scenario.spec.tenants:
        tenants_by_class.setdefault(t.priority, []).append(t)
    tenant_by_name = {t.name: t for t in scenario.spec.tenants}

    out: list[ClientRequest] = []
    for phase, rate in zip(scenario.phases, rates_rps, strict=True):
        exact = phase.process == "uniform"
        class_rr = _SmoothRoundRobin(phase.mix)
        tenant_rr = {
            p: _SmoothRoundRobin({t.name: t.share for t in ts})
            for p, ts in tenants_by_class.items()
        }
        max_tokens = min(phase.max_tokens, max_model_len - 1)
        for at in arrival_times(phase, rate, rng_arrivals):
            cls = class_rr.next() if exact else _weighted_choice(phase.mix, rng_class)
            priority = CLASSES.index(cls)
            ts = tenants_by_class[priority]
            if len(ts) == 1:
                tenant = ts[0]
            elif exact:
                tenant = tenant_by_name[tenant_rr[priority].next()]
            else:
                tenant = tenant_by_name[_weighted_choice({t.name: t.share for t in ts}, rng_class)]
            route = next(iter(routes)) if len(routes) == 1 else None
            if route is None:
                route = _weighted_choice(route_shares, rng_route)
            how = routes[route]
            if how.pooling:
                # prefill-only: its prompt is all it costs; it holds no output room
                dist = how.prompt or phase.prompt
                prompt = min(draw_length(dist, rng_route), max_model_len)
                output, req_max = 1, 1
            else:
                dist = how.prompt or phase.prompt
                rng = rng_lengths if how.prompt is None else rng_route
                prompt = min(draw_length(dist, rng), max_model_len - max_tokens)
                output = min(draw_length(phase.output, rng_lengths), max_tokens)
                req_max = max_tokens
            behaviour: ClientBehaviour = phase.clients[cls]
            cancel_after = None
            if behaviour.cancel is not None and rng_clients.random() < behaviour.cancel.probability:
                cancel_after = behaviour.cancel.after_tokens
            index = len(out)
            out.append(
                ClientRequest(
                    index=index,
                    request_id=f"r{index}",
                    arrival=at,
                    phase=phase.index,
                    priority=priority,
                    tenant=tenant.name,
                    weight=tenant.weight,
                    prompt_tokens=max(1, prompt),
                    max_tokens=req_max,
                    output_tokens=max(1, output),
                    cancel_after=None if how.pooling else cancel_after,
                    deadline=behaviour.deadline,
                    retry=behaviour.retry,
                    route=route,
                    pooling=how.pooling,
                )
            )
    out.sort(key=lambda r: r.arrival)
    for i, r in enumerate(out):  # ids in arrival order across phases
        r.index = i
        r.request_id = f"r{i}"
    return out


def retry_delay(
    req: ClientRequest,
    attempt: int,
    retry_after_s: float | None,
    seed: int,
    retry: Retry | None = None,
    window_s: float = 0.0,
) -> float | None:
    """How long the client waits before attempt `attempt + 1` after attempt `attempt`
    (0-based) was refused with the given Retry-After (None: no advice); None when the
    client will not wait that long (a Retry-After above `maxRetryAfter`). `retry`
    replaces the request's own retry behaviour (a peer arm's clients). A client that
    jitters (spread > 0) and was given a return window (X-Sluice-Retry-Window-Ms) comes
    back uniformly within it after the Retry-After, as the SDK does."""
    r = req.retry if retry is None else retry
    u = unit_hash(seed, req.index, attempt + 1)
    if r.follow_retry_after and retry_after_s is not None and retry_after_s > 0:
        if r.max_retry_after is not None and retry_after_s > r.max_retry_after:
            return None
        if window_s > 0 and r.spread > 0:
            return retry_after_s + window_s * u
        return retry_after_s * (1.0 + r.spread * u)
    delay = r.backoff * (2.0**attempt)
    if r.backoff_max is not None:
        delay = min(delay, r.backoff_max)
    jitter = r.spread if r.backoff_jitter is None else r.backoff_jitter
    return delay * (1.0 + jitter * u)
