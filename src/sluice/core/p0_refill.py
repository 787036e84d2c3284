"""P0 through a fall of the limit: it refills what ends instead of waiting for the new limit.

When a backend's limit falls below its in-flight count, nothing is placed there until
enough requests have ended. Where the fall is about the KV cache (the KV cap on the count,
budget / footprint, falls as longer requests are admitted or dispatched; or a `kv` cut at a
usage of 0.9), that wait is the one P0 cannot afford: on a tiny engine whose few slots end
about 4 times a second (`burst --real-size` seed 1, virtual time) each of P0's 3 misses in
76 was a request held 0.85-0.93 s behind a `kv` cut from 18 to 13 with 16 in flight, then
served in 0.2 s; on the real burst P0 queued while the KV cap held the limit 3-6 below.

So P0 (and what has P0's rights: an aged P1 turn) may still be placed while the backend
runs fewer than the count the fall found: it replaces a request that ended, one for one,
and never adds to the count; P1/P2 wait for the new limit (their `cap_low`), so the count
still comes down at the rate they would have refilled it. P0's KV budget is checked per
request as always. The refill ends once the count is within the limit, and at any cut
for latency or congestion (first tokens, TPOT, the engine queueing, a preemption): those
say the engine is too busy for P0's own objective, which a refill would keep it.
Backends other replicas share are left to their claims (core/kv_budget.py).

Measured (docs/bench.md, "P0 through a fall of the limit"): the real burst's P0 96-97 % ->
100 %, 0 preemptions; virtual time `burst --real-size` seeds 1-3 96.0 / 96.2 / 88.0 % ->
100 % each.

Pure: no clock, no I/O.
"""

from __future__ import annotations

from sluice.core.limiters.base import KV_CUT


def refill_to(
    refill: int, inflight: int, limit_before: int, limit: int, cut_reason: str | None
) -> int:
    """The count P0 may refill to after the limiter was read again (0: none): `refill`
    the one so far, `cut_reason` the reason of a cut made since the last reading (None:
    no cut)."""
    if cut_reason is not None and cut_reason != KV_CUT:
        return 0
    if limit < limit_before and inflight > limit:
        return max(refill, inflight)
    return refill
