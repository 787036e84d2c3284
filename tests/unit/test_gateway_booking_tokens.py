"""Booking tokens: what a 429 hands its client, and what the gateway accepts back."""

from __future__ import annotations

import pytest

from sluice.core.types import Admission, RejectCode, Rejection
from sluice.gateway.returns import (
    BOOKING_HEADER,
    SECRET_ENV,
    WINDOW_HEADER,
    BookingTokens,
    booking_secret,
)


def tokens(secret: bytes = b"k", wall: float = 1000.0, core: float = 50.0) -> BookingTokens:
    return BookingTokens(secret, core_now=lambda: core, wall_now=lambda: wall)


def test_a_token_comes_back_as_the_booking_and_its_due_time_on_the_core_clock() -> None:
    t = tokens()
    token = t.issue("ab-7", 2, "batch", 4.25)
    assert token.startswith("ab-7.2.1004250.")
    booking, due = t.return_claim({BOOKING_HEADER: token}, "batch", 2)
    assert booking == "ab-7" and due == pytest.approx(54.25)
    # another process of the same gateway (same key), another clock: the same instant
    other = tokens(core=7.0)
    assert other.return_claim({BOOKING_HEADER: token}, "batch", 2)[1] == pytest.approx(11.25)


@pytest.mark.parametrize(
    ("tenant", "priority", "mutate"),
    [
        ("other-tenant", 2, lambda s: s),  # a token is worth nothing to another tenant
        ("batch", 1, lambda s: s),  # nor in another class
        ("batch", 2, lambda s: s.replace(".1004250.", ".1009250.")),  # a later slot
        ("batch", 2, lambda s: s[:-1] + ("0" if s[-1] != "0" else "1")),  # altered MAC
        ("batch", 2, lambda s: "x" * 300),
        ("batch", 2, lambda s: "no dots"),
    ],
)
def test_what_cannot_be_verified_claims_nothing(tenant: str, priority: int, mutate: object) -> None:
    t = tokens()
    token = mutate(t.issue("ab-7", 2, "batch", 4.25))  # type: ignore[operator]
    assert t.return_claim({BOOKING_HEADER: token}, tenant, priority) == (None, None)
    assert tokens(b"another key").return_claim(
        {BOOKING_HEADER: t.issue("ab-7", 2, "batch", 4.25)}, "batch", 2
    ) == (None, None)
    assert t.return_claim({}, "batch", 2) == (None, None)


def test_the_key_is_the_policys_shared_secret_else_the_workers_else_random(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("MY_SECRET", "shared")
    monkeypatch.setenv(SECRET_ENV, "workers")
    assert booking_secret("MY_SECRET") == b"shared"
    assert booking_secret(None) == b"workers"
    monkeypatch.delenv(SECRET_ENV)
    assert booking_secret(None) != booking_secret(None)  # a random key per process


def test_a_refusal_with_a_booking_hands_its_token_and_window_and_one_without_nothing() -> None:
    t = tokens()
    refused = Admission(
        admitted=False,
        code=RejectCode.FAST_REJECT,
        retry_after_s=4.25,
        booking="ab-7",
        retry_window_s=0.062,
    )
    h = t.refusal_headers(refused, 2, "batch")
    assert h[WINDOW_HEADER] == "62"
    assert t.return_claim(h, "batch", 2) == ("ab-7", pytest.approx(54.25))
    dropped = Rejection("r1", RejectCode.QUEUE_TIMEOUT, 3.0, 15.0, "ab-8", 0.5)
    assert t.return_claim(t.refusal_headers(dropped, 2, "batch"), "batch", 2)[0] == "ab-8"
    assert t.refusal_headers(Admission(False, RejectCode.QUEUE_FULL, 2.0), 2, "batch") == {}
