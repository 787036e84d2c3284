"""A fleet of gateway replicas in virtual time: how the harness spreads clients over
them, what each replica's clock and scrapes look like, and how replicas are replaced.

Kubernetes runs Sluice as a Deployment behind a Service (deploy/k8s/deployment.yaml):
  * The Service spreads new connections over the ready replicas: kube-proxy's iptables
    mode picks one at random; its IPVS mode (and Envoy's least-request) can pick the one
    with the fewest open connections (`balance`: random, least-connections, or
    round-robin for tests that want no draw at all). A connection here is a request:
    the clients send one request per connection (streams).
  * Each replica runs on its own machine: its monotonic clock has its own origin
    (`clock_skew_s`: each replica's clock is offset by a seeded draw in +-skew), and its
    scrape loop (gateway/backend_pool.py `_scrape_loop`) gathers one answer per backend,
    then sleeps `scraper.interval`: a round takes as long as its slowest answer
    (`scrape_lag`, a lognormal round trip per backend and round); the state read is each
    engine's as of the round's start (its last completed step), applied when the round's
    slowest answer is in.
  * With `known_peers`, each replica knows how many replicas are live (Redis's count of
    the gateway processes sharing the quotas), so its fleet share is 1/N
    (core/fleet_share.py); without it, each estimates its share from the scrapes.
  * With `quota_store` (`bench.quota_store.StoreSpec`), the tenants' quotas are shared
    through one store (Redis) with a round trip per call, lost and back as it says; each
    replica charges it as `sluice serve` does and goes local while it is lost
    (`bench.fleet_quotas`). Without it, each replica holds every quota on its own (the
    in-process quotas of a `sluice serve` without `redis:`).
  * A rolling update (`RollingRestart`, maxSurge 1 / maxUnavailable 0 as the manifest
    says) replaces the replicas one after another, `every` seconds: the new one starts
    cold (fresh limiters and queues) and takes traffic at once (ready when a backend is
    healthy); the old one leaves the Service's endpoints `propagation` later (kube-proxy
    catching up), runs its preStop sleep, then gets SIGTERM and drains as `sluice serve`
    does (gateway/serve_cmd.py): nothing new (a straggler gets 503 `shutting_down`),
    its queued requests handed back at once (503 `shutting_down`, retried on another
    replica: `Controller.hand_over`), running requests go on for `server.shutdownGrace`;
    what is left then is cut (the client sees its connection closed and retries as it
    does after a failure).
"""

from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from sluice.bench.noise import Jitter
from sluice.bench.quota_store import Outage, StoreSpec
from sluice.core.clock import FakeClock

if TYPE_CHECKING:
    from sluice.bench.harness import ArmRun, ArmSpec
    from sluice.bench.scenario import FleetSection, QuotaStoreSection

BALANCES = ("round-robin", "random", "least-connections")


@dataclass(frozen=True)
class RollingRestart:
    """Replace every replica once, one after another (module docstring)."""

    at: float  # the first replacement starts
    every: float = 10.0  # the next one this long after
    propagation: float = 1.0  # the Service stops sending to the old one this long after
    pre_stop: float = 10.0  # SIGTERM this long after the replacement started
    grace: float = 30.0  # server.shutdownGrace: then what is left is cut

    def __post_init__(self) -> None:
        if min(self.every, self.propagation, self.pre_stop, self.grace) < 0:
            raise ValueError("rolling restart times must be >= 0")
        if self.propagation > self.pre_stop:
            raise ValueError("the endpoints must be gone before SIGTERM (propagation <= preStop)")


@dataclass(frozen=True)
class FleetSpec:
    """How the replicas of a gateway arm are run (module docstring); the count itself is
    `ArmSpec.replicas`, the scrape interval `ArmSpec.scrape_interval_s`."""

    balance: str = "round-robin"
    scrape_lag: Jitter | None = None  # None: answers at once (the state of the instant)
    clock_skew_s: float = 0.0
    restart: RollingRestart | None = None
    known_peers: bool = False  # each replica is told the live count (Redis's)
    quota_store: StoreSpec | None = None  # tenant quotas shared through Redis

    def __post_init__(self) -> None:
        if self.balance not in BALANCES:
            raise ValueError(f"balance must be one of {', '.join(BALANCES)}")
        if self.clock_skew_s < 0:
            raise ValueError("clock skew must be >= 0")


class ReplicaClock:
    """One replica's monotonic clock: the run's virtual time plus its own origin."""

    __slots__ = ("_base", "offset")

    def __init__(self, base: FakeClock, offset: float) -> None:
        self._base = base
        self.offset = offset

    def now(self) -> float:
        return self._base.now() + self.offset

    def at(self, t: float) -> float:
        """Virtual time `t` on this clock."""
        return t + self.offset


class Balancer:
    """The Service: which ready replica gets a new client connection."""

    def __init__(self, kind: str, seed: int) -> None:
        if kind not in BALANCES:
            raise ValueError(f"balance must be one of {', '.join(BALANCES)}")
        self.kind = kind
        self._rng = random.Random(f"{seed}/balancer")
        self._next = 0

    def pick(self, ready: list[int], connections: list[int]) -> int:
        """One of `ready` (replica indexes, never empty); `connections[i]`: replica i's
        open client connections."""
        if self.kind == "round-robin":
            k = ready[self._next % len(ready)]
            self._next += 1
            return k
        if self.kind == "random":
            return ready[self._rng.randrange(len(ready))]
        fewest = min(connections[k] for k in ready)
        tied = [k for k in ready if connections[k] == fewest]
        return tied[0] if len(tied) == 1 else tied[self._rng.randrange(len(tied))]


# the arm that runs a fleet scenario with one gateway of the fleet's combined capacity
ONE_GATEWAY = "one-gateway"


def fleet_arm(
    arm: ArmSpec,
    section: FleetSection,
    *,
    replicas: int | None = None,
    scrape_interval_s: float | None = None,
    balance: str | None = None,
) -> ArmSpec:
    """A gateway arm as the scenario's fleet (`fleet:`), with the command line's
    overrides. The direct arm and the peers stay as they are (one process each);
    `one-gateway` is one replica with the fleet's scrapes and clock but no restart."""
    if arm.policy is None or arm.gateway is not None:
        return arm
    lag = section.scrape_lag
    restart = section.rolling_restart
    one = arm.name == ONE_GATEWAY
    store = section.quota_store
    spec = FleetSpec(
        balance=balance or section.balance,
        scrape_lag=Jitter(lag.p50, lag.p99) if lag is not None else None,
        clock_skew_s=section.clock_skew,
        known_peers=section.known_peers and not one,
        # one gateway holds the quotas in process: exact, never lost
        quota_store=None if store is None or one else store_spec(store),
        restart=None
        if restart is None or one
        else RollingRestart(
            at=restart.at,
            every=restart.every,
            propagation=restart.propagation,
            pre_stop=restart.pre_stop,
            grace=restart.grace,
        ),
    )
    return dataclasses.replace(
        arm,
        replicas=1 if one else (replicas or section.replicas),
        scrape_interval_s=scrape_interval_s or section.scrape_interval or arm.scrape_interval_s,
        fleet=spec,
    )


def store_spec(section: QuotaStoreSection) -> StoreSpec:
    """The scenario's `fleet.quotaStore` as the store's spec."""
    rt = section.round_trip
    return StoreSpec(
        round_trip_s=rt.p50,
        round_trip=Jitter(rt.p50, rt.p99) if rt.p99 > rt.p50 else None,
        outages=tuple(
            Outage(o.at, o.back, failure=o.failure, wiped=o.wiped) for o in section.outages
        ),
    )


def fleet_results(run: ArmRun, arm: ArmSpec) -> dict[str, Any]:
    """What results.json says of a gateway arm's replicas and engines."""
    spec = arm.fleet or FleetSpec()
    peak = max(run.peak_running, default=0)
    at = run.peak_running_at[run.peak_running.index(peak)] if run.peak_running else 0.0
    restarted = [r for r in run.replicas if "replaced_at" in r]
    drain: dict[str, int] = {}
    for r in restarted:
        for stage in ("open_at_removal", "open_at_sigterm", "cut_at_exit"):
            for what, n in r.get(stage, {}).items():
                key = f"{stage.removeprefix('open_')}_{what}"
                drain[key] = drain.get(key, 0) + n
    return {
        "replicas": arm.replicas,
        "balance": spec.balance,
        "scrape_interval_s": arm.scrape_interval_s,
        "scrape_lag": None
        if spec.scrape_lag is None
        else {"p50_s": spec.scrape_lag.p50_s, "p99_s": spec.scrape_lag.p99_s},
        "clock_skew_s": spec.clock_skew_s,
        "known_peers": spec.known_peers,
        "peak_running": peak,
        "peak_running_at_s": round(at, 3),
        "peak_running_per_backend": run.peak_running,
        "rolling_restart": None
        if spec.restart is None
        else {**dataclasses.asdict(spec.restart), "replaced": len(restarted), **drain},
        "replica_log": run.replicas,
    }
