"""The discrete-event harness: the real core (Controller) against simulated engines and an
open-loop workload, in virtual time. Minutes of overload run in seconds, deterministically.

One `run_arm` call runs one arm (`ArmSpec`) of a scenario on fresh engines. Events, in a
heap ordered by (time, sequence): client attempts arriving, engine steps ending, the
controller's timer (the `wake_at` of its last `step`), scrapes every `scrape_interval` s turning
each engine's state into `BackendMetrics`, health probes, client deadlines, retries,
phase changes (the oracle's per-phase cap) and backend failures. Before each controller
call the FakeClock is set to the event's time. Nothing here is stochastic: the workload
carries every random draw (lengths, cancels) and retry jitter is a hash of the request.

The engines follow their own timeline: when an engine is idle and gets a request, a step
starts at once; when a step ends, its tokens are delivered at its end and the next step
starts then if there is work. Metrics a scrape reads are those of the last completed step
(vLLM publishes its scheduler stats after each step).

The `direct` arm has no controller: each attempt goes round robin to the engines, which
queue everything themselves (what clients talking straight to vLLM get).

Gateway replicas (`ArmSpec.replicas` > 1): that many Controllers, each with its own
limiters and queues, in front of the same engines, as several `sluice serve` behind a
Service. `ArmSpec.fleet` (`bench.fleet`) says how: how the Service spreads client
attempts over the ready replicas (round robin by default), each replica's clock (its own
origin), its scrape rounds (a replica's round k starts k/replicas of an interval after
replica 0's first; with a scrape lag the state read is applied when the round's slowest
answer is in, and the next round starts an interval after that), a rolling restart
(replicas replaced one by one, each old one draining as `sluice serve` does). Each
replica probes health on its own. The series' `limit` of a backend is the sum
of the live replicas' limits, `pressure` their mean; the TTFT and TPOT p95 of a scrape go
to the first replica only (no limiter reads them). With a quota store (`FleetSpec.
quota_store`) the replicas share the tenants' quotas through a modelled Redis
(`bench.fleet_quotas`): an attempt of a tenant with a quota is checked there before its
`arrive`, the answer coming back as a `_CALL` event.

With an `engine` (sluice.bench.engine_view), each backend presents that engine's surface:
scrapes read its metrics pages through the gateway's adapter for that engine, and the
engine's refusals (TGI's 429) are answered to the gateway as overloads.
"""

from __future__ import annotations

import heapq
import math
import random
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from sluice.bench.cuts import add_cuts_sample, cuts_so_far
from sluice.bench.engine_view import EngineView
from sluice.bench.fleet import Balancer, FleetSpec, ReplicaClock
from sluice.bench.fleet_quotas import FleetQuotas
from sluice.bench.noise import ComputeNoise, Episodes, Jitter
from sluice.bench.returns import CANNOT_SERVE_IN_TIME, note_refusal
from sluice.bench.scenario import CLASSES, Retry, Scenario
from sluice.bench.workload import ClientRequest, retry_delay
from sluice.config import Policy
from sluice.core.clock import FakeClock
from sluice.core.controller import Controller
from sluice.core.snapshot import ControllerSnapshot
from sluice.core.types import BackendMetrics, Outcome, RequestInfo
from sluice.sim.engine import Engine, EngineRequest, EngineSnapshot, StepResult
from sluice.sim.profiles import Profile

MODEL = "sim"
SCRAPE_INTERVAL_S = 0.25
HEALTH_INTERVAL_S = 1.0
UNHEALTHY_AFTER = 2  # failed probes in a row (the gateway's BackendPool does the same)
# A queueing episode whose limit is not cut within this long counts as "no cut".
REACTION_WINDOW_S = 5.0
# A backend that has not queued for this long starts a new episode when it queues again.
EPISODE_GAP_S = 1.0
# While an episode is open, limits are read at most this often (the measure's resolution).
CUT_CHECK_EVERY_S = 0.005

# event kinds
_ARRIVE = 0
_STEP_END = 1
_WAKEUP = 2
_SCRAPE = 3
_GIVE_UP = 4
_BACKEND_EVENT = 5
_HEALTH = 6
_PHASE = 7
_DELIVER = 8  # a step's tokens reach the gateway (with latency noise: `bench.noise`)
_SCRAPED = 9  # a replica's scrape round is in (with a scrape lag: `bench.fleet`)
_FLEET = 10  # a replica starts, leaves the Service, gets SIGTERM or is cut off
_CALL = 11  # a call of the shared quotas (`bench.fleet_quotas`) runs: payload(t)

# request outcomes
OK = "ok"  # finished
CANCELLED = "cancelled"  # the client read its N tokens and left, as it meant to
TIMEOUT = "timeout"  # the client's deadline passed (it gave up)
REJECTED = "rejected"  # refused (429), no attempt left
FAILED = "failed"  # backend failure, no attempt left
UNFINISHED = "unfinished"  # still going when the run stopped

_QUEUED = 1
_INFLIGHT = 2
_WAITING_RETRY = 3
_DONE = 4
WAITING_RETRY = _WAITING_RETRY  # for the real-mode client, which shares ReqState


@dataclass(frozen=True)
class ArmSpec:
    """How one arm runs. `policy` None = the `direct` arm (no gateway). `single_class`:
    every request goes to priority 0 as one tenant (the FIFO baselines). `phase_policies`:
    a policy per phase, applied at the phase's start (the oracle)."""

    name: str
    policy: Policy | None = None
    single_class: bool = False
    phase_policies: tuple[Policy, ...] | None = None
    # Controller keyword arguments (tests and experiments).
    controller_kwargs: dict[str, Any] = field(default_factory=dict)
    # gateway replicas sharing the engines, each its own Controller (module docstring)
    replicas: int = 1
    # A peer gateway in place of Sluice's Controller (`bench.peers`): it is built as
    # `gateway(clock, backend_names)` and driven through the same calls.
    gateway: Callable[[FakeClock, list[str]], Any] | None = None
    # ... and in real mode, the arguments of `python -m sluice.bench.peers.proxy` for it
    gateway_argv: tuple[str, ...] = ()
    # What its clients do when refused, in place of the scenario's (`bench.peers`: the
    # OpenAI SDK's rule for the peers' users).
    client_retry: Retry | None = None
    # How often the gateway scrapes each backend (None: SCRAPE_INTERVAL_S).
    scrape_interval_s: float | None = None
    # How the replicas are spread, clocked, scraped, restarted (`bench.fleet`).
    fleet: FleetSpec | None = None

    def __post_init__(self) -> None:
        if self.replicas < 1:
            raise ValueError("replicas must be at least 1")
        if self.gateway is not None and (self.policy is not None or self.replicas != 1):
            raise ValueError("a peer gateway arm has no Sluice policy and one replica")

    @property
    def is_direct(self) -> bool:
        return self.policy is None and self.gateway is None


class ReqState:
    """The harness's view of one logical request and its current attempt."""

    __slots__ = (
        "admitted_after_ra",
        "aid",
        "attempt",
        "backend",
        "booking",
        "booking_due",
        "conn",
        "end_at",
        "first_refused_at",
        "first_token_at",
        "gw",
        "last_token_at",
        "outcome",
        "queued_at",
        "ra_attempts",
        "ra_given",
        "ra_retry",
        "ra_window",
        "rejections",
        "retried_at",
        "sent_at",
        "spec",
        "state",
        "tokens",
        "wasted",
    )

    def __init__(self, spec: ClientRequest) -> None:
        self.spec = spec
        self.attempt = 0
        self.aid = spec.request_id
        self.state = 0
        self.backend = -1
        self.gw = 0  # the gateway replica of the current attempt
        self.conn = -1  # the replica whose connection the attempt holds open (-1: none)
        self.queued_at = 0.0
        self.sent_at = 0.0
        self.first_token_at: float | None = None
        self.last_token_at: float | None = None
        self.tokens = 0
        self.end_at: float | None = None
        self.outcome = UNFINISHED
        self.rejections: list[str] = []
        self.ra_retry = False  # the current attempt came back at a Retry-After
        self.ra_attempts = 0  # attempts that came back at a Retry-After
        self.admitted_after_ra = 0  # ... and were then sent to a backend
        # per retry: (when it comes back, why the attempt before failed, Retry-After given)
        self.retried_at: list[tuple[float, str, float | None]] | None = None
        self.wasted = 0
        # the booking of the last refusal (sent back with the next attempt) and the window
        # over which the gateway asked for the return to be spread
        self.booking: str | None = None
        self.booking_due: float | None = None  # when it was told to come back (the token's)
        self.ra_window = 0.0
        self.first_refused_at: float | None = None
        self.ra_given: list[float] = []  # the Retry-After of each refusal (as sent)


@dataclass
class Episode:
    backend: int
    start: float
    limit_before: float | None
    cut_at: float | None = None


@dataclass
class ArmRun:
    """Everything one arm's run produced; `bench.metrics` turns it into results."""

    arm: str
    scenario: str
    requests: list[ReqState]
    backend_names: list[str]
    duration: float  # of the arrivals
    ended_at: float  # virtual time when the run stopped
    preemption_times: list[float]
    preempted_tokens: int  # KV tokens lost to preemption (recomputed later)
    wasted_after_gone: int  # tokens generated for attempts whose client had gone
    retry_after_retries: int
    retry_after_admitted: int
    rejections: dict[str, dict[str, int]]  # class -> code -> attempts refused
    first_rejection_at: dict[str, float | None]
    episodes: list[Episode]
    series: dict[str, Any]
    wall_s: float = 0.0
    events: int = 0
    controller_snapshot: ControllerSnapshot | None = None  # None: a peer arm, or `direct`
    # per engine: the most requests it ran in one step, and when
    peak_running: list[int] = field(default_factory=list)
    peak_running_at: list[float] = field(default_factory=list)
    # per gateway replica (replacements included): when it started, its arrivals, its
    # rolling-restart steps and what was open or cut at each (`bench.fleet`)
    replicas: list[dict[str, Any]] = field(default_factory=list)
    # the tenant quotas the replicas shared through a store (`bench.fleet_quotas`)
    quotas: FleetQuotas | None = None
    dispatch_log: list[tuple[float, int]] = field(default_factory=list)  # (time, class)
    reserved_p0: float = 0.0  # the arm's P0 reservation (for the unused capacity)


def plan_retry(
    r: ReqState,
    outcome: str,
    retry_after: float | None,
    seed: int,
    now: float,
    retry: Retry | None = None,
) -> float | None:
    """A failed attempt: if the client tries again, record the retry on `r` (attempt
    number, when it comes back, whether it follows a Retry-After) and return its delay;
    None when the client gives up. `retry` replaces the request's own behaviour (the
    clients of a peer arm: `ArmSpec.client_retry`). Shared by virtual time and real mode."""
    spec = r.spec
    if retry is None:
        retry = spec.retry
    if r.attempt + 1 >= retry.max_attempts or (outcome == TIMEOUT and not retry.on_timeout):
        return None
    if (
        outcome == REJECTED
        and retry.follow_retry_after
        and r.rejections
        and r.rejections[-1] == CANNOT_SERVE_IN_TIME
    ):
        return None  # told that no retry would be served before its deadline
    delay = retry_delay(spec, r.attempt, retry_after, seed, retry, r.ra_window)
    if delay is None:
        return None
    r.ra_retry = (
        outcome == REJECTED
        and retry.follow_retry_after
        and retry_after is not None
        and retry_after > 0
    )
    if r.ra_retry:
        r.ra_attempts += 1
    if r.retried_at is None:
        r.retried_at = []
    r.retried_at.append((now + delay, outcome, retry_after))
    r.attempt += 1
    return delay


class _Series:
    """Time series sampled at scrape ticks (downsampled for long runs)."""

    def __init__(self, n_backends: int) -> None:
        self.t: list[float] = []
        self.limit: list[list[float]] = [[] for _ in range(n_backends)]
        self.inflight: list[list[int]] = [[] for _ in range(n_backends)]
        self.running: list[list[int]] = [[] for _ in range(n_backends)]
        self.kv: list[list[float]] = [[] for _ in range(n_backends)]
        self.waiting: list[list[int]] = [[] for _ in range(n_backends)]
        self.queued: dict[str, list[int]] = {c: [] for c in CLASSES}
        self.rejected: dict[str, list[int]] = {}
        self.pressure: list[float] = []
        self.extra: dict[str, Any] = {}  # "cuts": limit cuts by reason, cumulative

    def as_dict(self) -> dict[str, Any]:
        return {
            **self.extra,
            "t": self.t,
            "limit": self.limit,
            "inflight": self.inflight,
            "running": self.running,
            "kv_usage": self.kv,
            "waiting": self.waiting,
            "queued": self.queued,
            "rejected_cumulative": self.rejected,
            "pressure": self.pressure,
        }


def _p95(values: list[float]) -> float | None:
    if not values:
        return None
    values.sort()
    return values[min(len(values) - 1, math.ceil(0.95 * len(values)) - 1)]


def _weighted_p95(pairs: list[tuple[float, int]]) -> float | None:
    total = sum(n for _, n in pairs)
    if total <= 0:
        return None
    pairs.sort()
    rank = 0.95 * total
    acc = 0
    for v, n in pairs:
        acc += n
        if acc >= rank:
            return v
    return pairs[-1][0]


class _Run:
    def __init__(
        self,
        scenario: Scenario,
        workload: list[ClientRequest],
        arm: ArmSpec,
        profile: Profile,
        *,
        seed: int,
        series_interval: float,
        progress: Callable[[float], None] | None,
        jitter: Jitter | None = None,
        engine: str | None = None,
    ) -> None:
        self.scenario = scenario
        self.arm = arm
        self.profile = profile
        self.seed = seed
        self.progress = progress
        n = scenario.spec.backends.count
        self.n = n
        self.names = [f"b{i}" for i in range(n)]
        self.name_index = {name: i for i, name in enumerate(self.names)}
        self.engines = [Engine(profile, seed=seed + i) for i in range(n)]
        self.jitter = jitter
        self.jitter_rng = [jitter.sampler(seed, i) for i in range(n)] if jitter else []
        noise = scenario.spec.backends.compute_noise
        episodes = (
            Episodes(noise.episodes.busy, noise.episodes.quiet)
            if noise is not None and noise.episodes is not None
            else None
        )
        self.compute_noise = ComputeNoise(noise.p50, noise.p99) if noise else None
        self.compute_rng = [
            self.compute_noise.sampler(seed, i) for i in range(n) if self.compute_noise
        ]
        self.compute_clock = [episodes.clock(seed, i) for i in range(n)] if episodes else []
        self.delivered_until = [0.0] * n  # deliveries of a backend stay in order
        self.engine_kind = engine
        self.views = [EngineView(engine, e) for e in self.engines] if engine else None
        self.step_snaps: list[EngineSnapshot | None] = [None] * n  # of the step under way
        self.engine_gen = [0] * n  # bumped when a backend dies: its step events go stale
        self.busy = [False] * n
        self.dead = [False] * n
        self.probe_failures = [0] * n
        self.inflight_on: list[dict[str, ReqState]] = [{} for _ in range(n)]
        self.preempt_total = [0] * n
        # state of each engine as of its last completed step: running, waiting, kv usage
        self.published: list[tuple[int, int, float]] = [(0, 0, 0.0)] * n
        self.ttft_window: list[list[float]] = [[] for _ in range(n)]
        self.itl_window: list[list[tuple[float, int]]] = [[] for _ in range(n)]
        self.was_waiting = [False] * n
        self.last_waiting_at = [-math.inf] * n
        self.open_episode: list[Episode | None] = [None] * n
        self.open_episodes = 0
        self.next_cut_check = 0.0
        self.episodes: list[Episode] = []
        self.rr = 0

        self.reqs = [ReqState(spec) for spec in workload]
        self.by_aid: dict[str, ReqState] = {}
        self.heap: list[tuple[float, int, int, Any]] = []
        self.seq = 0
        self.outstanding = len(self.reqs)
        self.duration = scenario.duration
        self.t_end = self.duration + scenario.spec.drain

        self.preemption_times: list[float] = []
        self.dispatch_log: list[tuple[float, int]] = []  # (time, class) of every send
        self.preempted_tokens = 0
        self.wasted_after_gone = 0
        self.ra_retries = 0
        self.ra_admitted = 0
        self.rejections: dict[str, dict[str, int]] = {c: {} for c in CLASSES}
        self.rejected_total: dict[str, int] = {}
        self.first_rejection_at: dict[str, float | None] = dict.fromkeys(CLASSES)
        self.queued_by_class = [0, 0, 0]
        self.series = _Series(n)
        self.series_interval = max(SCRAPE_INTERVAL_S, series_interval)
        self.next_series_at = 0.0
        self.events = 0
        self.now = 0.0

        self.clock = FakeClock()
        self.scrape_interval = arm.scrape_interval_s or SCRAPE_INTERVAL_S
        self.fleet = arm.fleet or FleetSpec()
        self.balancer = Balancer(self.fleet.balance, seed)
        self.scrape_lag = self.fleet.scrape_lag
        # Per replica, by index (a replacement gets the next one): its controller, clock,
        # whether the Service sends to it, whether it still runs, its open client
        # connections, its timer, the backends' health as it was told, its scrape draws.
        self.ctrls: list[Controller] = []  # none for `direct`
        self.gw_clocks: list[ReplicaClock] = []
        self.in_service: list[bool] = []
        self.running_gw: list[bool] = []
        self.draining: list[bool] = []
        self.conns: list[int] = []
        self.wakeup_at: list[float | None] = []
        self.healthy: list[list[bool]] = []
        self.scrape_rng: list[Any] = []
        self.gw_stats: list[dict[str, Any]] = []
        self.ready: list[int] = []  # the replicas the Service sends to
        # tenant quotas shared through a store (Redis) by the replicas: `bench.fleet_quotas`
        self.quotas: FleetQuotas | None = None
        if self.fleet.quota_store is not None and arm.policy is not None and arm.gateway is None:
            tenants = arm.policy.core_settings().tenants
            self.quotas = FleetQuotas(self.fleet.quota_store, tenants, self.clock, self._call, seed)
        self.peak_running = [0] * n  # the most requests each engine ran in one step
        self.peak_running_at = [0.0] * n
        if arm.gateway is not None:
            self.ctrls.append(arm.gateway(self.clock, self.names))
            self._replica_state(0.0)
        elif not arm.is_direct:
            for _ in range(arm.replicas):
                self._new_replica(0.0)
        self.ctrl: Controller | None = self.ctrls[0] if self.ctrls else None
        self.replicas = len(self.ctrls)
        self.limits = self._read_limits()
        # A fixed limit is never cut: no reaction to measure (and reading limits costs).
        self.measure_reaction = (
            arm.gateway is None
            and self.ctrl is not None
            and not all(
                p.limiter.algorithm == "fixed"
                for p in (arm.phase_policies or (arm.policy,))
                if p is not None
            )
        )

    # -- the replicas -----------------------------------------------------------------

    def _new_replica(self, t: float) -> int:
        """A fresh `sluice serve` replica, in service from `t`; its index."""
        k = len(self.ctrls)
        arm = self.arm
        policy = arm.phase_policies[0] if arm.phase_policies else arm.policy
        assert policy is not None
        if arm.phase_policies and t > 0:
            policy = arm.phase_policies[self.scenario.phase_at(t).index]
        kwargs = dict(arm.controller_kwargs)
        if k:
            kwargs.setdefault("seed", f"replica-{k}")
        skew = self.fleet.clock_skew_s
        offset = 0.0
        if skew > 0:
            offset = random.Random(f"{self.seed}/clock/{k}").uniform(-skew, skew)
        clock = ReplicaClock(self.clock, offset)
        if self.quotas is not None:
            ctrl = self.quotas.controller(k, t, policy.core_settings(), clock, self.names, kwargs)
        else:
            ctrl = Controller(policy.core_settings(), clock, self.names, **kwargs)
        for name in self.names:
            ctrl.set_backend_models(name, [MODEL])
            ctrl.set_backend_health(name, True)
        self.ctrls.append(ctrl)
        self._replica_state(t, clock)
        self._tell_peers(t)
        return k

    def _tell_peers(self, t: float) -> None:
        """Every live replica learns how many are live, as Redis's count of the processes
        sharing the quotas tells them (gateway/shared_quota.py: a process registers when
        it starts and leaves the count when it exits), when the fleet says so. With a
        quota store, only while it answers: a replica that starts while it is lost has no
        count, the others keep theirs, until it is back (`_tell_peers` again then)."""
        if not self.fleet.known_peers or self.arm.gateway is not None:
            return
        if self.quotas is not None and self.quotas.store.failure(t) is not None:
            return
        live = self._live()
        for k in live:
            self.ctrls[k].expect_peers(len(live))

    def _replica_state(self, t: float, clock: ReplicaClock | None = None) -> None:
        k = len(self.gw_clocks)
        self.gw_clocks.append(clock or ReplicaClock(self.clock, 0.0))
        self.in_service.append(True)
        self.running_gw.append(True)
        self.draining.append(False)
        self.conns.append(0)
        self.wakeup_at.append(None)
        self.healthy.append([True] * self.n)
        self.scrape_rng.append(
            self.scrape_lag.sampler(self.seed, 10_000 + k) if self.scrape_lag else None
        )
        self.gw_stats.append({"started_at": t, "arrivals": 0})
        self.ready.append(k)

    def _fleet_event(self, t: float, action: str, k: int) -> None:
        """A step of the rolling restart for replica `k` (`bench.fleet.RollingRestart`)."""
        restart = self.fleet.restart
        assert restart is not None
        stats = self.gw_stats[k]
        if action == "replace":
            new = self._new_replica(t)
            self.gw_stats[new]["replaces"] = k
            self.push(t, _SCRAPE, new)  # its scrape loop starts with it
            self.push(t + restart.propagation, _FLEET, ("remove", k))
            self.push(t + restart.pre_stop, _FLEET, ("sigterm", k))
            self.push(t + restart.pre_stop + restart.grace, _FLEET, ("kill", k))
            stats["replaced_at"] = t
            return
        if not self.running_gw[k]:
            return
        if action == "remove":  # the Service no longer sends to it
            self.in_service[k] = False
            self.ready.remove(k)
            stats["removed_at"] = t
            stats["open_at_removal"] = self._open_counts(k)
        elif action == "sigterm":
            self.draining[k] = True
            stats["sigterm_at"] = t
            stats["open_at_sigterm"] = self._open_counts(k)
            self.ctrls[k].hand_over()  # its queued requests retry on the others
            self._pump(t, k)
            if self.conns[k] == 0 and self.running_gw[k]:
                self._replica_exits(t, k, cut=False)
        elif action == "kill":
            self._replica_exits(t, k, cut=True)

    def _open_counts(self, k: int) -> dict[str, int]:
        snap = self.ctrls[k].snapshot()
        queued = sum(c.queued for c in snap.classes.values())
        inflight = sum(b.inflight for b in snap.backends.values())
        return {"queued": queued, "inflight": inflight}

    def _replica_exits(self, t: float, k: int, *, cut: bool) -> None:
        """Replica `k` ends: at once when drained, or cut at the end of its grace period:
        its clients' connections close (queued and running attempts fail; they retry as
        after any failure), its running requests are aborted on their engines."""
        self.running_gw[k] = False
        self.in_service[k] = False
        if k in self.ready:
            self.ready.remove(k)
        stats = self.gw_stats[k]
        stats["exited_at"] = t
        self._tell_peers(t)
        if self.quotas is not None:
            # drained: `sluice serve` hands back what it admitted alone while Redis was
            # lost within its shutdown grace from SIGTERM (the pod's SIGKILL may come first)
            until = None
            restart = self.fleet.restart
            if not cut and "sigterm_at" in stats and self.arm.policy is not None:
                grace = self.arm.policy.server.shutdown_grace
                if restart is not None:
                    grace = min(grace, restart.grace)
                until = stats["sigterm_at"] + grace
            self.quotas.replica_exits(t, k, until, killed=cut)
        lost = {"queued": 0, "inflight": 0}
        if cut:
            for r in [r for r in self.by_aid.values() if r.gw == k and r.conn == k]:
                if r.state == _QUEUED:
                    lost["queued"] += 1
                    self.queued_by_class[r.spec.priority] -= 1
                    self.by_aid.pop(r.aid, None)
                elif r.state == _INFLIGHT:
                    lost["inflight"] += 1
                    self._leave_backend(t, r, Outcome.CANCELLED)
                    r.wasted += r.tokens
                else:
                    continue
                self._retry_or_end(t, r, FAILED, None)
        stats["cut_at_exit"] = lost

    def replica_report(self) -> list[dict[str, Any]]:
        out = []
        for k, stats in enumerate(self.gw_stats):
            entry = dict(stats)
            if k < len(self.ctrls) and self.arm.gateway is None:
                ctrl = self.ctrls[k]
                entry["fleet_share"] = round(ctrl.fleet_share(), 4)
            out.append(entry)
        return out

    def _live(self) -> list[int]:
        """The replicas still running (in service or draining)."""
        return [k for k, alive in enumerate(self.running_gw) if alive]

    # -- the event heap ---------------------------------------------------------------

    def push(self, t: float, kind: int, payload: Any) -> None:
        self.seq += 1
        heapq.heappush(self.heap, (t, self.seq, kind, payload))

    def _call(self, t: float, fn: Callable[[float], None]) -> None:
        self.push(t, _CALL, fn)

    def _read_limits(self) -> list[float]:
        """Per backend, the sum of the live replicas' limits."""
        if not self.ctrls:
            return [math.inf] * self.n
        out = [0.0] * self.n
        for k in self._live():
            limits = self.ctrls[k].limits()
            for i, name in enumerate(self.names):
                out[i] += float(limits[name])
        return out

    # -- main loop ----------------------------------------------------------------------

    def run(self) -> None:
        for r in self.reqs:
            self.push(r.spec.arrival, _ARRIVE, r)
        # A gateway scrapes its backends as it starts (before traffic), then every
        # interval; replica k is k/replicas of an interval behind replica 0.
        for k in range(max(1, self.replicas)):
            self.push(self.scrape_interval * k / max(1, self.replicas), _SCRAPE, k)
        for i, e in enumerate(self.scenario.spec.events):
            self.push(e.at, _BACKEND_EVENT, i)
        if self.scenario.spec.events and self.ctrl is not None:
            self.push(HEALTH_INTERVAL_S, _HEALTH, None)
        if self.arm.phase_policies:
            for p in self.scenario.phases[1:]:
                self.push(p.start, _PHASE, p.index)
        restart = self.fleet.restart
        if restart is not None and self.ctrls and self.arm.gateway is None:
            for k in range(self.replicas):
                self.push(restart.at + k * restart.every, _FLEET, ("replace", k))
        if self.quotas is not None:
            self.quotas.start()
            for o in self.quotas.store.outages:
                self._call(o.back, self._tell_peers)
        heap = self.heap
        pop = heapq.heappop
        progress_every = 2000
        while heap:
            t, _, kind, payload = pop(heap)
            if t > self.t_end:
                break
            self.events += 1
            if self.progress is not None and self.events % progress_every == 0:
                self.progress(t)
            if self.ctrl is not None and t > self.clock.now():
                self.clock.set(t)
            if kind == _STEP_END:
                self._step_end(t, payload)
            elif kind == _ARRIVE:
                self._arrive(t, payload)
            elif kind == _WAKEUP:
                at = self.wakeup_at[payload]
                if at is not None and t >= at:
                    self.wakeup_at[payload] = None
                self._pump(t, payload)
            elif kind == _SCRAPE:
                self._scrape(t, payload)
            elif kind == _GIVE_UP:
                self._give_up(t, payload)
            elif kind == _HEALTH:
                self._health(t)
            elif kind == _BACKEND_EVENT:
                self._backend_event(t, payload)
            elif kind == _DELIVER:
                self._deliver(t, payload)
            elif kind == _SCRAPED:
                self._scraped(t, *payload)
            elif kind == _FLEET:
                self._fleet_event(t, *payload)
            elif kind == _CALL:
                payload(t)
            elif kind == _PHASE:
                assert self.ctrls and self.arm.phase_policies is not None
                settings = self.arm.phase_policies[payload].core_settings()
                for k in self._live():
                    self.ctrls[k].apply_policy(settings)
                self._pump(t)
            self.now = t
            if self.outstanding == 0 and t >= self.duration:
                break
        self.ended_at = min(self.t_end, max(self.duration, self.now))
        for r in self.reqs:
            if r.state == _WAITING_RETRY and r.retried_at:
                # its client was told to come back after the end: the last answer stands
                r.outcome = r.retried_at[-1][1]
        for ep in self.open_episode:
            if ep is not None:
                self.episodes.append(ep)

    # -- clients ------------------------------------------------------------------------

    def _arrive(self, t: float, r: ReqState) -> None:
        spec = r.spec
        if not self.ctrls:
            b = self.rr % self.n
            self.rr += 1
            r.queued_at = t
            self._send(t, r, b)
            return
        single = self.arm.single_class
        gw = self.balancer.pick(self.ready, self.conns) if len(self.ready) > 1 else self.ready[0]
        clock = self.gw_clocks[gw]
        info = RequestInfo(
            request_id=r.aid,
            tenant="all" if single else spec.tenant,
            priority=0 if single else spec.priority,
            model=MODEL,
            prompt_tokens=spec.prompt_tokens,
            max_tokens=spec.max_tokens,
            weight=1.0 if single else spec.weight,
            client_deadline=None if spec.deadline is None else clock.at(t) + spec.deadline,
            retry_attempt=r.attempt,
            first_token_visible=not spec.pooling,
            prefill_only=spec.pooling,
            booking=r.booking,
            # the token carries it: another replica honours it (on its own clock)
            booked_slot=None if r.booking_due is None else clock.at(r.booking_due),
        )
        r.booking = None
        r.gw = gw
        self.gw_stats[gw]["arrivals"] += 1
        quotas = self.quotas
        if quotas is not None and quotas.check(
            t, gw, info, lambda ta, refusal: self._checked(ta, t, r, gw, info, refusal)
        ):
            return  # the shared quota's answer comes back later
        self._admit(t, t, r, gw, info)

    def _checked(
        self,
        t: float,
        sent: float,
        r: ReqState,
        gw: int,
        info: RequestInfo,
        refusal: tuple[str, float] | None,
    ) -> None:
        """The shared quota's answer to an attempt sent at `sent` is back."""
        if not self.running_gw[gw]:
            self._retry_or_end(t, r, FAILED, None)  # its replica is gone: connection closed
        elif refusal is not None:
            self._rejected(t, r, *refusal)
        else:
            self._admit(t, sent, r, gw, info)

    def _admit(self, t: float, sent: float, r: ReqState, gw: int, info: RequestInfo) -> None:
        """Replica `gw`'s Controller takes the attempt (sent by its client at `sent`)."""
        spec = r.spec
        adm = self.ctrls[gw].arrive(info)
        if not adm.admitted:
            assert adm.code is not None
            self._rejected(t, r, adm.code.value, adm.retry_after_s, adm.booking, adm.retry_window_s)
        else:
            r.state = _QUEUED
            r.queued_at = t
            r.conn = gw
            self.conns[gw] += 1
            self.by_aid[r.aid] = r
            self.queued_by_class[spec.priority] += 1
            if spec.deadline is not None:
                self.push(sent + spec.deadline, _GIVE_UP, (r, r.attempt))
        self._pump(t, gw)

    def _rejected(
        self,
        t: float,
        r: ReqState,
        code: str,
        retry_after: float | None,
        booking: str | None = None,
        window: float = 0.0,
    ) -> None:
        cls = r.spec.class_name
        note_refusal(r, t, code, retry_after, booking, window)
        counts = self.rejections[cls]
        counts[code] = counts.get(code, 0) + 1
        self.rejected_total[code] = self.rejected_total.get(code, 0) + 1
        if self.first_rejection_at[cls] is None:
            self.first_rejection_at[cls] = t
        r.rejections.append(code)
        self._retry_or_end(t, r, REJECTED, retry_after)

    def _retry_or_end(self, t: float, r: ReqState, outcome: str, retry_after: float | None) -> None:
        """The attempt failed: come back later if the client retries, else finish."""
        if r.conn >= 0:
            self._hang_up(t, r)
        spec = r.spec
        delay = plan_retry(r, outcome, retry_after, self.seed, t, self.arm.client_retry)
        if delay is not None:
            r.aid = f"{spec.request_id}.{r.attempt}"
            r.state = _WAITING_RETRY
            r.first_token_at = None
            r.last_token_at = None
            r.tokens = 0
            self.push(t + delay, _ARRIVE, r)
            return
        self._finish(t, r, outcome)

    def _finish(self, t: float, r: ReqState, outcome: str) -> None:
        r.state = _DONE
        r.outcome = outcome
        r.end_at = t
        self.outstanding -= 1

    def _give_up(self, t: float, payload: tuple[ReqState, int]) -> None:
        r, attempt = payload
        if r.attempt != attempt or r.state not in (_QUEUED, _INFLIGHT):
            return
        ctrl = self.ctrls[r.gw] if self.ctrls else None
        if r.state == _QUEUED:
            self.queued_by_class[r.spec.priority] -= 1
            self.by_aid.pop(r.aid, None)
            if ctrl is not None:
                ctrl.cancel(r.aid)
        else:
            self._leave_backend(t, r, Outcome.CANCELLED)
            r.wasted += r.tokens  # a truncated answer is of no use to its client
        self._retry_or_end(t, r, TIMEOUT, None)
        if ctrl is not None:
            self._pump(t, r.gw)

    def _leave_backend(self, t: float, r: ReqState, outcome: Outcome) -> None:
        """The client goes away from an in-flight attempt: abort it on the engine."""
        b = r.backend
        self.by_aid.pop(r.aid, None)
        self.inflight_on[b].pop(r.aid, None)
        if not self.dead[b]:
            self.engines[b].abort(r.aid, t)
        if self.ctrls:
            self.ctrls[r.gw].on_finish(r.aid, outcome, r.spec.prompt_tokens, r.tokens)

    # -- the gateway ----------------------------------------------------------------------

    def _pump(
        self, t: float, gw: int | Iterable[int] | None = None, *, check_cuts: bool = False
    ) -> None:
        """Let replica `gw` (several; None: every live replica) act on what changed."""
        if not self.ctrls:
            return
        if gw is None:
            gws: Iterable[int] = self._live()
        elif isinstance(gw, int):
            gws = (gw,)
        else:
            gws = gw
        for k in gws:
            if self.running_gw[k]:
                self._pump_one(t, k)
        if self.open_episodes and (check_cuts or t >= self.next_cut_check):
            self.next_cut_check = t + CUT_CHECK_EVERY_S
            self._check_cuts(t)

    def _pump_one(self, t: float, gw: int) -> None:
        ctrl = self.ctrls[gw]
        assignments, rejections, nw = ctrl.step()
        for rej in rejections:
            r = self.by_aid.pop(rej.request_id, None)
            if r is None or r.state != _QUEUED:
                continue
            self.queued_by_class[r.spec.priority] -= 1
            self._rejected(t, r, rej.code.value, rej.retry_after_s, rej.booking, rej.retry_window_s)
        for a in assignments:
            r = self.by_aid.get(a.request_id)
            if r is None or r.state != _QUEUED:
                ctrl.cancel(a.request_id)
                continue
            self.queued_by_class[r.spec.priority] -= 1
            if r.ra_retry:
                r.admitted_after_ra += 1
            self._send(t, r, self.name_index[a.backend])
        if nw is not None:
            nw -= self.gw_clocks[gw].offset  # the replica's clock -> virtual time
        at = self.wakeup_at[gw]
        if nw is not None and (at is None or nw < at):
            if nw <= t:
                nw = t + 1e-6
            self.wakeup_at[gw] = nw
            self.push(nw, _WAKEUP, gw)

    # -- engines --------------------------------------------------------------------------

    def _send(self, t: float, r: ReqState, b: int) -> None:
        spec = r.spec
        r.backend = b
        r.sent_at = t
        self.dispatch_log.append((t, spec.priority))
        if self.dead[b]:
            # connection refused: the gateway takes the backend out at once
            self.by_aid.pop(r.aid, None)
            if self.ctrls:
                ctrl = self.ctrls[r.gw]
                ctrl.on_finish(r.aid, Outcome.ERROR)
                if self.healthy[r.gw][b]:
                    self.healthy[r.gw][b] = False
                    ctrl.set_backend_health(self.names[b], False)
            self._retry_or_end(t, r, FAILED, None)
            return
        if self.views is not None and self.views[b].refuses(len(self.inflight_on[b])):
            self._engine_refused(t, r)
            return
        r.state = _INFLIGHT
        self.by_aid[r.aid] = r
        self.inflight_on[b][r.aid] = r
        engine = self.engines[b]
        engine.submit(
            EngineRequest(
                r.aid, spec.prompt_tokens, spec.max_tokens, spec.output_tokens, spec.pooling
            ),
            t,
        )
        if not self.ctrls and spec.deadline is not None:
            self.push(t + spec.deadline, _GIVE_UP, (r, r.attempt))
        if not self.busy[b]:
            self._start_step(t, b)

    def _engine_refused(self, t: float, r: ReqState) -> None:
        """The engine refused the request (its router is full): an overload for the
        gateway's limiter, a refusal for the client."""
        self.by_aid.pop(r.aid, None)
        if self.ctrls:
            self.ctrls[r.gw].on_finish(r.aid, Outcome.OVERLOADED)
        self._rejected(t, r, "engine_overloaded", None)

    def _start_step(self, t: float, b: int) -> None:
        engine = self.engines[b]
        noise = self.compute_noise
        factor = 1.0
        if noise is not None and (not self.compute_clock or self.compute_clock[b].busy_at(t)):
            factor = noise.draw(self.compute_rng[b])
        result = engine.step(t, factor)
        waiting = engine.num_waiting
        running = engine.num_running
        if running > self.peak_running[b]:
            self.peak_running[b] = running
            self.peak_running_at[b] = t
        state = (running, waiting, engine.kv_usage)
        if self.views is not None:
            self.step_snaps[b] = engine.snapshot()
        # Congested: requests are left waiting for KV blocks or sequence slots, not merely
        # for the next step's token budget (a chunked prefill queue that clears by itself).
        if waiting > 0 and (
            result.num_scheduled_tokens < self.profile.max_num_batched_tokens
            or result.preempted
            or running >= self.profile.max_num_seqs
        ):
            if not self.was_waiting[b]:
                self._queueing_starts(t, b)
            self.was_waiting[b] = True
            self.last_waiting_at[b] = t
        else:
            self.was_waiting[b] = False
        end = result.end
        if result.duration <= 0 and engine.has_work():
            end = t + (self.profile.step_overhead_s or 1e-3)  # never spin in place
        self.busy[b] = True
        self.push(end, _STEP_END, (b, self.engine_gen[b], result, state))

    def _step_end(
        self, t: float, payload: tuple[int, int, StepResult, tuple[int, int, float]]
    ) -> None:
        b, gen, result, state = payload
        if gen != self.engine_gen[b]:
            return  # the backend died during this step
        self.published[b] = state
        snap = self.step_snaps[b]
        if self.views is not None and snap is not None:
            self.views[b].observe(result, snap)
        if result.preempted:
            self._preempted(t, b, result)
        if self.jitter is not None:
            # the gateway sees this step's tokens later, in order; the engine goes on now
            at = max(t + self.jitter.draw(self.jitter_rng[b]), self.delivered_until[b])
            self.delivered_until[b] = at
            self.push(at, _DELIVER, (b, gen, result))
            touched: set[int] = set()
        else:
            touched = self._tokens(t, b, result)
        if self.engines[b].has_work():
            self._start_step(t, b)
        else:
            self.busy[b] = False
        if touched:
            self._pump(t, touched)

    def _deliver(self, t: float, payload: tuple[int, int, StepResult]) -> None:
        b, gen, result = payload
        if gen != self.engine_gen[b]:
            return  # the backend died since: its requests were cut then
        touched = self._tokens(t, b, result)
        if touched:
            self._pump(t, touched)

    def _tokens(self, t: float, b: int, result: StepResult) -> set[int]:
        """A step's tokens reach their clients (and the gateway) at `t`; the replicas
        whose requests they were (only those have anything new to act on)."""
        by_aid = self.by_aid
        ctrls = self.ctrls
        ttfts = self.ttft_window[b]
        gen_tokens = 0
        touched: set[int] = set()
        for ev in result.tokens:
            r = by_aid.get(ev.request_id)
            if r is None or r.state != _INFLIGHT:
                self.wasted_after_gone += 1  # its client had already gone
                continue
            if ctrls:
                touched.add(r.gw)
            index = ev.index
            if index == 0:
                r.first_token_at = t
                ttfts.append(t - r.sent_at)
                if ctrls:
                    ctrls[r.gw].on_first_token(r.aid)
            else:
                gen_tokens += 1
            r.last_token_at = t
            r.tokens = index + 1
            if ev.finish_reason is not None:
                self._completed(t, r, OK)
            elif r.spec.cancel_after is not None and r.tokens >= r.spec.cancel_after:
                self._completed(t, r, CANCELLED)
        for st in result.finished if result.num_prompt_tokens else ():
            # a prefill-only request: done, with no token, when its prompt was computed
            if st.pooling:
                r = by_aid.get(st.request_id)
                if r is not None and r.state == _INFLIGHT:
                    r.first_token_at = r.last_token_at = t
                    ttfts.append(t - r.sent_at)
                    self._completed(t, r, OK)
        if gen_tokens:
            self.itl_window[b].append((result.duration, gen_tokens))
        return touched

    def _hang_up(self, t: float, r: ReqState) -> None:
        """The attempt's connection to its replica closes (a draining one may exit)."""
        gw = r.conn
        r.conn = -1
        self.conns[gw] -= 1
        if self.draining[gw] and self.conns[gw] == 0 and self.running_gw[gw]:
            self._replica_exits(t, gw, cut=False)

    def _completed(self, t: float, r: ReqState, outcome: str) -> None:
        if r.conn >= 0:
            self._hang_up(t, r)
        b = r.backend
        self.by_aid.pop(r.aid, None)
        self.inflight_on[b].pop(r.aid, None)
        if outcome == CANCELLED:
            self.engines[b].abort(r.aid, t)
        if self.ctrls:
            self.ctrls[r.gw].on_finish(
                r.aid,
                Outcome.OK if outcome == OK else Outcome.CANCELLED,
                r.spec.prompt_tokens,
                r.tokens,
            )
        self._finish(t, r, outcome)

    def _preempted(self, t: float, b: int, result: StepResult) -> None:
        self.preempt_total[b] += len(result.preempted)
        for aid in result.preempted:
            self.preemption_times.append(t)
            r = self.by_aid.get(aid)
            # the KV it loses: its prompt and what it generated (an upper bound when the
            # victim was still in a chunked prefill)
            if r is not None:
                self.preempted_tokens += r.spec.prompt_tokens + r.tokens

    # -- scrapes, health, failures ------------------------------------------------------

    def _scrape(self, t: float, gw: int) -> None:
        """Replica `gw` starts a scrape round: each engine's state as of now (its last
        completed step), applied at once, or with a scrape lag when the round's slowest
        answer is in; the next round starts an interval after that. The first live
        replica also samples the series."""
        interval = self.scrape_interval
        if self.ctrls:
            if not self.running_gw[gw]:
                return  # it has exited: its loop is gone
            series = gw == self._live()[0]
            readings = self._read_engines(t, gw, series)
            rng = self.scrape_rng[gw]
            lag = 0.0
            if rng is not None and self.scrape_lag is not None:
                draw = self.scrape_lag.draw
                lag = max(draw(rng) for _ in range(self.n))
            if lag > 0:
                self.push(t + lag, _SCRAPED, (gw, readings))
            else:
                self._scraped(t, gw, readings)
            next_at = t + lag + interval
        else:
            series = True
            for b in range(self.n):
                self.ttft_window[b] = []
                self.itl_window[b] = []
            next_at = t + interval
        if t < self.duration or self.outstanding > 0:
            self.push(next_at, _SCRAPE, gw)
        if not series:
            return
        if t >= self.next_series_at:
            self._sample(t)
            self.next_series_at = t + self.series_interval - 1e-9
        if self.progress is not None:
            self.progress(t)

    def _read_engines(
        self, t: float, gw: int, series: bool
    ) -> list[tuple[str, BackendMetrics | None]]:
        """What replica `gw`'s scrape of every engine reads at `t` (None: no answer, the
        backend is down); the series' replica also takes the TTFT and TPOT p95."""
        at = self.gw_clocks[gw].at(t)
        out: list[tuple[str, BackendMetrics | None]] = []
        for b, name in enumerate(self.names):
            if self.dead[b]:
                out.append((name, None))
                continue
            if self.views is not None:
                out.append((name, self.views[b].scrape(at)))
                continue
            running, waiting, kv = self.published[b]
            out.append(
                (
                    name,
                    BackendMetrics(
                        at=at,
                        running=float(running),
                        waiting=float(waiting),
                        kv_usage=kv,
                        preemptions_total=float(self.preempt_total[b]),
                        num_gpu_blocks=self.profile.num_gpu_blocks,
                        block_size=self.profile.block_size,
                        ttft_p95_s=_p95(self.ttft_window[b]) if series else None,
                        tpot_p95_s=_weighted_p95(self.itl_window[b]) if series else None,
                    ),
                )
            )
            if series:
                self.ttft_window[b] = []
                self.itl_window[b] = []
        return out

    def _scraped(
        self, t: float, gw: int, readings: list[tuple[str, BackendMetrics | None]]
    ) -> None:
        """Replica `gw`'s scrape round is in: its controller learns what it read."""
        if not self.running_gw[gw]:
            return
        ctrl = self.ctrls[gw]
        for name, m in readings:
            if m is None:
                ctrl.metrics_stale(name)
            else:
                ctrl.on_metrics(name, m)
        self._pump(t, gw, check_cuts=True)

    def _sample(self, t: float) -> None:
        s = self.series
        s.t.append(round(t, 3))
        if self.ctrls:
            snaps = [self.ctrls[k].snapshot() for k in self._live()]
            pressure = sum(snap.pressure for snap in snaps) / len(snaps)
            s.pressure.append(round(pressure, 4))
            for b, name in enumerate(self.names):
                s.limit[b].append(sum(snap.backends[name].limit for snap in snaps))
            if self.arm.gateway is None:
                cuts: dict[str, int] = {}
                for snap in snaps:
                    for reason, n in cuts_so_far(snap).items():
                        cuts[reason] = cuts.get(reason, 0) + n
                add_cuts_sample(s.extra, len(s.t), cuts)
        for b in range(self.n):
            s.inflight[b].append(len(self.inflight_on[b]))
            running, waiting, kv = self.published[b]
            s.running[b].append(running)
            s.kv[b].append(round(kv, 4))
            s.waiting[b].append(waiting)
        for p, c in enumerate(CLASSES):
            s.queued[c].append(self.queued_by_class[p])
        for code, n in self.rejected_total.items():
            col = s.rejected.setdefault(code, [0] * (len(s.t) - 1))
            col.append(n)
        for code, col in s.rejected.items():
            if len(col) < len(s.t):
                col.append(self.rejected_total.get(code, 0))

    def _health(self, t: float) -> None:
        """Every replica probes every engine (at the same time)."""
        assert self.ctrls
        changed = False
        for b, name in enumerate(self.names):
            if self.dead[b]:
                self.probe_failures[b] += 1
            else:
                self.probe_failures[b] = 0
            healthy = not self.dead[b] or self.probe_failures[b] < UNHEALTHY_AFTER
            for k in self._live():
                ctrl, seen = self.ctrls[k], self.healthy[k]
                # a failed probe takes a backend out only after UNHEALTHY_AFTER in a row;
                # one good probe brings it back
                if seen[b] != healthy and (not healthy or not self.dead[b]):
                    seen[b] = healthy
                    ctrl.set_backend_health(name, healthy)
                    changed = True
        if changed:
            self._pump(t)
        if t < self.duration or self.outstanding > 0:
            self.push(t + HEALTH_INTERVAL_S, _HEALTH, None)

    def _backend_event(self, t: float, index: int) -> None:
        ev = self.scenario.spec.events[index]
        b = ev.backend
        if ev.action == "fail" and not self.dead[b]:
            self.dead[b] = True
            self.engine_gen[b] += 1
            self.busy[b] = False
            self.published[b] = (0, 0, 0.0)
            cut = list(self.inflight_on[b].values())
            self.inflight_on[b].clear()
            for r in cut:
                self.by_aid.pop(r.aid, None)
                r.wasted += r.tokens
                if self.ctrls:
                    self.ctrls[r.gw].on_finish(r.aid, Outcome.ERROR, r.spec.prompt_tokens, r.tokens)
                self._retry_or_end(t, r, FAILED, None)
        elif ev.action == "recover" and self.dead[b]:
            self.dead[b] = False
            self.engines[b] = Engine(self.profile, seed=self.seed + b + 1000 * self.engine_gen[b])
            if self.views is not None and self.engine_kind is not None:
                self.views[b] = EngineView(self.engine_kind, self.engines[b])
            self.preempt_total[b] = 0
        if self.ctrls:
            self._pump(t)

    # -- the limit's reaction to queueing -------------------------------------------------

    def _queueing_starts(self, t: float, b: int) -> None:
        if not self.measure_reaction or self.open_episode[b] is not None:
            return
        if t - self.last_waiting_at[b] < EPISODE_GAP_S:
            return
        self.open_episode[b] = Episode(backend=b, start=t, limit_before=self.limits[b])
        self.open_episodes += 1
        self.limits = self._read_limits()
        self.open_episode[b].limit_before = self.limits[b]  # type: ignore[union-attr]

    def _check_cuts(self, t: float) -> None:
        limits = self._read_limits()
        for b, ep in enumerate(self.open_episode):
            if ep is None:
                continue
            if limits[b] < self.limits[b]:
                ep.cut_at = t
            if ep.cut_at is not None or t - ep.start > REACTION_WINDOW_S:
                self.episodes.append(ep)
                self.open_episode[b] = None
                self.open_episodes -= 1
        self.limits = limits


def run_arm(
    scenario: Scenario,
    workload: list[ClientRequest],
    arm: ArmSpec,
    profile: Profile,
    *,
    seed: int = 0,
    series_interval: float = SCRAPE_INTERVAL_S,
    progress: Callable[[float], None] | None = None,
    jitter: Jitter | None = None,
    engine: str | None = None,
) -> ArmRun:
    """Run one arm on fresh engines; the workload is not modified. `jitter`: latency noise
    between the engines and the gateway (`bench.noise`; None: exact virtual time).
    `engine`: the surface every backend presents (None: the scrape hands the controller the
    engine's state as vLLM shows it, without rendering a page)."""
    import time

    started = time.perf_counter()
    run = _Run(
        scenario,
        workload,
        arm,
        profile,
        seed=seed,
        series_interval=series_interval,
        progress=progress,
        jitter=jitter,
        engine=engine,
    )
    run.run()
    return ArmRun(
        arm=arm.name,
        scenario=scenario.name,
        requests=run.reqs,
        backend_names=run.names,
        duration=scenario.duration,
        ended_at=run.ended_at,
        preemption_times=run.preemption_times,
        preempted_tokens=run.preempted_tokens,
        wasted_after_gone=run.wasted_after_gone,
        retry_after_retries=sum(r.ra_attempts for r in run.reqs),
        retry_after_admitted=sum(r.admitted_after_ra for r in run.reqs),
        rejections=run.rejections,
        first_rejection_at=run.first_rejection_at,
        episodes=run.episodes,
        series=run.series.as_dict(),
        wall_s=time.perf_counter() - started,
        events=run.events,
        # Sluice's controller's (a peer model's has no limiter state to report)
        controller_snapshot=run.ctrl.snapshot() if isinstance(run.ctrl, Controller) else None,
        peak_running=run.peak_running,
        peak_running_at=run.peak_running_at,
        replicas=run.replica_report(),
        quotas=run.quotas,
        dispatch_log=run.dispatch_log,
        reserved_p0=0.0 if arm.policy is None else arm.policy.dispatcher.reserved.p0,
    )
