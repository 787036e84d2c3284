"""Logging: JSON lines for machines (the default when stderr is not a terminal), plain
text for people. Every answered request writes one access record with its request id,
tenant, class, outcome, status and queue time. API keys are never logged.

Access records bypass the `logging` module (a LogRecord and a formatter cost ~35 µs, more
than the rest of the gateway's per-request logic): they are serialised with orjson into a
buffer that is flushed to stderr a few times a second and at exit."""

from __future__ import annotations

import atexit
import logging
import sys
import time
from typing import Any

import orjson

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


class AccessLog:
    """Buffered access records: `record()` costs a few microseconds; `flush()` writes."""

    def __init__(self) -> None:
        self.enabled = False
        self.json = True
        self._pending: list[bytes] = []

    def record(self, fields: dict[str, Any]) -> None:
        if not self.enabled:
            return
        now = time.time()
        if self.json:
            head = b'{"ts":%.3f,"level":"info","logger":"sluice.access","msg":"request",' % now
            self._pending.append(head + orjson.dumps(fields)[1:] + b"\n")
        else:
            stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(now))
            pairs = " ".join(f"{k}={v}" for k, v in fields.items())
            self._pending.append(f"{stamp} INFO sluice.access: request {pairs}\n".encode())
        if len(self._pending) >= 512:
            self.flush()

    def flush(self) -> None:
        if self._pending:
            data = b"".join(self._pending)
            self._pending.clear()
            try:
                sys.stderr.flush()
                sys.stderr.buffer.write(data)
                sys.stderr.buffer.flush()
            except (OSError, ValueError):
                pass  # stderr closed: nothing to do about it


ACCESS_LOG = AccessLog()
atexit.register(ACCESS_LOG.flush)


def setup_logging(level: str = "info", fmt: str = "auto", access: bool = True) -> None:
    if fmt == "auto":
        fmt = "text" if sys.stderr.isatty() else "json"
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    ACCESS_LOG.enabled = access
    ACCESS_LOG.json = fmt == "json"


def access(fields: dict[str, Any]) -> None:
    ACCESS_LOG.record(fields)
