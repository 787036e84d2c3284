"""Logging: JSON lines for machines (the default when stderr is not a terminal), plain
text for people. Every answered request writes one access record with its request id,
tenant, class, outcome, status and queue time. API keys are never logged."""

from __future__ import annotations

import logging
import sys
import time
from typing import Any

import orjson

ACCESS = logging.getLogger("sluice.access")
# LogRecord attributes that are not extra fields.
_STANDARD = set(logging.makeLogRecord({}).__dict__) | {"message", "asctime"}


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        for key, value in record.__dict__.items():
            if key not in _STANDARD:
                entry[key] = value
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return orjson.dumps(entry, default=str).decode()


class TextFormatter(logging.Formatter):
    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s: %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        text = super().format(record)
        extra = {k: v for k, v in record.__dict__.items() if k not in _STANDARD}
        if extra:
            text += " " + " ".join(f"{k}={v}" for k, v in extra.items())
        return text


def setup_logging(level: str = "info", fmt: str = "auto", access: bool = True) -> None:
    if fmt == "auto":
        fmt = "text" if sys.stderr.isatty() else "json"
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    ACCESS.disabled = not access


def access(fields: dict[str, Any]) -> None:
    if not ACCESS.disabled and ACCESS.isEnabledFor(logging.INFO):
        ACCESS.info("request", extra=fields)
