"""Values that cross the line between the core (decisions) and its drivers: the gateway's
HTTP shell and the discrete-event simulation. Plain dataclasses, no behaviour, treated as
values: nobody changes one after it is made. Those made per request or per token are not
`frozen` (a frozen dataclass costs about five times as much to create)."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum


class RejectCode(StrEnum):
    """Why a request was refused; sent as the `code` of the OpenAI-shaped 429 body."""

    QUEUE_FULL = "queue_full"
    QUEUE_TIMEOUT = "queue_timeout"
    SHED_ON_PRESSURE = "shed_on_pressure"
    FAST_REJECT = "fast_reject"
    TENANT_QUOTA = "tenant_quota"
    # Refused, and the earliest room forecast for it is past the client's own deadline:
    # no Retry-After would help (answered 429 without one, `x-should-retry: false`).
    CANNOT_SERVE_IN_TIME = "cannot_serve_in_time"
    # No healthy backend serves the model (answered 503, not 429).
    NO_BACKEND = "no_backend"
    # Queued when this gateway began to shut down: handed back to be retried on another
    # replica at once (answered 503, as a request arriving during the shutdown).
    SHUTTING_DOWN = "shutting_down"
    # The prompt is larger than the KV cache of every backend serving the model: it can
    # never run anywhere (answered 400, not retried).
    TOO_LARGE = "context_length_exceeded"


@dataclass(slots=True)
class RequestInfo:
    """What the core knows of a request when it arrives."""

    request_id: str
    tenant: str
    priority: int  # 0 = P0 realtime-interactive, 1 = P1 agent-workflow, 2 = P2 batch
    model: str
    prompt_tokens: int  # the shell's estimate from the request text
    max_tokens: int  # what the request may generate at most (policy default when unset)
    # Sequences the engine runs for it (n, best_of, a list of prompts): each generates up
    # to max_tokens; the prompt estimate covers all of their prompts.
    sequences: int = 1
    weight: float = 1.0  # the tenant's share within its class
    # Absolute time (core clock) after which the client will not wait; None = no deadline.
    client_deadline: float | None = None
    feature: str | None = None
    retry_attempt: int = 0  # from X-Sluice-Retry / x-stainless-retry-count
    # A return: the booking a 429 gave this request (its id), and the slot it was given
    # (core clock) when a signed token says so; None: look the booking up in this core's
    # ledger (a slot from a token lets another replica's booking be recognised).
    booking: str | None = None
    booked_slot: float | None = None
    # Absolute time (core clock) after which the client wants no answer at all
    # (X-Request-Timeout, X-Stainless-Timeout): a Retry-After never points past it.
    # None: client_deadline.
    give_up_at: float | None = None
    # The shell sees the first token (a stream). A non-streamed answer arrives whole at the
    # end: no first-token time to measure, so no overdue-first-token alarm either (its
    # length would look like a TTFT that never came).
    first_token_visible: bool = True
    # Prefill-only (embeddings, rerank, score, classify): it holds KV for its prompt only
    # and finishes in the step that computes it, generating nothing; its whole time is
    # its time to first token.
    prefill_only: bool = False
    # It must run on this backend (a continuation of a response stored there); None: any.
    backend: str | None = None


@dataclass(slots=True)
class Admission:
    """The answer to `arrive`: admitted (queued, or placed at once: its assignment comes
    in a later step) or rejected at once. With `arrive(..., take=True)`, a request placed
    on arrival comes back with its assignment here instead of in the next step."""

    admitted: bool
    code: RejectCode | None = None
    retry_after_s: float = 0.0  # when rejected: the estimated time until there is room
    assignment: Assignment | None = None
    # When rejected with a booked return slot: its id (the client sends it back) and the
    # window after the Retry-After over which the client should spread its return.
    booking: str | None = None
    retry_window_s: float = 0.0

    @staticmethod
    def ok() -> Admission:
        return Admission(admitted=True)


@dataclass(slots=True)
class Assignment:
    """A queued request that may now go to `backend`."""

    request_id: str
    backend: str
    queued_s: float  # time it spent in the queue
    # a stream's head may be relayed before its first event (core/early_head.py)
    early_head: bool = False


@dataclass(slots=True)
class Rejection:
    """A queued request the core has dropped (timeout, or its client will not wait)."""

    request_id: str
    code: RejectCode
    retry_after_s: float
    queued_s: float
    booking: str | None = None  # as in Admission
    retry_window_s: float = 0.0


class Outcome(StrEnum):
    OK = "ok"  # completed (finish_reason stop or length)
    ERROR = "error"  # backend error or stream cut: counts as a congestion drop
    TIMEOUT = "timeout"  # upstream deadline hit: counts as a congestion drop
    CANCELLED = "cancelled"  # the client went away: no latency signal
    OVERLOADED = "overloaded"  # the backend refused it (503, or vLLM's SSE error event)
    CLIENT_ERROR = "client_error"  # the backend refused it as invalid (4xx): no signal


# The signals a backend's metrics may carry (BackendMetrics.signals names them).
SIGNALS = ("running", "waiting", "kv_usage", "kv_capacity", "preemptions", "ttft_p95", "tpot_p95")


@dataclass(frozen=True, slots=True)
class BackendMetrics:
    """One scrape of a backend's metrics, as its engine's adapter read them (the gateway's
    `sluice.gateway.engines`). Fields the backend does not export are None."""

    at: float  # core-clock time of the scrape
    running: float | None = None
    waiting: float | None = None
    kv_usage: float | None = None  # 0..1
    preemptions_total: float | None = None
    num_gpu_blocks: int | None = None
    block_size: int | None = None
    ttft_p95_s: float | None = None  # over the last scrape window, from histogram deltas
    tpot_p95_s: float | None = None
    # KV capacity in tokens when the engine states it otherwise than as blocks x block size
    # (SGLang's max_total_num_tokens, llama.cpp's context, TGI's max_batch_total_tokens).
    kv_capacity_tokens: float | None = None
    # The capacity is derived from rounded figures (SGLang 0.4's used tokens over a usage
    # rounded to 2 decimals): good enough for the KV budget's fraction, not for refusing a
    # request as larger than the cache or for filling the cache to its last token.
    kv_capacity_estimated: bool = False
    # Requests the engine accepts at once before it refuses more (TGI's
    # max_concurrent_requests): the limit never goes above it.
    max_concurrency: int | None = None
    engine: str | None = None  # which adapter read it (None: not said, e.g. virtual time)
    # Which of SIGNALS the engine exports (a latency histogram counts even when its window
    # had no sample); None: not said.
    signals: frozenset[str] | None = None
    # What core/prefill_pipeline.py's `engine_view` took out of `waiting` and `kv_usage` as
    # our own pipeline's (0: the scrape's own figures): the fleet's shared KV room, which
    # counts our requests apart, adds it back.
    set_aside_waiting: float = 0.0
    set_aside_kv_usage: float = 0.0

    @property
    def kv_capacity(self) -> float | None:
        """KV capacity in tokens, however the engine states it."""
        if self.kv_capacity_tokens:
            return self.kv_capacity_tokens
        if self.num_gpu_blocks and self.block_size:
            return float(self.num_gpu_blocks * self.block_size)
        return None


@dataclass(slots=True)
class Sample:
    """A latency observation for a backend's limiter."""

    ttft_s: float | None = None  # at the first token
    tpot_s: float | None = None  # at the end: (e2e - ttft) / (completion_tokens - 1)
    prompt_tokens: int = 0
    completion_tokens: int = 0
    inflight: int = 0  # requests in flight on the backend when the request was sent
    dropped: bool = False  # error or timeout: a congestion signal
    # First-token and pending samples: the prompt tokens of the requests sent to the
    # backend before this one that had no first token yet (the prefill it queued behind).
    prefill_ahead: float = 0.0
    # Its first token is overdue: `ttft_s` is the time waited so far, a lower bound.
    pending: bool = False
    # Core-clock time the request was sent to the backend: lets a limiter ignore samples
    # of requests sent before its last cut (they describe the old limit).
    sent_at: float | None = None
    # Whole-request time (send to last token). Set only on the end-of-request sample; a
    # sample with e2e_s None and ttft_s set is the first-token sample.
    e2e_s: float | None = None
    # The request's class, the time its client gave it from its arrival at the gateway
    # (X-Request-Timeout) when it said, and the tokens it may generate: the `slo` limiter
    # reads them.
    priority: int | None = None
    client_budget_s: float | None = None
    max_tokens: int | None = None
    # Seconds of host stalls taken out of its times (core/stall_log.py; 0: none). Its
    # corrected times may still count, but not toward a floor (the best TTFT per token,
    # the best TPOT): a correction that took too much would become that floor.
    stalled_s: float = 0.0
