"""The core's record of one request, shared by the class queues, the dispatcher and the
controller. Every request id maps to exactly one record while it is queued or in flight;
once it leaves (served, dropped, cancelled) its record is forgotten."""

from __future__ import annotations

from enum import IntEnum
from typing import TYPE_CHECKING

from sluice.core.prefill_pipeline import kv_charge
from sluice.core.types import RequestInfo

if TYPE_CHECKING:
    from sluice.core.backend_state import BackendState


class RequestState(IntEnum):
    QUEUED = 0
    INFLIGHT = 1
    GONE = 2


class RequestRecord:
    __slots__ = (
        "backend",
        "bound_tokens",
        "cost",
        "deadline",
        "dispatched_at",
        "enqueued_at",
        "expected_output",
        "first_token_at",
        "held_since",
        "inflight_at_send",
        "info",
        "kv_tokens",
        "model",
        "pinned",
        "pipelined",
        "prefill_ahead",
        "priority",
        "prompt_est",
        "quota_outage",
        "quota_tokens",
        "refused_at",
        "request_id",
        "returning",
        "seq",
        "state",
        "tenant",
        "weight",
    )

    def __init__(
        self,
        info: RequestInfo,
        *,
        seq: int,
        now: float,
        prompt_est: float,
        expected_output: float,
        cost: int,
    ) -> None:
        self.info = info
        self.request_id = info.request_id
        self.priority = info.priority
        self.tenant = info.tenant
        self.model = info.model
        self.pinned = info.backend  # the backend it must run on, or None
        self.weight = info.weight
        self.deadline = info.client_deadline  # absolute client deadline, or None
        self.seq = seq  # arrival order, a tie-breaker for heaps
        self.enqueued_at = now
        self.prompt_est = prompt_est  # corrected prompt-token estimate
        self.expected_output = expected_output
        self.cost = cost  # estimated KV footprint in tokens: prompt + expected output
        # What it counts for in its backend's KV budget, set when it is sent there
        # (core/dispatcher.py, `_pipelines`); until then the least it may count for (a
        # prefill-only request's share of a two-step pipeline: core/prefill_pipeline.py),
        # and whether it went as part of such a pipeline.
        self.kv_tokens = kv_charge(cost, info.prefill_only)
        self.pipelined = False
        # the most KV it can hold (prompt + max_tokens), before the engine's block rounding
        # (set when sent: core/bounded_outputs.py)
        self.bound_tokens = 0.0
        self.quota_tokens = cost  # what the tenant's token quota was charged
        self.quota_outage = 0  # admitted locally while the shared quotas were lost: which loss
        self.state = RequestState.QUEUED
        self.backend: BackendState | None = None
        self.dispatched_at: float | None = None
        self.first_token_at: float | None = None
        self.inflight_at_send = 0  # the backend's in-flight count once this one was sent
        # prompt tokens of the requests on its backend still waiting for their first token
        # when this one was sent: the prefill work ahead of it
        self.prefill_ahead = 0.0
        self.returning = False  # it came back in its booked return slot
        self.refused_at: float | None = None  # ... booked by this refusal (its time)
        # when, at the head of its class, it first waited for a backend to empty for it
        self.held_since: float | None = None
