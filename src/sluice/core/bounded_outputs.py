"""Requests whose outputs are bounded: when the KV budget's margin is not needed.

The KV budget (core/kv_budget.py) lets the in-flight requests' projected peak reach only
`fraction` (0.8) of a backend's cache, because a request's output is an estimate (its
tenant's recent outputs, or half its `max_tokens` before one has ended) and an engine that
runs out of KV preempts. No request generates past its `max_tokens` (per sequence), so its
KV never exceeds its *bound*: prompt + sequences x max_tokens, plus up to a block's worth
of rounding (the engine allocates whole blocks: 16 tokens on vLLM's GPU backend, 128 on
its CPU backend, `BackendMetrics.block_size`).

When the gateway expects the requests in flight on a backend to run to about their bounds
(their bounds before block rounding sum to at most `BOUND_SLACK` x their estimated
footprints: forced-length answers, short classifications, `ignore_eos` benchmarks), the
margin is room the engine could use and that nothing can take: the dispatcher then lets a
request go past the budget, and past the limit's KV cap in requests up to the limiter's
own latency limit, when the in-flight requests' projected peak at their bounds plus the
new request's bound fits the cache (P0) or `low_share` of it (P1/P2). Whatever they
generate, they cannot preempt, as far as their progress is estimated right (from each
one's first token and the backend's TPOT: the projection's one estimate; a host that
stalls makes it wrong, which is why nothing is lifted for `CALM_S` after a cut). Where
outputs run far under `max_tokens` (most production chat) the bounds are loose and the
budget decides as before: there the KV cap in requests also holds the batch where the
engine's first tokens stay fast (the H100 scenarios' P0 fell when it was lifted for them;
docs/limiter.md, "Bounded outputs").

Pure: no clock, no I/O.
"""

from __future__ import annotations

# Bounds within this factor of the estimated footprints count as the outputs' own length:
# an estimate a little short of max_tokens (the tenant's mean output while one request of
# ten stopped early) fits under it; a tenant's cold start (half of max_tokens expected)
# does not (its bound is 1.2-2 x its estimate), nor does chat with a generous max_tokens.
BOUND_SLACK = 1.15

# Only while the limiter has not cut for this long: a cut says latency, not KV, holds the
# batch now (a busy host's slow first tokens: on `sluice bench cpu-host` the few P1/P2
# requests let past their count cost P0 its objective, 88 -> 80 % on seed 1), and the
# latency limit above the KV cap has not been tried at the counts it allows.
CALM_S = 10.0

# The block size assumed of an engine that does not report its own (vLLM's GPU default).
DEFAULT_BLOCK_SIZE = 16


def block_pad(block_size: int | None) -> float:
    """The most a request's KV is rounded up by: all but one token of a block."""
    return float((block_size or DEFAULT_BLOCK_SIZE) - 1)


def bound_output(max_tokens: int, sequences: int) -> float:
    """The most tokens a request can generate."""
    return float(max(1, sequences) * max_tokens)


def outputs_bounded(bounds: float, estimates: float) -> bool:
    """The in-flight requests' bounds (their sum) are close enough to the gateway's
    estimates of their footprints that the estimates are the outputs' own length."""
    return 0.0 < bounds <= BOUND_SLACK * estimates


def low_share(reserved_p0: float) -> float:
    """The part of the cache P1/P2 may fill at their bounds: P0 keeps a quarter more of it
    than its reserve of the slots (`reserved.p0`), since a P0 request arriving must find
    room for its whole bound, not its average (measured on `sluice bench flood`: at
    1 - reserved.p0 P0 lost 2 points against today, at 1 - 1.5 x reserved.p0 the engine
    ran 87 % of its sweet spot against 90 %; docs/bench.md)."""
    return max(0.0, 1.0 - 1.25 * reserved_p0)
