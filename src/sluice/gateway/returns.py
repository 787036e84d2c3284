"""Booking tokens: how a 429 tells its client which return slot is its, and how the
gateway recognises the return (docs/overload.md, "Retry-After").

A refusal that booked a slot (core/return_slots.py) answers `X-Sluice-Booking: TOKEN`;
the SDK sends it back on the retry. The token is

    <booking id>.<class>.<due, Unix ms>.<HMAC-SHA256 of id, class, tenant and due, 16 bytes>

signed with a secret: the one the environment variable named by `retryAfter.secretEnv`
holds (shared by every replica, so that a return is recognised by whichever replica it
lands on), else the one `sluice serve --workers` hands its workers, else a random key of
this process. The tenant is in the MAC, not in the token: a token is worth nothing to
another tenant. A token this process cannot verify (another secret, altered, another
tenant or class) is no claim at all: the request is a fresh arrival. One of another
replica carries its due time: that replica's booking is honoured here if it comes back
in its slot (this replica's ledger does not hold it; see the replicas part of the doc).

The request path calls two methods, and nothing else of return slots: `return_claim`
(the request's headers in; the booking it claims and its slot on the core's clock out, for
`RequestInfo`) and `refusal_headers` (a refusal the core answered in; the headers its 429
adds out).
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import time
from collections.abc import Callable, Mapping

from sluice.core.types import Admission, Rejection

BOOKING_HEADER = "X-Sluice-Booking"
WINDOW_HEADER = "X-Sluice-Retry-Window-Ms"
SECRET_ENV = "SLUICE_BOOKING_SECRET"  # what `sluice serve --workers` gives its workers
_MAC_BYTES = 16
_MAX_TOKEN = 200


def booking_secret(secret_env: str | None) -> bytes:
    """The signing key: the policy's shared secret, else the workers' one, else random."""
    for name in (secret_env, SECRET_ENV):
        if name:
            value = os.environ.get(name)
            if value:
                return value.encode()
    return secrets.token_bytes(32)


class BookingTokens:
    def __init__(
        self,
        secret: bytes,
        core_now: Callable[[], float],
        wall_now: Callable[[], float] = time.time,
    ) -> None:
        self._secret = secret
        self._core_now = core_now
        self._wall_now = wall_now

    def _mac(self, booking: str, priority: int, tenant: str, due_ms: int) -> str:
        msg = f"{booking}|{priority}|{tenant}|{due_ms}".encode()
        return hmac.new(self._secret, msg, hashlib.sha256).hexdigest()[: 2 * _MAC_BYTES]

    def issue(self, booking: str, priority: int, tenant: str, retry_after_s: float) -> str:
        """The token of a booking whose client is due back in `retry_after_s`."""
        due_ms = round((self._wall_now() + retry_after_s) * 1000)
        return f"{booking}.{priority}.{due_ms}.{self._mac(booking, priority, tenant, due_ms)}"

    def refusal_headers(
        self, refusal: Admission | Rejection, priority: int, tenant: str
    ) -> dict[str, str]:
        """What a refusal that booked a return slot adds to its 429: the token to send
        back and the window to spread the return over (none for a refusal without one)."""
        if refusal.booking is None:
            return {}
        token = self.issue(refusal.booking, priority, tenant, refusal.retry_after_s)
        return {BOOKING_HEADER: token, WINDOW_HEADER: str(round(refusal.retry_window_s * 1000))}

    def return_claim(
        self, headers: Mapping[str, str], tenant: str, priority: int
    ) -> tuple[str | None, float | None]:
        """The booking a request claims and its due time on the core clock, or (None,
        None) when it claims none this gateway can verify."""
        token = headers.get(BOOKING_HEADER)
        if token is None or len(token) > _MAX_TOKEN:
            return None, None
        parts = token.strip().rsplit(".", 3)
        if len(parts) != 4 or not parts[1].isdigit() or not parts[2].isdigit():
            return None, None
        booking, prio, due, mac = parts
        if int(prio) != priority:
            return None, None
        due_ms = int(due)
        if not hmac.compare_digest(mac, self._mac(booking, priority, tenant, due_ms)):
            return None, None
        return booking, self._core_now() + (due_ms / 1000.0 - self._wall_now())
