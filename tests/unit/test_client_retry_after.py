"""Parsing of the server's wait advice: retry-after-ms, Retry-After seconds and HTTP-date."""

from __future__ import annotations

from datetime import UTC, datetime

import httpx
import pytest

from sluice.client import parse_retry_after

# 2025-01-01 00:00:00 UTC
WALL_NOW = datetime(2025, 1, 1, tzinfo=UTC).timestamp()


def parse(**headers: str) -> float | None:
    return parse_retry_after(
        httpx.Headers({k.replace("_", "-"): v for k, v in headers.items()}), wall_now=WALL_NOW
    )


def test_retry_after_ms_is_converted_to_seconds() -> None:
    assert parse(retry_after_ms="1500") == 1.5


def test_retry_after_ms_wins_over_retry_after() -> None:
    assert parse(retry_after_ms="250", retry_after="3") == 0.25


def test_header_names_are_case_insensitive() -> None:
    headers = httpx.Headers({"Retry-After-Ms": "40", "RETRY-AFTER": "9"})
    assert parse_retry_after(headers, wall_now=WALL_NOW) == 0.04


def test_garbage_retry_after_ms_falls_back_to_retry_after() -> None:
    assert parse(retry_after_ms="soon", retry_after="2") == 2.0


@pytest.mark.parametrize(
    ("value", "expected"), [("3", 3.0), (" 7 ", 7.0), ("0", 0.0), ("1.25", 1.25)]
)
def test_retry_after_seconds(value: str, expected: float) -> None:
    assert parse(retry_after=value) == expected


def test_retry_after_http_date_is_seconds_from_now() -> None:
    assert parse(retry_after="Wed, 01 Jan 2025 00:00:05 GMT") == 5.0


def test_retry_after_http_date_in_the_past_means_now() -> None:
    assert parse(retry_after="Tue, 31 Dec 2024 23:59:00 GMT") == 0.0


def test_retry_after_http_date_with_minus_zero_zone_is_utc() -> None:
    assert parse(retry_after="Wed, 01 Jan 2025 00:00:02 -0000") == 2.0


@pytest.mark.parametrize(
    "value",
    [
        "",
        "soon",
        "-1",
        "+3",
        "1e3",
        "inf",
        "nan",
        "0x10",
        "1_000",
        "3 s",
        "Thu, 99 Foo 2025 25:61:00 GMT",
    ],
)
def test_garbage_retry_after_gives_no_advice(value: str) -> None:
    assert parse(retry_after=value) is None


def test_no_headers_gives_no_advice() -> None:
    assert parse() is None
