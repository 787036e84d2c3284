"""The one small interface every concurrency-limit algorithm implements.

A limiter belongs to one backend. The controller feeds it samples and scrapes and reads
`limit` (how many requests may be in flight on the backend) and, when the algorithm keeps a
KV budget, `kv_budget_tokens` (how many estimated KV tokens may be in flight).

Samples come in two kinds (see `Sample`): the first-token sample (`ttft_s` set, `e2e_s`
None), sent when the first token arrives, and the end sample (`e2e_s` set; `tpot_s` when
the request produced two tokens or more; `dropped` for errors, timeouts and backend
refusals). A cancelled request gives no end sample. First-token and pending samples carry
`prefill_ahead`: the prompt tokens of the requests sent to the backend before this one
that had no first token yet (the prefill work it queued behind).
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, Self

from sluice.core.kv_budget import SharedRoom
from sluice.core.settings import LimiterSettings, Objective
from sluice.core.types import BackendMetrics, Sample

# The reason of a cut on the KV cache's usage (`Limiter.last_cut_reason`): a cut about
# memory, not latency (core/p0_refill.py tells them apart).
KV_CUT = "kv"


@dataclass(frozen=True, slots=True)
class LimiterContext:
    """What a backend's limiter may ask of the controller, given to it when it is made
    (`make_limiter`) and again on each policy reload (`on_policy`); each algorithm takes
    what it needs. The defaults: a lone backend, without a controller (tests, tools)."""

    backend: str = ""
    seed: int | str = 0  # of its random draws (probe jitter), one per backend
    # the part of the limit P1/P2 may fill (1 - the reserved P0 share)
    usable_share: float = 1.0
    objectives: Mapping[int, Objective] = field(default_factory=dict)  # by priority
    # the footprint of the requests being admitted for its models (None: none yet)
    demand_footprint: Callable[[], float | None] | None = None
    classes_in_flight: Callable[[], Sequence[int]] | None = None  # its requests by priority


class Limiter(Protocol):
    @property
    def limit(self) -> int:
        """Requests allowed in flight on this backend (at least 1)."""
        ...

    @property
    def kv_budget_tokens(self) -> float | None:
        """Estimated KV tokens allowed in flight, or None for no token budget."""
        ...

    @property
    def prefill_budget_tokens(self) -> float | None:
        """Prompt tokens allowed in flight without their first token yet (the prefill
        the backend has queued), or None for no bound."""
        ...

    @property
    def kv_shared(self) -> SharedRoom | None:
        """The backend's room while other replicas use it too; None when alone."""
        ...

    @property
    def latency_limit(self) -> float | None:
        """The limit the latency control alone allows, before any KV cap (what requests
        with bounded outputs may fill up to, core/bounded_outputs.py), or None when the
        algorithm has no latency control of its own."""
        ...

    @property
    def last_cut_at(self) -> float:
        """When the limiter last cut its limit (-inf: never)."""
        ...

    @property
    def last_cut_reason(self) -> str:
        """Why it last cut (`KV_CUT`: the cache's usage; "": never, or no reason told)."""
        ...

    def on_sample(self, sample: Sample, now: float) -> None: ...

    def on_metrics(self, m: BackendMetrics, now: float) -> None: ...

    def on_metrics_stale(self, now: float) -> None:
        """The backend's metrics are unknown or too old: forget what they said."""
        ...

    def on_dispatch(self, inflight: int, footprint_tokens: int, now: float) -> None:
        """A request was sent; `inflight` is the backend's new in-flight count."""
        ...

    def on_release(self, inflight: int, now: float) -> None:
        """A request left (finished or cancelled); `inflight` is the new count."""
        ...

    def ttft_alarm_after(self, prefill_tokens: float) -> float | None:
        """Seconds after sending a request by which its first token is due, given the
        prompt tokens it waits for (its own plus the prefill ahead of it on the backend);
        past it the controller reports a pending-TTFT sample (a lower bound,
        `pending` set). None = no alarm."""
        ...

    def on_fleet(self, own_kv_tokens: float, share: float, share_fresh: bool) -> None:
        """Before each scrape reaches `on_metrics`: the estimated KV tokens this gateway
        has in flight on the backend (the rest of the scrape's usage is other replicas'),
        this gateway's part of the fleet (core/fleet_share.py; 1: alone) and whether that
        part rests on evidence rather than the bare prior."""
        ...

    @property
    def tpot_estimate_s(self) -> float | None:
        """The backend's time per output token now (what a running request's progress is
        estimated from, core/kv_projection.py), or None when the algorithm keeps none."""
        ...

    def on_kv_projection(self, ratio: float, mean_footprint: float | None) -> None:
        """The in-flight requests' projected KV peak over the sum of their footprints
        (core/kv_projection.py; 1 when they would all end at once) and their mean
        footprint (None: none in flight): a KV cap on the limit may count a request
        like them at that part of its footprint."""
        ...

    def on_policy(self, context: LimiterContext) -> None:
        """The policy was reloaded: what the controller now says (the usable share, the
        objectives; the limiter keeps its state)."""
        ...

    def describe(self) -> dict[str, object] | None:
        """The limiter's inner state for /admin/state, or None when it has none worth
        showing."""
        ...


class LimiterBase(ABC):
    """No-op defaults, so an algorithm only writes the callbacks it uses."""

    @classmethod
    def build(
        cls, settings: LimiterSettings, start: int, context: LimiterContext, **kwargs: Any
    ) -> Self:
        """One for a backend (`make_limiter`): the policy's bounds, `start` its initial
        limit (within them), what it needs of `context`; `kwargs` (tuning) override the
        context. Each algorithm of `ALGORITHMS` has its own."""
        raise TypeError(f"{cls.__name__} is not built from a policy")

    @property
    @abstractmethod
    def limit(self) -> int:
        """The number of requests the backend may have in flight now."""

    @property
    def kv_budget_tokens(self) -> float | None:
        return None

    @property
    def prefill_budget_tokens(self) -> float | None:
        return None

    @property
    def kv_shared(self) -> SharedRoom | None:
        return None

    @property
    def latency_limit(self) -> float | None:
        return None

    @property
    def last_cut_at(self) -> float:
        return -math.inf

    @property
    def last_cut_reason(self) -> str:
        return ""

    def on_sample(self, sample: Sample, now: float) -> None:
        return None

    def on_metrics(self, m: BackendMetrics, now: float) -> None:
        return None

    def on_metrics_stale(self, now: float) -> None:
        return None

    def on_dispatch(self, inflight: int, footprint_tokens: int, now: float) -> None:
        return None

    def on_release(self, inflight: int, now: float) -> None:
        return None

    def ttft_alarm_after(self, prefill_tokens: float) -> float | None:
        return None

    def on_fleet(self, own_kv_tokens: float, share: float, share_fresh: bool) -> None:
        return None

    @property
    def tpot_estimate_s(self) -> float | None:
        return None

    def on_kv_projection(self, ratio: float, mean_footprint: float | None) -> None:
        return None

    def on_policy(self, context: LimiterContext) -> None:
        return None

    def describe(self) -> dict[str, object] | None:
        return None


def request_rtt(sample: Sample) -> float | None:
    """The whole-request time of an end sample (`vegas-seed` and `gradient` read it).

    `e2e_s` if set, else ttft + tpot * (completion - 1). None for a first-token sample or
    when nothing is known.
    """
    if sample.e2e_s is not None:
        return sample.e2e_s
    if sample.ttft_s is not None and sample.tpot_s is not None and sample.completion_tokens:
        return sample.ttft_s + sample.tpot_s * (sample.completion_tokens - 1)
    return None
