"""Answers in OpenAI's error shape: {"error": {"message", "type", "code"}}.

Every error the gateway writes has it: the handlers' own (`error_response`), the
router's 404 and 405 and anything a handler raises (`error_shape_middleware`), and what
never reaches the app, the HTTP parser's 400s and the connection limit's 503
(connections.py)."""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

import orjson
from aiohttp import web

from sluice.core.types import RejectCode

if TYPE_CHECKING:
    from sluice.gateway.error_shapes import ErrorShape

log = logging.getLogger("sluice.gateway")

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


def retry_after_headers(seconds: float, within_s: float | None = None) -> dict[str, str]:
    """Retry-After in whole seconds, at least 1 (HTTP delay-seconds), plus the exact
    `retry-after-ms`. With `within_s`, what is left of the client's deadline: a
    Retry-After that is within it stays within it in whole seconds too (rounded down where
    rounding up would pass it, never below 1: the core answers `cannot_serve_in_time`
    when less than 1 s is left, core/retry_after.deadline_code)."""
    seconds = max(0.0, seconds)
    whole = max(1, math.ceil(seconds))
    if within_s is not None and seconds <= within_s < whole:
        whole = max(1, math.floor(seconds))
    return {
        "Retry-After": str(whole),
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
    RejectCode.SHUTTING_DOWN: "The gateway is shutting down; retry on another replica.",
    RejectCode.CANNOT_SERVE_IN_TIME: "The {queue} class has no room for this request before "
    "its deadline (X-Request-Timeout / X-Stainless-Timeout); the earliest room is in about "
    "{room} s. Retrying sooner will not help.",
    RejectCode.TOO_LARGE: "The prompt is larger than the KV cache of every backend serving "
    "this model: it can never be served as it is. Shorten it.",
}


def reject_message(code: RejectCode, queue: str, retry_after_s: float = 0.0) -> str:
    """The refusal's message (`cannot_serve_in_time` names the earliest room it found)."""
    return _REJECT_MESSAGES[code].format(queue=queue, room=math.ceil(retry_after_s))


def reject_response(
    code: RejectCode,
    retry_after_s: float,
    queue: str,
    headers: dict[str, str],
    within_s: float | None = None,
) -> web.Response:
    # `cannot_serve_in_time` (no room before the client's deadline): no Retry-After, and
    # x-should-retry: false, which the openai and anthropic SDKs obey. A booked return
    # slot's token is among `headers` (gateway/returns.py); `within_s`: what is left of the
    # client's deadline (retry_after_headers).
    message = reject_message(code, queue, retry_after_s)
    if code is RejectCode.TOO_LARGE:  # the client's to fix: no retry
        return error_response(400, message, code.value, headers)
    status = 503 if code in (RejectCode.NO_BACKEND, RejectCode.SHUTTING_DOWN) else 429
    if code is RejectCode.CANNOT_SERVE_IN_TIME:
        return error_response(status, message, code.value, {**headers, "x-should-retry": "false"})
    hdrs = {**headers, **retry_after_headers(retry_after_s, within_s)}
    return error_response(status, message, code.value, hdrs)


_Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@web.middleware
async def error_shape_middleware(request: web.Request, handler: _Handler) -> web.StreamResponse:
    """aiohttp's own error answers (an unknown route, a wrong method, a body too large
    for client_max_size, ...) and anything a handler raises, in OpenAI's shape. Unknown
    routes are answered here, never forwarded."""
    try:
        return await handler(request)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise  # a redirect is not an error
        return _http_error(request, exc)
    except (asyncio.CancelledError, ConnectionError):
        raise  # the client went away: nothing to answer
    except Exception:
        log.exception("unexpected error handling %s %s", request.method, request.path)
        shape = _shape_for(request.path)
        return shape.response(500, "The gateway failed to handle the request.", "internal_error")


def _http_error(request: web.Request, exc: web.HTTPException) -> web.Response:
    route = f"{request.method} {request.path}"[:200]
    if exc.status == 404:
        message, code = f"Invalid URL ({route}).", "unknown_route"
    elif exc.status == 405:
        allowed = exc.headers.get("Allow", "")
        message, code = f"Method not allowed ({route}); allowed: {allowed}.", "method_not_allowed"
    elif exc.status == 413:
        message, code = "The body is too large.", "body_too_large"
    else:
        message, code = exc.reason or f"HTTP {exc.status}", None
    headers = {k: v for k, v in exc.headers.items() if k in ("Allow", "Retry-After")}
    return _shape_for(request.path).response(exc.status, message, code, headers)


def _shape_for(path: str) -> ErrorShape:
    """The error shape of the route a path names: Anthropic's on its Messages routes (the
    anthropic SDK parses only that one), OpenAI's everywhere else."""
    from sluice.gateway.error_shapes import shape_for_path  # (it builds on this module)

    return shape_for_path(path)
