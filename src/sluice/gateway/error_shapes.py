"""How a route writes its errors: OpenAI's shape (errors.py) on the OpenAI-style routes,
Anthropic's on the Messages API. A route's RouteSpec names its shape; every stage, the
relay and the error middleware write through it, so a client always gets the shape its
SDK parses.

Anthropic's shape (https://docs.anthropic.com/en/api/errors): `{"type": "error",
"error": {"type", "message"}}` with the types invalid_request_error (400),
authentication_error (401), permission_error (403), not_found_error (404),
request_too_large (413), rate_limit_error (429), api_error (500) and overloaded_error
(529). Sluice answers a tenant over its quota with 429 `rate_limit_error` (the caller's own
rate limit, as Anthropic's) and every refusal for overload (queue full, queue timeout,
shed on pressure, fast reject, no backend, the backend's own 503) with 529
`overloaded_error` (the service is busy, as Anthropic's), each with Retry-After; the
anthropic SDK retries both and honours the header. A refusal because no room comes before
the client's deadline (`cannot_serve_in_time`) is a 529 too, without Retry-After and with
`x-should-retry: false`, which the SDK obeys. Sluice's own code is kept in the
message, `(code: queue_full)`, so that logs still say which refusal it was."""

from __future__ import annotations

import orjson
from aiohttp import web

from sluice.core.types import RejectCode
from sluice.gateway import errors

_DONE = b"data: [DONE]\n\n"


class ErrorShape:
    """OpenAI's shape: `{"error": {"message", "type", "code", "param"}}`."""

    name = "openai"
    overloaded_status = 503  # the backend's own refusal for overload, passed on

    def body(self, status: int, message: str, code: str | None) -> bytes:
        return errors.error_body(status, message, code)

    def response(
        self,
        status: int,
        message: str,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> web.Response:
        return web.Response(
            status=status,
            body=self.body(status, message, code),
            content_type="application/json",
            headers=headers,
        )

    def reject(
        self,
        code: RejectCode,
        retry_after_s: float,
        queue: str,
        headers: dict[str, str],
        within_s: float | None = None,
    ) -> web.Response:
        """A refusal by the gateway (429, or 503 when no backend serves the model or the
        gateway shuts down);
        `within_s`: what is left of the client's deadline (errors.retry_after_headers)."""
        return errors.reject_response(code, retry_after_s, queue, headers, within_s)

    def overloaded(self, message: str, headers: dict[str, str]) -> web.Response:
        """The backend refused the request as overloaded (it answered 429/503)."""
        hdrs = {**headers, **errors.retry_after_headers(1.0)}
        return self.response(self.overloaded_status, message, "backend_overloaded", hdrs)

    def stream_failure(self, status: int, message: str, code: str | None) -> bytes:
        """The event that ends a stream that broke off after it began."""
        return b"data: " + self.body(status, message, code) + b"\n\n" + _DONE


class OpenAIResponsesErrors(ErrorShape):
    """The Responses API: errors in OpenAI's shape, and a stream that breaks off ends with
    its `error` event (`{"type": "error", "code", "message", "param"}`), which the openai
    SDK raises as an APIError."""

    name = "openai-responses"

    def stream_failure(self, status: int, message: str, code: str | None) -> bytes:
        event = {"type": "error", "code": code, "message": message, "param": None}
        return b"event: error\ndata: " + orjson.dumps(event) + b"\n\n"


_ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "invalid_request_error",
    413: "request_too_large",
    429: "rate_limit_error",
    529: "overloaded_error",
}
OVERLOADED = 529


class AnthropicErrors(ErrorShape):
    """Anthropic's shape (see the module's docstring)."""

    name = "anthropic"
    overloaded_status = OVERLOADED

    def body(self, status: int, message: str, code: str | None) -> bytes:
        if code:
            message = f"{message.rstrip('.')} (code: {code})."
        kind = _ANTHROPIC_TYPES.get(status, "api_error")
        return orjson.dumps({"type": "error", "error": {"type": kind, "message": message}})

    def reject(
        self,
        code: RejectCode,
        retry_after_s: float,
        queue: str,
        headers: dict[str, str],
        within_s: float | None = None,
    ) -> web.Response:
        message = errors.reject_message(code, queue, retry_after_s)
        if code is RejectCode.TOO_LARGE:  # the client's to fix: no retry
            return self.response(400, message, code.value, headers)
        if code is RejectCode.CANNOT_SERVE_IN_TIME:
            # no room before the client's deadline: no Retry-After, and x-should-retry:
            # false, which the anthropic SDK obeys
            hdrs = {**headers, "x-should-retry": "false"}
            return self.response(OVERLOADED, message, code.value, hdrs)
        status = 429 if code is RejectCode.TENANT_QUOTA else OVERLOADED
        hdrs = {**headers, **errors.retry_after_headers(retry_after_s, within_s)}
        return self.response(status, message, code.value, hdrs)

    def stream_failure(self, status: int, message: str, code: str | None) -> bytes:
        return b"event: error\ndata: " + self.body(status, message, code) + b"\n\n"


OPENAI = ErrorShape()
OPENAI_RESPONSES = OpenAIResponsesErrors()
ANTHROPIC = AnthropicErrors()


def shape_for_path(path: str) -> ErrorShape:
    """The error shape of the route a request path names (for answers written before
    the path is routed: aiohttp's 404, 405, a body too large, an unexpected failure)."""
    if path.startswith("/v1/messages"):
        return ANTHROPIC
    if path.startswith("/v1/responses"):
        return OPENAI_RESPONSES
    return OPENAI
