"""A backend's KV budget, and this replica's claim on it while other replicas use it too.

Any limiter may hold one (`SluiceLimiter` and `SloLimiter` do): it feeds it what it is told
(`on_dispatch`, `on_fleet`, `on_metrics`, `on_metrics_stale`, `on_kv_projection`) and reads
`tokens` (the budget the dispatcher checks per request), `shared` (the room and the draw
while the backend is shared) and `cap()` (the limit in requests the budget allows).
docs/limiter.md ("KV budget", "Shared backends") has the design and why.

  * The budget: when the backend reports its KV capacity (blocks x block size, or in
    tokens), the estimated KV tokens in flight may not exceed `fraction` of it.
  * The cap: the budget over a request's footprint, the larger of the EWMA of the requests
    dispatched here and of those being admitted for its models (`demand_footprint`: the
    mix that comes next). On a lone backend a request counts at the part of its footprint
    the in-flight requests' projected joint peak gives them (core/kv_projection.py), while
    the requests coming are no more than `MIX_TOLERANCE` x larger than those in flight.
  * Shared backends (several gateway replicas, each with its own limiters): on each
    fresh scrape the others' requests (running + waiting beyond our in-flight count) are
    counted at our mean footprint, and at least as the usage that is not ours; we claim
    our share of the room left within the budget: our part of the requests there, shrunk
    toward our part of the fleet (`fleet_share`, given before each scrape by `on_fleet`
    from core/fleet_share.py: our part of the requests the scrapes of all backends show,
    about 1/R for R replicas) by `fleet_prior_requests` pseudo-requests, so replicas claim
    it once between them, and an excess is handed back the same way. An idle backend is
    claimed by fleet share: R replicas sending a burst's first requests into it take its
    room once, not R times (a scrape shows the engine as of its last step, so none of
    them sees the others before the next one). Held until the next scrape: a request of
    ours that leaves frees its room to us at once, another replica's only when a scrape
    shows it gone. A claim is a part of a backend, a request is whole: a replica's claim
    is often less than one request (8 replicas on an engine of 10), so there is no
    minimum of one request per replica (R replicas would hold R, past a small engine's
    KV: `sluice bench fleet`'s preemptions); instead each fresh scrape draws u in [0, 1)
    (`shared.draw`) and a request past the claim's remainder r goes when u * cost < r and
    the room the scrape showed has it: with probability r / cost, so over the fleet the
    claims add up to the room in expectation, with at most one request per replica past
    its claim (the dispatcher, core/dispatcher.py). The cap in requests is then the
    claim over our footprint rounded up, not down (the budget decides). Without those
    metrics the budget is the whole fraction; a lone gateway (share 1) has it all.

Pure: nothing here reads a clock or does I/O; its one random generator is seeded.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from typing import NamedTuple

from sluice.core.ewma import Ewma
from sluice.core.types import BackendMetrics

# The KV cap counts requests at their projected part of a footprint (on_kv_projection)
# while those coming are no more than this much larger than those in flight.
MIX_TOLERANCE = 1.25


class SharedRoom(NamedTuple):
    """A backend shared with other gateway replicas, as the last fresh scrape showed it:
    `room_tokens`, the most estimated KV tokens of ours in flight it has room for (ours
    and the room the others leave; inf when it looked idle), `full_tokens` its whole
    budget, `draw`, this scrape's uniform draw in [0, 1) (the dispatcher's overdraft:
    a request past the remaining claim r goes when draw * cost < r, core/dispatcher.py),
    and `footprint_tokens`, a typical request's (what the draws' spread is kept for)."""

    draw: float
    room_tokens: float
    full_tokens: float
    floor_tokens: float = 0.0
    first_free: bool = False  # it looked idle and we know nothing of the fleet yet
    footprint_tokens: float = 0.0  # 0: not known yet


class KvBudget:
    __slots__ = (
        "_footprint",
        "_kv_mean",
        "_kv_ratio",
        "_rng",
        "capacity",
        "demand",
        "fleet_fresh",
        "fleet_prior_requests",
        "fleet_share",
        "fraction",
        "own_tokens",
        "shared",
        "tokens",
    )

    def __init__(
        self,
        fraction: float = 0.8,
        *,
        footprint_alpha: float = 0.5,
        fleet_prior_requests: float = 4.0,
        demand_footprint: Callable[[], float | None] | None = None,
        seed: int | str = 0,
    ) -> None:
        self.fraction = fraction
        self.fleet_prior_requests = fleet_prior_requests
        # the footprint of the requests being admitted for this backend (forward-looking)
        self.demand = demand_footprint
        self._footprint = Ewma(footprint_alpha)  # of the requests dispatched here
        # the in-flight requests' projected KV peak over the sum of their footprints
        # (core/kv_projection.py; 1 when they would all end at once)
        self._kv_ratio = 1.0
        self._kv_mean: float | None = None  # of the footprints in flight, when projected
        self._rng = random.Random(f"{seed}/fleet")
        self.capacity: float | None = None  # KV tokens, once a scrape told it
        # Estimated KV tokens this replica has in flight on the backend, our part of the
        # fleet of gateways in front of it (1: alone) and whether that part is a bare
        # prior (no count, no scrape evidence yet): set before each scrape (`on_fleet`).
        self.own_tokens = 0.0
        self.fleet_share = 1.0
        self.fleet_fresh = False
        # What the dispatcher reads after every limiter call: kept as plain values, set
        # when what they follow changes (a scrape), not computed per read.
        self.tokens: float | None = None  # the budget (None: capacity unknown)
        self.shared: SharedRoom | None = None  # the last fresh scrape's, when shared

    @property
    def footprint_dispatched(self) -> float | None:
        """The EWMA of the footprints of the requests dispatched here (for inspection)."""
        return self._footprint.value

    # -- inputs ----------------------------------------------------------------------

    def on_dispatch(self, footprint_tokens: int) -> None:
        self._footprint.update(float(footprint_tokens))

    def on_fleet(self, own_kv_tokens: float, share: float, share_fresh: bool) -> None:
        """Before each scrape (the limiter's `on_fleet`): ours in its usage, our part of
        the fleet, and whether that part rests on evidence."""
        self.own_tokens = own_kv_tokens
        self.fleet_share = share
        self.fleet_fresh = share_fresh

    def on_metrics(self, m: BackendMetrics, inflight: int) -> None:
        """A fresh scrape; `inflight`: our requests on the backend now."""
        capacity = m.kv_capacity
        if capacity:
            self.capacity = capacity
        claim = self._shared_room(m, inflight)
        if claim is None:
            self.shared = None
            self._set_tokens(None)
        else:
            self.shared = claim[1]
            self._set_tokens(claim[0])

    def on_metrics_stale(self) -> None:
        """The backend's metrics are unknown or too old: the whole budget (capacity is
        static), no claim."""
        self.shared = None
        self._set_tokens(None)

    def on_kv_projection(self, ratio: float, mean_footprint: float | None) -> bool:
        """The in-flight requests' projected peak ratio and mean footprint (the limiter's
        `on_kv_projection`); whether they changed (the cap may have)."""
        ratio = min(1.0, max(0.0, ratio))
        if ratio == self._kv_ratio and mean_footprint == self._kv_mean:
            return False
        self._kv_ratio = ratio
        self._kv_mean = mean_footprint
        return True

    def _set_tokens(self, claim: float | None) -> None:
        cap = self.capacity
        if cap is None:
            self.tokens = None
        else:
            self.tokens = cap * self.fraction if claim is None else claim

    # -- what it allows ----------------------------------------------------------------

    def cap(self) -> float:
        """The limit in requests the budget allows (inf: no budget, or no footprint yet)."""
        budget = self.tokens
        fp = self._footprint.value
        if self.demand is not None:
            ahead = self.demand()
            if ahead is not None and (fp is None or ahead > fp):
                fp = ahead
        # A request counts at the part of its footprint the in-flight ones' joint peak
        # gives them (their ends staggered: less than the whole), while the requests
        # coming are like those in flight; larger ones (a new mix) start together.
        ratio = 1.0
        if fp and self._kv_mean and fp <= MIX_TOLERANCE * self._kv_mean:
            ratio = self._kv_ratio
        if budget is None or not fp:
            return math.inf
        # shared: rounded up, for the overdraft past a claim of part of a request
        shared = self.shared
        if shared is None:
            return float(math.floor(budget / (fp * ratio)))
        return float(math.ceil(max(budget, shared.floor_tokens) / fp))

    def _shared_room(self, m: BackendMetrics, n: int) -> tuple[float, SharedRoom] | None:
        """Our claim on the backend (the KV budget) and its room while other replicas may
        use it too; None (the whole budget) for a lone gateway, or without metrics."""
        cap = self.capacity
        share = self.fleet_share
        if cap is None or m.kv_usage is None or m.running is None or share >= 1.0:
            return None
        # the engine as scraped: our pipeline's queue places and KV are ours here (n, own)
        waiting = (m.waiting or 0.0) + m.set_aside_waiting
        kv_usage = m.kv_usage + m.set_aside_kv_usage
        on_backend = m.running + waiting
        own = self.own_tokens
        # The footprint of a request: ours in flight, those we sent lately, those being
        # admitted; the largest (a replica holding one short request would count the
        # others' at its size).
        ahead = self.demand() if self.demand is not None else None
        per_request = max(own / n if n else 0.0, self._footprint.value or 0.0, ahead or 0.0)
        # Replicas that do not know of one another each take whole requests past their
        # fractional claims (the dispatcher's overdraft): R independent draws of at most
        # one request each, whose sum strays from the claims' by sqrt(R) / 2 requests (a
        # standard deviation); that much of the budget is kept back.
        margin = 0.5 * math.sqrt(1.0 / share) * per_request
        full = max(0.0, cap * self.fraction - margin)
        # The others' requests in footprints, as ours are counted (what they will hold
        # by their end, waiting ones included): by count at a request's footprint, and
        # at least the usage that is not ours.
        others = max(0.0, (on_backend - n) * per_request, kv_usage * cap - own)
        room = full - own - others
        # Our part of the claim on the room (negative: of the excess to give back): our
        # part of the requests there, shrunk toward our part of the fleet by
        # `fleet_prior_requests` pseudo-requests. On a busy backend that is what we hold;
        # on an idle one (or one with a few requests, whosever they are) it is our part
        # of the fleet: R replicas that all start sending into it at once claim its room
        # once, not R times. Over replicas whose fleet shares add up to 1 the shares add
        # up to 1.
        k = self.fleet_prior_requests
        part = (min(float(n), on_backend) + k * share) / (on_backend + k)
        claim = min(full, max(0.0, own + part * room))
        # P0's floor: our part of the fleet of the whole budget. Claims follow
        # holdings, so a replica that holds little (a replacement in a rolling update)
        # claims little of a busy backend; its P0 requests still get its share of it
        # (what it takes past the room the others leave, they give back at their next
        # scrapes: the room there is negative).
        floor = share * full
        idle = on_backend <= 0 and kv_usage <= 0
        room_tokens = math.inf if idle else own + room
        first = idle and self.fleet_fresh
        return claim, SharedRoom(self._rng.random(), room_tokens, full, floor, first, per_request)
