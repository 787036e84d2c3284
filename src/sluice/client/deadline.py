"""How long the caller is prepared to wait in all, read from the request itself."""

from __future__ import annotations

import math
from collections.abc import Mapping

import httpx

from sluice.client.retry_after import parse_non_negative_seconds

# Headers by which a caller states its total time budget (seconds); the gateway reads them too.
DEADLINE_HEADERS = ("x-request-timeout", "x-stainless-timeout")


def request_time_budget(request: httpx.Request) -> float | None:
    """Seconds the caller allows for the whole call, or None when it set no limit.

    The smallest of: the read timeout httpx puts in `request.extensions["timeout"]` (the
    `timeout=` of an openai or httpx call; the read timeout is the one that bounds waiting
    for the answer) and the `X-Request-Timeout` / `X-Stainless-Timeout` headers.
    """
    candidates: list[float] = []
    timeouts = request.extensions.get("timeout")
    if isinstance(timeouts, Mapping):
        read = timeouts.get("read")
        if isinstance(read, int | float) and math.isfinite(read) and read > 0:
            candidates.append(float(read))
    stated = stated_budget(request)
    if stated is not None:
        candidates.append(stated)
    return min(candidates) if candidates else None


def stated_budget(request: httpx.Request) -> float | None:
    """The smallest of the deadline headers the caller set (the whole call's budget, which
    the retries state again as what is left of it), or None."""
    candidates: list[float] = []
    for name in DEADLINE_HEADERS:
        value = request.headers.get(name)
        if value is not None:
            seconds = parse_non_negative_seconds(value)
            if seconds is not None and seconds > 0:
                candidates.append(seconds)
    return min(candidates) if candidates else None
