"""No secret reaches the log, whoever writes the record (issue 14, items 7 and 8): the
handler's filter redacts every `logging` record (message, exception text, extra fields),
the access log's flush redacts its batch, and malformed requests are logged at most
once a minute."""

from __future__ import annotations

import io
import logging

import pytest

from sluice.gateway.connections import MalformedLog
from sluice.gateway.logs import ACCESS_LOG, REDACTOR, JsonFormatter, RedactingFilter


@pytest.fixture
def captured() -> logging.Logger:
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(JsonFormatter())
    handler.addFilter(RedactingFilter())
    logger = logging.getLogger("test.redaction")
    logger.handlers[:] = [handler]
    logger.propagate = False
    logger.setLevel(logging.DEBUG)
    logger.stream = stream  # type: ignore[attr-defined]
    return logger


def test_keys_tokens_and_url_passwords_never_reach_the_log(captured: logging.Logger) -> None:
    REDACTOR.set_secrets(["tenant-key-123456", "pw-of-redis"])
    captured.error("Redis at %s is not answering", "redis://:pw-of-redis@10.0.0.1:6379/0")
    captured.error("url redis://user:hunter2@redis:6379 failed")
    try:
        raise ValueError("bad line b'Authorization: Bearer tenant-key-123456\\x01'")
    except ValueError:
        captured.exception("Error handling request")
    captured.warning("x", extra={"auth": "Bearer abc.def.ghi", "note": "sk-live-abcdef"})
    captured.info("key in a body: tenant-key-123456, password=swordfish&x=1")
    text = captured.stream.getvalue()  # type: ignore[attr-defined]
    for secret in ("tenant-key-123456", "pw-of-redis", "hunter2", "abc.def.ghi", "swordfish"):
        assert secret not in text
    assert "sk-live-abcdef" not in text
    assert text.count("[redacted]") >= 7


def test_the_access_log_is_redacted_at_flush(capfd: pytest.CaptureFixture[str]) -> None:
    REDACTOR.set_secrets(["model-named-like-a-key"])
    ACCESS_LOG.enabled, ACCESS_LOG.json = True, True
    try:
        ACCESS_LOG.record({"model": "model-named-like-a-key", "tenant": "a"})
        ACCESS_LOG.flush()
    finally:
        ACCESS_LOG.enabled = False
    err = capfd.readouterr().err
    assert "model-named-like-a-key" not in err and '"model":"[redacted]"' in err


def test_malformed_requests_are_logged_once_a_minute_with_a_count(
    caplog: pytest.LogCaptureFixture,
) -> None:
    now = [0.0]
    counted: list[int] = []
    log = MalformedLog(counted.append, clock=lambda: now[0])
    with caplog.at_level(logging.WARNING, logger="sluice.connections"):
        for i in range(2000):
            now[0] = i * 0.0003  # 2,000 in 0.6 s
            log.record(400, "BadHttpMessage: Invalid header value char", "127.0.0.1")
        now[0] = 61.0
        log.record(400, "BadHttpMessage: Invalid header value char", "127.0.0.1")
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2 and len(counted) == 2001
    assert lines[1].endswith("; 1999 more in the last 60 s")
