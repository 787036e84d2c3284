"""What the core keeps per backend: its limiter, in-flight counts and last metrics."""

from __future__ import annotations

from typing import TYPE_CHECKING

from sluice.core.bounded_outputs import block_pad
from sluice.core.early_head import EarlyHead
from sluice.core.kv_budget import SharedRoom
from sluice.core.limiters import Limiter
from sluice.core.types import BackendMetrics

if TYPE_CHECKING:
    from sluice.core.request_record import RequestRecord


class BackendState:
    __slots__ = (
        "block_pad",
        "bound_tokens",
        "bounded",
        "cap_low",
        "ceiling",
        "ceiling_low",
        "congestion",
        "counted_inflight",
        "counted_limit",
        "cut_seen",
        "early_head",
        "healthy",
        "inflight",
        "inflight_by_class",
        "inflight_tokens",
        "kv_bound_peak",
        "kv_bound_stale",
        "kv_budget",
        "kv_capacity",
        "kv_peak",
        "kv_peak_stale",
        "kv_shared",
        "last_metrics",
        "left",
        "limit",
        "limiter",
        "metrics_fresh",
        "models",
        "name",
        "p0_refill",
        "pipelined",
        "pipelined_tokens",
        "prefill_budget",
        "prefill_tokens",
        "records",
        "removed",
        "scraped",
        "shuffled",
        "tie",
    )

    def __init__(self, name: str, limiter: Limiter) -> None:
        self.name = name
        self.limiter = limiter
        self.healthy = True
        self.models: frozenset[str] = frozenset()  # empty = serves any model
        self.inflight = 0
        self.inflight_by_class = [0, 0, 0]  # by priority (the `slo` limiter reads it)
        self.inflight_tokens = 0
        # the in-flight requests (core/kv_projection.py reads their progress)
        self.records: dict[str, RequestRecord] = {}
        # the KV they will hold at their joint peak (kv_projection), and whether a request
        # left since it was computed (a dispatch adds its cost: an upper bound)
        self.kv_peak = 0.0
        self.kv_peak_stale = False
        # The same at the requests' bounds (core/bounded_outputs.py: every request at its
        # max_tokens, its KV rounded up a block), the sum of their bounds (before the
        # rounding) and whether the in-flight requests' outputs are bounded (that sum
        # close to their estimates).
        self.kv_bound_peak = 0.0
        self.kv_bound_stale = False
        self.bound_tokens = 0.0
        self.bounded = False
        self.block_pad = block_pad(None)  # the engine's block size - 1, once a scrape said
        # prompt tokens of in-flight requests without a first token (of those whose first
        # token the gateway sees: a non-streamed answer's prefill is not known to end)
        self.prefill_tokens = 0.0
        self.prefill_budget: float | None = limiter.prefill_budget_tokens
        # prefill-only requests in flight as a pipeline (core/prefill_pipeline.py) and their
        # prompt tokens: what the engine's queue and KV show of them by design
        self.pipelined = 0
        self.pipelined_tokens = 0.0
        self.limit = limiter.limit  # cached after every limiter call
        self.cap_low = -1  # slots P1/P2 may use (the dispatcher computes it)
        # The in-flight counts below which P0 and P1/P2 may be placed: the limit and
        # cap_low, or past them while the outputs are bounded (the dispatcher's rule).
        self.ceiling = self.limit
        self.ceiling_low = -1
        # Where the limit fell below the in-flight count: the count P0 may refill to (0:
        # none, core/p0_refill.py), and the limiter's last cut the dispatcher has seen.
        self.p0_refill = 0
        self.cut_seen = limiter.last_cut_at
        self.kv_budget: float | None = limiter.kv_budget_tokens
        # other replicas use the backend too: its room as the last scrape showed it
        self.kv_shared: SharedRoom | None = limiter.kv_shared
        # The KV cache's size in tokens, once a scrape told it (kept while metrics are
        # stale: it does not change); None = unknown.
        self.kv_capacity: float | None = None
        self.last_metrics: BackendMetrics | None = None
        self.metrics_fresh = False
        # whether a stream's head may go before its first event (core/early_head.py)
        self.early_head = EarlyHead()
        # a scrape round has answered for it (metrics, or none: then latency-only control)
        self.scraped = False
        self.removed = False  # dropped by set_backends while requests were in flight
        # The last tie-break between backends equally loaded by our count: the name when
        # alone; on a shared backend `shuffled`, this replica's own order of the backends
        # (core/dispatcher.py, "Backend choice").
        self.tie = name
        self.shuffled = name
        self.congestion: float | None = None  # from the last fresh scrape (pressure.B)
        # What this backend adds to the dispatcher's totals (for O(1) pressure).
        self.counted_inflight = 0
        self.counted_limit = 0
        # requests of ours that left since the last fresh scrape: it may still show them
        # (an abort the engine has not processed yet), they are not another replica's
        self.left = 0

    def serves(self, model: str) -> bool:
        return not self.models or model in self.models
