"""Benchmark scenarios: what the backends are, what the clients send and how they behave,
and what counts as success. Scenarios are YAML files (package data in
`sluice/bench/scenarios/`, or any path); `load_scenario(name_or_path)` validates one
strictly (unknown keys are errors, each reported with its field path).

Phases are piecewise-constant: a phase that leaves out `mix`, `prompt`, `output`,
`maxTokens` or `process` inherits them from the phase before it, and its `clients`
entries replace the previous phase's entries class by class. docs/bench.md describes
every field."""

from __future__ import annotations

import dataclasses
import itertools
import math
from importlib import resources
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError, model_validator
from pydantic.alias_generators import to_camel

from sluice.bench.trace import Trace, TraceError, read_trace, resolve_trace_path
from sluice.config import CLASS_NAMES, DEFAULT_OBJECTIVES, Duration, Objective
from sluice.sim.profiles import Profile, get_profile

ClassName = Literal["P0", "P1", "P2"]
CLASSES = ("P0", "P1", "P2")
# a trace's classes when it names none: burst's 20 % P0 / 40 % P1 / 40 % P2
BURST_MIX: dict[ClassName, float] = {"P0": 0.2, "P1": 0.4, "P2": 0.4}


class ScenarioError(Exception):
    """A scenario that cannot be used; `errors` lists 'field.path: reason' lines."""

    def __init__(self, source: str, errors: list[str]) -> None:
        super().__init__(f"{source}: " + "; ".join(errors))
        self.source = source
        self.errors = errors


class _Model(BaseModel):
    model_config = ConfigDict(
        alias_generator=to_camel, populate_by_name=True, extra="forbid", frozen=True
    )


def _bare_int_is_fixed(value: Any) -> Any:
    if isinstance(value, int) and not isinstance(value, bool):
        return {"dist": "fixed", "value": value}
    return value


class _LengthDist(_Model):
    """A token-count distribution. `fixed` (value), `uniform` (low..high inclusive),
    `lognormal` (median, sigma: long-tailed, chat-like); draws are clamped to [min, max]."""

    dist: Literal["fixed", "uniform", "lognormal"] = "fixed"
    value: int | None = Field(default=None, ge=1)
    low: int | None = Field(default=None, ge=1)
    high: int | None = Field(default=None, ge=1)
    median: float | None = Field(default=None, gt=0)
    sigma: float = Field(default=0.8, ge=0)
    min: int = Field(default=1, ge=1)
    max: int | None = Field(default=None, ge=1)

    @model_validator(mode="after")
    def _complete(self) -> _LengthDist:
        if self.dist == "fixed" and self.value is None:
            raise ValueError("a fixed distribution needs `value`")
        if self.dist == "uniform" and (
            self.low is None or self.high is None or self.low > self.high
        ):
            raise ValueError("a uniform distribution needs `low` <= `high`")
        if self.dist == "lognormal" and self.median is None:
            raise ValueError("a lognormal distribution needs `median`")
        if self.max is not None and self.max < self.min:
            raise ValueError("`max` must be at least `min`")
        return self

    @property
    def mean_estimate(self) -> float:
        """The mean before clamping (for documentation and sanity checks only)."""
        if self.dist == "fixed":
            return float(self.value or 1)
        if self.dist == "uniform":
            return ((self.low or 1) + (self.high or 1)) / 2
        return (self.median or 1.0) * math.exp(self.sigma**2 / 2)


LengthDist = Annotated[_LengthDist, BeforeValidator(_bare_int_is_fixed)]


class Cancel(_Model):
    """Clients that read `afterTokens` tokens and then go away (share `probability`)."""

    probability: float = Field(ge=0, le=1)
    after_tokens: int = Field(ge=1)


class Retry(_Model):
    """What a refused client does. It retries 429s (and a failed backend connection; its own
    timeouts too with `onTimeout`) up to `maxAttempts` attempts in all.
    `followRetryAfter`: wait what the 429's Retry-After says (times 1 + spread * U(0,1),
    the SDK's jitter; spread 0 = everyone comes back exactly on time), else an exponential
    back-off of `backoff` * 2**n (with the same spread)."""

    max_attempts: int = Field(default=1, ge=1)
    follow_retry_after: bool = True
    # Also retry when the client's own deadline passed (the OpenAI SDK retries timeouts).
    on_timeout: bool = False
    spread: float = Field(default=0.5, ge=0)
    backoff: Duration = Field(default=1.0, ge=0)
    # A Retry-After above this is not waited for: the client gives up (the OpenAI SDK's
    # MAX_RETRY_AFTER_DELAY). None = any Retry-After is followed.
    max_retry_after: Duration | None = Field(default=None, gt=0)
    # The back-off is capped here (the OpenAI SDK's MAX_RETRY_DELAY); None = no cap.
    backoff_max: Duration | None = Field(default=None, gt=0)
    # The back-off's jitter: x (1 + backoffJitter * U); None = `spread`. The OpenAI SDK
    # takes up to a quarter off (-0.25).
    backoff_jitter: float | None = Field(default=None, ge=-1)


class ClientBehaviour(_Model):
    # The client gives up (disconnects) this long after it sent an attempt, finished or
    # not; it also tells the gateway (X-Request-Timeout). None = it waits forever.
    deadline: Duration | None = None
    cancel: Cancel | None = None
    retry: Retry = Retry()


# What a request must achieve to count as a success (from its first attempt): the
# policy's own per-class objectives (`queues[].slo`), so the bench judges a run by what the
# gateway it runs aims at. A scenario's `slos` replace the defaults class by class, and the
# arms' policies carry them (bench.arms).
Slo = Objective
DEFAULT_SLOS: dict[str, Objective] = {CLASS_NAMES[p]: o for p, o in DEFAULT_OBJECTIVES.items()}


class TenantSpec(_Model):
    name: str = Field(min_length=1)
    priority: int = Field(ge=0, le=2)
    weight: float = Field(default=1.0, gt=0)
    # Its part of its class's traffic, relative to the other tenants of the class.
    share: float = Field(default=1.0, gt=0)
    # Its quotas in the gateway arms' policies (0: none), as the policy's tenants have them
    tokens_per_minute: int = Field(default=0, ge=0)
    requests_per_minute: int = Field(default=0, ge=0)
    max_concurrency: int = Field(default=0, ge=0)


DEFAULT_TENANTS: tuple[TenantSpec, ...] = (
    TenantSpec(name="chat-app", priority=0),
    TenantSpec(name="agents", priority=1),
    TenantSpec(name="batch-etl", priority=2),
)


class EpisodesSpec(_Model):
    """The host's busy and quiet spells, by their mean lengths (`bench.noise.Episodes`).
    (Not `on`/`off`: YAML reads those keys as booleans.)"""

    busy: Duration = Field(gt=0)
    quiet: Duration = Field(gt=0)


class NoiseSpec(_Model):
    """A lognormal factor by its median and 99th percentile (`bench.noise.ComputeNoise`),
    on every step, or only in the host's busy spells (`episodes`)."""

    p50: float = Field(ge=1)
    p99: float = Field(ge=1)
    episodes: EpisodesSpec | None = None

    @model_validator(mode="after")
    def _ordered(self) -> NoiseSpec:
        if self.p99 < self.p50:
            raise ValueError("p99 must be at least p50")
        return self


class BackendSpec(_Model):
    count: int = Field(default=2, ge=1, le=1024)
    profile: str = "h100-llama3-8b"
    # Profile fields to replace, e.g. {numGpuBlocks: 4000} or {num_gpu_blocks: 4000}.
    overrides: dict[str, float] = Field(default_factory=dict)
    # The engines run this many times faster than the profile (real mode: < 1 slows the
    # simulators down so that the machine's CPU keeps up).
    speed: float = Field(default=1.0, gt=0)
    # The host's other work (`bench.noise.ComputeNoise`): each step's work, its fixed
    # overhead aside, stretched by a lognormal factor of this median and 99th percentile.
    compute_noise: NoiseSpec | None = None

    def build_profile(self) -> Profile:
        base = get_profile(self.profile)
        fields = {f.name: f.type for f in dataclasses.fields(base)}
        changes: dict[str, Any] = {}
        for key, value in self.overrides.items():
            name = _snake(key)
            if name not in fields or name in ("name", "description"):
                raise ValueError(f"unknown profile field {key!r}")
            current = getattr(base, name)
            changes[name] = int(value) if isinstance(current, int) else float(value)
        return dataclasses.replace(base, **changes).scaled(self.speed)


def _snake(name: str) -> str:
    return "".join("_" + c.lower() if c.isupper() else c for c in name)


class Phase(_Model):
    name: str = Field(min_length=1)
    duration: Duration = Field(gt=0)
    # Offered load: `rate` in multiples of the backends' capacity for this phase's request
    # mix (docs/bench.md, "Capacity"), or `rateRps` requests per second in all.
    rate: float | None = Field(default=None, ge=0)
    rate_rps: float | None = Field(default=None, ge=0)
    process: Literal["poisson", "uniform"] | None = None
    mix: dict[ClassName, float] | None = None
    prompt: LengthDist | None = None
    output: LengthDist | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    clients: dict[ClassName, ClientBehaviour] | None = None

    @model_validator(mode="after")
    def _one_rate(self) -> Phase:
        if (self.rate is None) == (self.rate_rps is None):
            raise ValueError("give exactly one of `rate` (x capacity) and `rateRps`")
        if self.mix is not None and (
            any(v < 0 for v in self.mix.values()) or sum(self.mix.values()) <= 0
        ):
            raise ValueError("`mix` shares must be >= 0 with a positive sum")
        return self


class RouteMix(_Model):
    """One route's share of the requests (e.g. chat, responses, messages, embeddings), and
    how its requests differ: `pooling` ones (embeddings, rerank, score) are prefill-only,
    generate nothing and finish in the step that computes their prompt; `prompt`, their
    own prompt lengths (else the phase's)."""

    share: float = Field(gt=0)
    pooling: bool = False
    prompt: LengthDist | None = None


def _one_route() -> dict[str, RouteMix]:
    return {"chat": RouteMix(share=1.0)}


class BackendEvent(_Model):
    """A backend dies (`fail`: its in-flight requests are cut, connections refused) or
    comes back (`recover`: empty, like a restarted server)."""

    at: Duration
    action: Literal["fail", "recover"]
    backend: int = Field(ge=0)


class TraceSpec(_Model):
    """Replay a request trace (docs/bench.md, "Traces") instead of drawing from phases."""

    # A trace file (Azure LLM inference trace or BurstGPT CSV, optionally .gz), relative to
    # the scenario file; or the name of a trace shipped with Sluice (`azure-conv-2023`).
    path: str = Field(min_length=1)
    start: Duration = Field(default=0.0, ge=0)  # the slice: trace seconds from its start
    duration: Duration | None = Field(default=None, gt=0)  # None: to the trace's end
    # Scale time so that the busiest `peakWindow` of trace time (sliding) offers `peak` x
    # the backends' capacity for the trace's mix; None: `speedup` (default 1: trace time).
    peak: float | None = Field(default=None, gt=0)
    peak_window: Duration = Field(default=60.0, gt=0)
    speedup: float | None = Field(default=None, gt=0)
    # Each request's class: a share per class by a stable hash of its line in the file...
    classes: dict[ClassName, float] = Field(default_factory=lambda: dict(BURST_MIX))
    # ... or the value of a column (BurstGPT's `Model`, `Log Type`): value -> class.
    class_column: str | None = None
    class_values: dict[str, ClassName] = Field(default_factory=dict)
    # What each request declares as max_tokens: its own output length (forced, as the
    # replay sends max_tokens = output with ignore_eos) when None.
    max_tokens: int | None = Field(default=None, ge=1)

    @model_validator(mode="after")
    def _consistent(self) -> TraceSpec:
        if self.peak is not None and self.speedup is not None:
            raise ValueError("give at most one of `peak` and `speedup`")
        if self.class_column is None:
            if any(v < 0 for v in self.classes.values()) or sum(self.classes.values()) <= 0:
                raise ValueError("`classes` shares must be >= 0 with a positive sum")
        elif not self.class_values:
            raise ValueError("`classColumn` needs `classValues` (column value -> class)")
        return self


class LagSpec(_Model):
    """A lognormal delay by its median and 99th percentile (`bench.noise.Jitter`)."""

    p50: Duration = Field(gt=0)
    p99: Duration = Field(gt=0)


class RollingRestartSpec(_Model):
    """Every replica replaced once, one after another (`bench.fleet.RollingRestart`)."""

    at: Duration = Field(ge=0)
    every: Duration = Field(default=5.0, ge=0)
    propagation: Duration = Field(default=1.0, ge=0)
    pre_stop: Duration = Field(default=10.0, ge=0)
    grace: Duration = Field(default=30.0, ge=0)  # the policy's server.shutdownGrace


class FleetSweepSpec(_Model):
    """What `--fleet-sweep` runs (`bench.fleet_sweep`)."""

    replicas: tuple[int, ...] = (1, 2, 4, 8, 16)
    scrape_intervals: tuple[Duration, ...] = (0.1, 0.25, 0.5, 1.0, 2.0)


class OutageSpec(_Model):
    """The quota store cannot be reached from `at` to `back` (`bench.quota_store.Outage`)."""

    at: Duration = Field(ge=0)
    back: Duration = Field(gt=0)
    failure: Literal["refused", "timeout"] = "refused"  # how a call fails meanwhile
    wiped: bool = False  # it comes back empty (a restart without persistence)

    @model_validator(mode="after")
    def _ordered(self) -> OutageSpec:
        if self.back <= self.at:
            raise ValueError("`back` must be after `at`")
        return self


class QuotaStoreSection(_Model):
    """Tenant quotas shared by the replicas through one store, Redis (`bench.fleet_quotas`)."""

    round_trip: LagSpec = LagSpec(p50=0.001, p99=0.001)  # each call's, lognormal
    outages: tuple[OutageSpec, ...] = ()

    @model_validator(mode="after")
    def _apart(self) -> QuotaStoreSection:
        if self.round_trip.p99 < self.round_trip.p50:
            raise ValueError("roundTrip: p99 must be at least p50")
        spans = sorted((o.at, o.back) for o in self.outages)
        if any(b[0] < a[1] for a, b in itertools.pairwise(spans)):
            raise ValueError("outages must not overlap")
        return self


class FleetSection(_Model):
    """The gateway arms as a fleet of replicas (`bench.fleet`; docs/bench.md "Fleets")."""

    replicas: int = Field(default=1, ge=1, le=256)
    balance: Literal["round-robin", "random", "least-connections"] = "round-robin"
    scrape_interval: Duration | None = Field(default=None, gt=0)  # None: the default 250 ms
    scrape_lag: LagSpec | None = None  # each scrape's round trip
    clock_skew: Duration = Field(default=0.0, ge=0)
    # each replica knows how many are live (as Redis's count of the processes tells them)
    known_peers: bool = False
    rolling_restart: RollingRestartSpec | None = None
    sweep: FleetSweepSpec = FleetSweepSpec()
    # tenant quotas shared through Redis (lost and back); None: each replica its own
    quota_store: QuotaStoreSection | None = None


class RealMode(_Model):
    """How the scenario shrinks to run against real processes on this machine."""

    backends: BackendSpec = BackendSpec(count=2, profile="tiny", speed=0.25)
    length_scale: float = Field(default=0.25, gt=0)  # prompt and output lengths x this
    duration_scale: float = Field(default=1.0, gt=0)  # phase durations x this
    max_rps: float = Field(default=60.0, gt=0)  # refuse to offer more than this


class OracleSpec(_Model):
    """The oracle's sweep (bench.runner.oracle_sweep): caps at these multiples of each
    phase's sweet spot, then up to `extend` rounds of refinement around the best."""

    factors: tuple[float, ...] = Field(default=(0.5, 0.7, 0.85, 1.0, 1.15, 1.3, 1.6), min_length=1)
    extend: int = Field(default=2, ge=0, le=5)

    @model_validator(mode="after")
    def _positive(self) -> OracleSpec:
        if any(f <= 0 for f in self.factors):
            raise ValueError("factors must be more than zero")
        return self


class ScenarioSpec(_Model):
    name: str = Field(min_length=1)
    description: str = ""
    seed: int = 1
    backends: BackendSpec = BackendSpec()
    tenants: tuple[TenantSpec, ...] = DEFAULT_TENANTS
    slos: dict[ClassName, Slo] = Field(default_factory=dict)
    clients: dict[ClassName, ClientBehaviour] = Field(default_factory=dict)
    phases: tuple[Phase, ...] = ()
    trace: TraceSpec | None = None  # replaces `phases`
    events: tuple[BackendEvent, ...] = ()
    # The routes the requests go to, by share; one route (chat) unless told otherwise.
    routes: dict[str, RouteMix] = Field(default_factory=_one_route, min_length=1)
    # After the last arrival, let requests finish for at most this long.
    drain: Duration = Field(default=60.0, ge=0)
    # The gateway arms' queues hold this many times the default maxQueueSize (200 / 500 /
    # 1,000, config.DEFAULT_QUEUES, sized for the two backends most scenarios run): a
    # fleet's queues should hold as many seconds of its capacity as those of two backends'.
    queue_scale: float = Field(default=1.0, gt=0)
    real: RealMode = RealMode()
    oracle: OracleSpec = OracleSpec()
    fleet: FleetSection = FleetSection()
    # Arms `sluice bench` runs when --arms is not given.
    arms: tuple[str, ...] = ("direct", "static", "fifo", "sluice", "oracle")

    @model_validator(mode="after")
    def _consistent(self) -> ScenarioSpec:
        if (self.trace is None) == (not self.phases):
            raise ValueError("give either `phases` or a `trace` to replay")
        if self.trace is not None:
            if self.events:
                raise ValueError("events: not with a trace (they are placed in phase time)")
            if self.routes != _one_route():
                # the replay sends every request of the trace to chat (replay.plan_trace)
                raise ValueError("routes: not with a trace (its requests are all chat)")
            self.backends.build_profile()
            return self
        first = self.phases[0]
        missing = [
            f for f in ("mix", "prompt", "output", "max_tokens") if getattr(first, f) is None
        ]
        if missing:
            raise ValueError("the first phase must set " + ", ".join(to_camel(m) for m in missing))
        classes = {t.priority for t in self.tenants}
        for p in self.phases:
            for cls, share in (p.mix or {}).items():
                if share > 0 and int(cls[1]) not in classes:
                    raise ValueError(f"phase {p.name!r}: no tenant of class {cls}")
        for e in self.events:
            if e.backend >= self.backends.count:
                raise ValueError(f"events: backend {e.backend} out of range")
        self.backends.build_profile()  # raises on a bad profile or override
        return self


@dataclasses.dataclass(frozen=True, slots=True)
class ResolvedPhase:
    """A phase with everything inherited filled in; times are absolute (from 0)."""

    index: int
    name: str
    start: float
    end: float
    rate: float | None
    rate_rps: float | None
    process: str
    mix: dict[str, float]
    prompt: _LengthDist
    output: _LengthDist
    max_tokens: int
    clients: dict[str, ClientBehaviour]


@dataclasses.dataclass(frozen=True, slots=True)
class Scenario:
    spec: ScenarioSpec
    phases: tuple[ResolvedPhase, ...]
    slos: dict[str, Slo]
    source: str
    # The trace slice to replay (`spec.trace`), in trace time; `bench.replay` scales it.
    trace: Trace | None = None
    # Lengths of the trace's requests are multiplied by this (real mode's `lengthScale`).
    trace_length_scale: float = 1.0

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def duration(self) -> float:
        return self.phases[-1].end

    def phase_at(self, t: float) -> ResolvedPhase:
        for p in self.phases:
            if t < p.end:
                return p
        return self.phases[-1]

    def for_real_mode(self) -> Scenario:
        """The scenario shrunk for real processes: the `real` section's backends, lengths
        and durations (rates stay multiples of the new backends' capacity)."""
        real = self.spec.real
        k = real.length_scale

        def scale(d: _LengthDist) -> _LengthDist:
            def s(v: int | None) -> int | None:
                return None if v is None else max(1, round(v * k))

            return d.model_copy(
                update={
                    "value": s(d.value),
                    "low": s(d.low),
                    "high": s(d.high),
                    "median": None if d.median is None else max(1.0, d.median * k),
                    "min": max(1, round(d.min * k)),
                    "max": s(d.max),
                }
            )

        phases = []
        t = 0.0
        for p in self.phases:
            length = (p.end - p.start) * real.duration_scale
            phases.append(
                dataclasses.replace(
                    p,
                    start=t,
                    end=t + length,
                    prompt=scale(p.prompt),
                    output=scale(p.output),
                    max_tokens=max(1, round(p.max_tokens * k)),
                )
            )
            t += length
        events = tuple(
            e.model_copy(update={"at": e.at * real.duration_scale})
            for e in self.spec.events
            if e.backend < real.backends.count
        )
        # A trace's slice gets shorter, but its time runs as fast: its drain stays.
        drain = self.spec.drain * (1.0 if self.trace is not None else real.duration_scale)
        spec = self.spec.model_copy(
            update={"backends": real.backends, "events": events, "drain": drain}
        )
        trace = self.trace
        if trace is not None:
            # the first part of the slice (durations x durationScale), lengths x lengthScale
            trace = trace.slice(0.0, max(1e-9, trace.duration * real.duration_scale) + 1e-9)
        return Scenario(
            spec=spec,
            phases=tuple(phases),
            slos=self.slos,
            source=self.source,
            trace=trace,
            trace_length_scale=self.trace_length_scale * k,
        )


def _resolve_trace(spec: ScenarioSpec, source: str, folder: Path | None) -> Scenario:
    """A trace scenario: its slice, read now, and one phase covering it (in trace time;
    `bench.replay` scales it once the backends' capacity is known)."""
    ts = spec.trace
    assert ts is not None
    path = resolve_trace_path(ts.path, folder)
    trace = read_trace(path, column=ts.class_column).slice(ts.start, ts.duration)
    if not trace.requests:
        raise TraceError(str(path), None, f"no request in the slice from {ts.start:g} s")
    if ts.class_column is not None:
        for r in trace.requests:
            if r.column not in ts.class_values:
                raise TraceError(
                    str(path), r.line, f"{ts.class_column} {r.column!r} has no class in classValues"
                )
    n = len(trace.requests)
    mean_prompt = max(1, round(sum(r.prompt_tokens for r in trace.requests) / n))
    mean_output = max(1, round(sum(r.output_tokens for r in trace.requests) / n))
    shares = ts.classes if ts.class_column is None else {}
    if ts.class_column is not None:
        for r in trace.requests:
            c = ts.class_values[r.column]  # type: ignore[index]
            shares[c] = shares.get(c, 0.0) + 1.0
    total = sum(shares.values())
    end = max(trace.duration, 1e-3)
    phase = ResolvedPhase(
        index=0,
        name="trace",
        start=0.0,
        end=end,
        rate=ts.peak,
        rate_rps=n / end,
        process="trace",
        mix={c: shares.get(c, 0.0) / total for c in CLASSES},  # type: ignore[call-overload]
        prompt=_LengthDist(dist="fixed", value=mean_prompt),
        output=_LengthDist(dist="fixed", value=mean_output),
        max_tokens=ts.max_tokens or max(r.output_tokens for r in trace.requests),
        clients={c: spec.clients.get(c, ClientBehaviour()) for c in CLASSES},  # type: ignore[call-overload]
    )
    slos = {c: spec.slos.get(c, DEFAULT_SLOS[c]) for c in CLASSES}  # type: ignore[call-overload]
    return Scenario(spec=spec, phases=(phase,), slos=slos, source=source, trace=trace)


def _resolve(spec: ScenarioSpec, source: str, folder: Path | None = None) -> Scenario:
    if spec.trace is not None:
        return _resolve_trace(spec, source, folder)
    phases: list[ResolvedPhase] = []
    t = 0.0
    prev: ResolvedPhase | None = None
    named: dict[str, ClientBehaviour] = {str(c): b for c, b in spec.clients.items()}
    base_clients = {c: named.get(c, ClientBehaviour()) for c in CLASSES}
    for i, p in enumerate(spec.phases):
        clients = dict(prev.clients if prev else base_clients)
        clients.update({str(c): b for c, b in (p.clients or {}).items()})
        mix = p.mix if p.mix is not None else (prev.mix if prev else {})
        total = sum(mix.values())
        resolved = ResolvedPhase(
            index=i,
            name=p.name,
            start=t,
            end=t + p.duration,
            rate=p.rate,
            rate_rps=p.rate_rps,
            process=p.process or (prev.process if prev else "poisson"),
            mix={c: mix.get(c, 0.0) / total for c in CLASSES},  # type: ignore[call-overload]
            prompt=p.prompt or prev.prompt,  # type: ignore[union-attr]
            output=p.output or prev.output,  # type: ignore[union-attr]
            max_tokens=p.max_tokens or prev.max_tokens,  # type: ignore[union-attr]
            clients=clients,
        )
        phases.append(resolved)
        prev = resolved
        t = resolved.end
    slos = {c: spec.slos.get(c, DEFAULT_SLOS[c]) for c in CLASSES}  # type: ignore[call-overload]
    return Scenario(spec=spec, phases=tuple(phases), slos=slos, source=source)


def _format_errors(exc: ValidationError) -> list[str]:
    lines = []
    for err in exc.errors():
        path = ".".join(str(p) for p in err["loc"]) or "(top level)"
        lines.append(f"{path}: {err['msg'].removeprefix('Value error, ')}")
    return lines


def parse_scenario(
    text: str,
    source: str = "<scenario>",
    *,
    folder: Path | None = None,
    overrides: dict[str, Any] | None = None,
) -> Scenario:
    """A scenario from YAML text. `folder`: where relative trace paths are looked for.
    `overrides`: top-level keys replacing the file's (the command line's `--trace`...)."""
    try:
        doc = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ScenarioError(source, [f"(file): not valid YAML ({exc})"]) from exc
    if not isinstance(doc, dict):
        raise ScenarioError(source, ["(top level): expected a mapping"])
    for key, value in (overrides or {}).items():
        if isinstance(value, dict) and isinstance(doc.get(key), dict):
            doc[key] = {**doc[key], **value}
        else:
            doc[key] = value
        if key == "trace":
            doc.pop("phases", None)
            doc.pop("events", None)
    try:
        spec = ScenarioSpec.model_validate(doc)
    except ValidationError as exc:
        raise ScenarioError(source, _format_errors(exc)) from exc
    try:
        return _resolve(spec, source, folder)
    except TraceError as exc:
        raise ScenarioError(source, [f"trace.path: {exc}"]) from exc


def builtin_scenarios() -> list[str]:
    folder = resources.files("sluice.bench").joinpath("scenarios")
    return sorted(
        p.name.removesuffix(".yaml") for p in folder.iterdir() if p.name.endswith(".yaml")
    )


def load_scenario(name_or_path: str, overrides: dict[str, Any] | None = None) -> Scenario:
    """A built-in scenario by name (`burst`), or a YAML file by path; `overrides` replace
    top-level keys (a `trace` mapping is merged into the file's)."""
    path = Path(name_or_path)
    if path.suffix in (".yaml", ".yml") or path.exists():
        try:
            text = path.read_text(encoding="utf-8")
        except OSError as exc:
            raise ScenarioError(str(path), [f"(file): cannot read ({exc.strerror})"]) from exc
        return parse_scenario(text, str(path), folder=path.parent, overrides=overrides)
    resource = resources.files("sluice.bench").joinpath(f"scenarios/{name_or_path}.yaml")
    if not resource.is_file():
        known = ", ".join(builtin_scenarios())
        raise ScenarioError(name_or_path, [f"unknown scenario; built-in scenarios: {known}"])
    return parse_scenario(
        resource.read_text(encoding="utf-8"),
        f"scenarios/{name_or_path}.yaml",
        overrides=overrides,
    )
