"""Reading request bodies the way vLLM 0.32's FastAPI layer rejects them.

A body that is not JSON, a wrong Content-Type, a missing field or a field of the wrong type
never reaches vLLM's handlers: FastAPI raises `RequestValidationError` and
`validation_exception_handler` (vllm/entrypoints/serve/exception_handling/handlers/
validation.py) answers 400 in OpenAI's shape, on every route, the Anthropic one included:
`{"error": {"message": "1 validation error:\\n  {...}", "type": "Bad Request",
"param": "body.max_tokens", "code": 400}}`. `validate_json_request`
(vllm/entrypoints/serve/utils/api_utils.py) refuses any Content-Type but
application/json the same way. The readers here raise that `ApiError`; the simulator's
message names the field and the problem the way pydantic's does, without its `input` echo.
"""

from __future__ import annotations

import math
from typing import Any

import orjson

from sluice.sim.openai_api import ApiError

VALIDATION_TYPE = "Bad Request"  # HTTPStatus.BAD_REQUEST.phrase


def invalid(loc: str, msg: str, kind: str = "value_error") -> ApiError:
    """A request-validation error about the body field `loc` ("" for the whole body)."""
    where = "body" if not loc else f"body.{loc}"
    detail = "{" + f"'type': '{kind}', 'loc': '{where}', 'msg': {msg!r}" + "}"
    return ApiError(400, f"1 validation error:\n  {detail}", VALIDATION_TYPE, where)


def invalid_value(param: str, msg: str) -> ApiError:
    """A `VLLMValidationError` raised by a model validator: the message is pydantic's
    "Value error, ..." and `param` is the one the validator names."""
    detail = "{" + f"'type': 'value_error', 'loc': 'body', 'msg': {('Value error, ' + msg)!r}" + "}"
    return ApiError(400, f"1 validation error:\n  {detail}", VALIDATION_TYPE, param)


def json_body(raw: bytes, content_type: str | None) -> dict[str, Any]:
    media = (content_type or "").split(";", 1)[0].strip().lower()
    if media != "application/json":
        raise ApiError(
            400,
            "1 validation error:\n  Unsupported Media Type: Only 'application/json' is allowed",
            VALIDATION_TYPE,
        )
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise invalid("", f"JSON decode error: {exc}", "json_invalid") from None
    if not isinstance(body, dict):
        raise invalid("", "Input should be a valid dictionary or object", "model_attributes_type")
    return body


def required(body: dict[str, Any], name: str) -> Any:
    if name not in body:
        raise invalid(name, "Field required", "missing")
    return body[name]


def string(body: dict[str, Any], name: str, *, default: str | None = None) -> str | None:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, str):
        raise invalid(name, "Input should be a valid string", "string_type")
    return value


def integer(
    body: dict[str, Any], name: str, *, minimum: int | None = None, default: int | None = None
) -> int | None:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, float) and value.is_integer():
        value = int(value)  # pydantic's lax mode takes 5.0
    if isinstance(value, bool) or not isinstance(value, int):
        raise invalid(name, "Input should be a valid integer", "int_type")
    if minimum is not None and value < minimum:
        raise invalid(
            name, f"Input should be greater than or equal to {minimum}", "greater_than_equal"
        )
    return value


def number(body: dict[str, Any], name: str) -> float | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise invalid(name, "Input should be a valid number", "float_type")
    return float(value)


def boolean(body: dict[str, Any], name: str, *, default: bool = False) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise invalid(name, "Input should be a valid boolean", "bool_type")
    return value


def one_of(body: dict[str, Any], name: str, choices: tuple[str, ...], default: str) -> str:
    value = body.get(name)
    if value is None:
        return default
    if value not in choices:
        listed = ", ".join(repr(c) for c in choices)
        raise invalid(name, f"Input should be {listed}", "literal_error")
    return str(value)
