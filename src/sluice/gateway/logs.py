"""Logging: JSON lines for machines (the default when stderr is not a terminal), plain
text for people. Every answered request writes one access record with its request id,
tenant, class, outcome, status and queue time.

No secret reaches the log, whoever writes the record (Sluice, aiohttp's parser quoting a
malformed header line, redis-py quoting its URL): one `Redactor` rewrites every record
on its way out (the handler's filter for `logging` records, the flush for access
records). It replaces the secrets the policy names (tenant and admin keys, backend keys,
the Redis password: `set_secrets`) wherever they appear, and by shape: the value of an
`Authorization`-like header or `key=`/`password=` pair, a bearer token, an `sk-...` key,
the password in a URL (`redis://:PASSWORD@host`).

Access records bypass the `logging` module (a LogRecord and a formatter cost ~35 µs, more
than the rest of the gateway's per-request logic): they are serialised with orjson into a
buffer that is flushed to stderr a few times a second and at exit."""

from __future__ import annotations

import atexit
import logging
import re
import sys
import time
from collections.abc import Iterable
from typing import Any

import orjson

# LogRecord attributes that are not extra fields.
_STANDARD = set(logging.makeLogRecord({}).__dict__) | {"message", "asctime"}

REDACTED = "[redacted]"
_SHAPES = [
    # the value of a credential-bearing header or key=value pair (scheme kept)
    (
        r"(?i)\b((?:proxy-)?authorization|x-api-key|api[-_]?key|password|passwd|secret)"
        r"(\\?[\"']?\s*[:=]\s*\\?[\"']?)((?:bearer|basic|token)\s+)?[^\s\"',;&]+",
        r"\1\2\3" + REDACTED,
    ),
    (r"(?i)\b(bearer\s+)[^\s\"',;&]+", r"\1" + REDACTED),  # a bearer token anywhere
    (r"\bsk-[A-Za-z0-9_\-]{4,}", "sk-" + REDACTED),  # an OpenAI-style key
    # the password of a URL's userinfo: scheme://user:PASSWORD@host
    (r"(?i)\b([a-z][a-z0-9+.\-]*://[^\s/@:]*):[^\s/@]+@", r"\1:" + REDACTED + "@"),
]


class Redactor:
    """Rewrites text so that it holds no secret: the ones named with `set_secrets` and
    anything shaped like one (see the module docstring)."""

    def __init__(self) -> None:
        self._shapes = [(re.compile(p), r) for p, r in _SHAPES]
        self._shapes_b = [(re.compile(p.encode()), r.encode()) for p, r in _SHAPES]
        self._secrets: set[str] = set()
        self._known: re.Pattern[str] | None = None
        self._known_b: re.Pattern[bytes] | None = None

    def set_secrets(self, secrets: Iterable[str]) -> None:
        """Add the secrets in force (those of an earlier policy stay: a request under
        way, or a log line about it, may still quote one)."""
        self._secrets |= {s for s in secrets if len(s) >= 4}
        ordered = sorted(self._secrets, key=len, reverse=True)
        if ordered:
            self._known = re.compile("|".join(re.escape(s) for s in ordered))
            self._known_b = re.compile(b"|".join(re.escape(s.encode()) for s in ordered))

    def redact(self, text: str) -> str:
        if self._known is not None:
            text = self._known.sub(REDACTED, text)
        for pattern, replacement in self._shapes:
            text = pattern.sub(replacement, text)
        return text

    def redact_bytes(self, data: bytes) -> bytes:
        if self._known_b is not None:
            data = self._known_b.sub(REDACTED.encode(), data)
        for pattern, replacement in self._shapes_b:
            data = pattern.sub(replacement, data)
        return data


REDACTOR = Redactor()


class RedactingFilter(logging.Filter):
    """On the handler: every record leaves with its message, its exception text and its
    extra fields redacted."""

    def __init__(self, redactor: Redactor = REDACTOR) -> None:
        super().__init__()
        self._redactor = redactor
        self._formatter = logging.Formatter()

    def filter(self, record: logging.LogRecord) -> bool:
        redact = self._redactor.redact
        try:
            message = record.getMessage()
        except Exception:  # a bad format string: log what there is
            message = f"{record.msg!r} % {record.args!r}"
        record.msg, record.args = redact(message), None
        if record.exc_info and not record.exc_text:
            record.exc_text = self._formatter.formatException(record.exc_info)
        if record.exc_text:
            record.exc_text = redact(record.exc_text)
        if record.stack_info:
            record.stack_info = redact(record.stack_info)
        for key, value in list(record.__dict__.items()):
            if key not in _STANDARD and isinstance(value, str):
                record.__dict__[key] = redact(value)
        return True


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
        if record.exc_info and not record.exc_text:
            record.exc_text = self.formatException(record.exc_info)
        if record.exc_text:
            entry["exc"] = record.exc_text
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
            # redacted here, once per batch, off the request path
            data = REDACTOR.redact_bytes(b"".join(self._pending))
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
    handler.addFilter(RedactingFilter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    ACCESS_LOG.enabled = access
    ACCESS_LOG.json = fmt == "json"


def access(fields: dict[str, Any]) -> None:
    ACCESS_LOG.record(fields)
