"""Answers in OpenAI's error shape: {"error": {"message", "type", "code"}}."""

from __future__ import annotations

import math

import orjson
from aiohttp import web

from sluice.core.types import RejectCode
from sluice.gateway.returns import BOOKING_HEADER, WINDOW_HEADER

# OpenAI's `type` for each HTTP status we answer.
_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "timeout_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    502: "server_error",
    503: "server_error",
    504: "timeout_error",
}


def error_body(status: int, message: str, code: str | None) -> bytes:
    err = {
        "message": message,
        "type": _TYPES.get(status, "server_error"),
        "code": code,
        "param": None,
    }
    return orjson.dumps({"error": err})


def error_response(
    status: int, message: str, code: str | None = None, headers: dict[str, str] | None = None
) -> web.Response:
    return web.Response(
        status=status,
        body=error_body(status, message, code),
        content_type="application/json",
        headers=headers,
    )


def retry_after_headers(seconds: float) -> dict[str, str]:
    """Retry-After in whole seconds (at least 1) plus the exact `retry-after-ms`."""
    seconds = max(0.0, seconds)
    return {
        "Retry-After": str(max(1, math.ceil(seconds))),
        "retry-after-ms": str(max(1, round(seconds * 1000))),
    }


_REJECT_MESSAGES = {
    RejectCode.QUEUE_FULL: "The {queue} queue is full; retry after the indicated delay.",
    RejectCode.QUEUE_TIMEOUT: "The request waited longer than the {queue} queue allows; "
    "retry after the indicated delay.",
    RejectCode.SHED_ON_PRESSURE: "The gateway is under pressure and the request would not be "
    "served within its deadline; retry after the indicated delay.",
    RejectCode.FAST_REJECT: "The {queue} class is paused while the backends are under "
    "pressure; retry after the indicated delay.",
    RejectCode.TENANT_QUOTA: "The tenant's quota is used up; retry after the indicated delay.",
    RejectCode.NO_BACKEND: "No healthy backend serves this model right now; retry shortly.",
    RejectCode.CANNOT_SERVE_IN_TIME: "The {queue} class has no room for this request before "
    "its deadline (X-Request-Timeout / X-Stainless-Timeout); the earliest room is in about "
    "{room} s. Retrying sooner will not help.",
}


def reject_response(
    code: RejectCode,
    retry_after_s: float,
    queue: str,
    headers: dict[str, str],
    booking: str | None = None,
    window_s: float = 0.0,
) -> web.Response:
    """A refusal: 429 (503 without a backend) with Retry-After, and when a return slot was
    booked for it the token the client sends back and the window it should spread its
    return over (gateway/returns.py). `cannot_serve_in_time` has no Retry-After (none would
    be before the client's deadline) and says not to retry (`x-should-retry`, which the
    openai and anthropic SDKs obey)."""
    status = 503 if code is RejectCode.NO_BACKEND else 429
    if code is RejectCode.CANNOT_SERVE_IN_TIME:
        hdrs = {**headers, "x-should-retry": "false"}
        message = _REJECT_MESSAGES[code].format(queue=queue, room=math.ceil(retry_after_s))
        return error_response(status, message, code.value, hdrs)
    hdrs = {**headers, **retry_after_headers(retry_after_s)}
    if booking is not None:
        hdrs[BOOKING_HEADER] = booking
        hdrs[WINDOW_HEADER] = str(round(window_s * 1000))
    message = _REJECT_MESSAGES[code].format(queue=queue)
    return error_response(status, message, code.value, hdrs)
