"""Parse the server's advice on when to come back: `retry-after-ms` (preferred, exact) and
`Retry-After` (delta-seconds or an HTTP-date). Pure: the wall-clock time is passed in."""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from datetime import UTC
from email.utils import parsedate_to_datetime

# RFC 9110 delta-seconds are digits; a decimal fraction is accepted because servers send it.
_NUMBER = re.compile(r"\d+(\.\d+)?")


def parse_non_negative_seconds(value: str) -> float | None:
    """A plain non-negative decimal number, or None for anything else (signs, exponents,
    `inf`, `nan`, empty)."""
    text = value.strip()
    if not _NUMBER.fullmatch(text):
        return None
    number = float(text)
    return number if math.isfinite(number) else None


def _http_date_delay(value: str, wall_now: float) -> float | None:
    try:
        when = parsedate_to_datetime(value.strip())
    except (TypeError, ValueError, IndexError):
        return None
    if when.tzinfo is None:  # "-0000" parses as naive; HTTP-dates are always GMT
        when = when.replace(tzinfo=UTC)
    return max(0.0, when.timestamp() - wall_now)


def parse_retry_after(headers: Mapping[str, str], *, wall_now: float) -> float | None:
    """Seconds the server asks the client to wait, or None when it gave no usable advice.

    `headers` must look names up case-insensitively (httpx.Headers does). `retry-after-ms`
    wins when valid; a garbage value falls through to `Retry-After`. An HTTP-date in the past
    means 0. `wall_now` is Unix time (time.time()), used only for HTTP-dates.
    """
    millis = headers.get("retry-after-ms")
    if millis is not None:
        parsed = parse_non_negative_seconds(millis)
        if parsed is not None:
            return parsed / 1000.0
    value = headers.get("retry-after")
    if value is None:
        return None
    seconds = parse_non_negative_seconds(value)
    if seconds is not None:
        return seconds
    return _http_date_delay(value, wall_now)


# Sluice's 429 says over what window after the Retry-After its client should come back
# (the spacing of the return slots it hands out), in milliseconds.
WINDOW_HEADER = "x-sluice-retry-window-ms"


def parse_window(headers: Mapping[str, str]) -> float | None:
    """The server's return window in seconds, or None when it gave none (or garbage)."""
    value = headers.get(WINDOW_HEADER)
    if value is None:
        return None
    parsed = parse_non_negative_seconds(value)
    return None if parsed is None else parsed / 1000.0
