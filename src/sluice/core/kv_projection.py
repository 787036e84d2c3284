"""The KV a backend's in-flight requests will need at their joint peak.

A request holds its prompt's KV from its prefill on and one more token's per token it
generates, until it ends and frees it all. `cost` (prompt + expected output) is what it
holds at its end; summed over the requests in flight it is what they would hold if they
all ended at once. Requests that started at different times end at different times: the
ones that end first free their KV before the others reach their end. With `current` the
KV a request holds now and `remaining` the tokens it has left to generate, at a time t
ahead the requests still running hold

    P(t) = sum over {i: remaining_i >= t} of (current_i + t)

which grows between two ends and drops at each; its maximum over t >= 0 is at t = 0 or
just before an end, t = remaining_k:

    peak = max(sum_i current_i, max_k sum over {i: remaining_i >= remaining_k} of
               (current_i + remaining_k))

(all starting together, the requests' ends coincide and the peak is the sum of their
costs, as before). A request sent now counts its whole cost on top of the peak: an upper
bound of the new peak, since it holds at most its cost at any time.
"""

from __future__ import annotations

from collections.abc import Iterable


def projected_peak(requests: Iterable[tuple[float, float]]) -> float:
    """The peak over time ahead of the KV held by requests given as (current, remaining)
    tokens, each running until it has generated its remaining tokens."""
    items = sorted(requests, key=lambda cr: cr[1], reverse=True)
    peak = 0.0
    held = 0.0  # current KV of the requests with remaining >= the one being looked at
    for count, (current, remaining) in enumerate(items, 1):
        held += current
        at_end = held + count * remaining
        if at_end > peak:
            peak = at_end
    return max(peak, held)
