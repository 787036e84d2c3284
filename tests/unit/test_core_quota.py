"""Tenant quotas: requests/tokens per minute and max concurrency, with Retry-After."""

from __future__ import annotations

import pytest

from sluice.config import Policy, Tenant
from sluice.core.clock import FakeClock
from sluice.core.controller import Controller
from sluice.core.quota import InProcessQuotas
from sluice.core.types import Outcome, RejectCode, RequestInfo


def test_requests_per_minute() -> None:
    q = InProcessQuotas([Tenant(name="t", requests_per_minute=2)])
    assert q.acquire("t", 10, 0.0).ok
    assert q.acquire("t", 10, 0.0).ok
    d = q.acquire("t", 10, 0.0)
    assert not d.ok and d.retry_after_s == 30.0  # 2 per minute: one every 30 s
    d = q.acquire("t", 10, 20.0)
    assert not d.ok and d.retry_after_s == pytest.approx(10.0)
    assert q.acquire("t", 10, 30.0).ok
    assert q.acquire("other", 10, 0.0).ok  # no quota configured


def test_tokens_per_minute_and_settlement() -> None:
    q = InProcessQuotas([Tenant(name="t", tokens_per_minute=600)])  # 10 per second
    assert q.acquire("t", 500, 0.0).ok
    d = q.acquire("t", 200, 0.0)
    assert not d.ok and d.retry_after_s == 10.0  # 100 missing at 10/s
    q.settle("t", -300, 0.0)  # it used 300 fewer tokens than charged
    assert q.acquire("t", 200, 0.0).ok
    # a request larger than a minute's quota waits for a full bucket, then runs in debt
    d = q.acquire("t", 5000, 0.0)
    assert not d.ok and d.retry_after_s == pytest.approx(40.0)  # 200 left: 400 missing
    assert not q.acquire("t", 5000, 39.0).ok
    assert q.acquire("t", 5000, 40.0).ok


def test_max_concurrency_and_refund() -> None:
    q = InProcessQuotas(
        [Tenant(name="t", max_concurrency=1, requests_per_minute=60)], concurrency_retry_s=1.5
    )
    assert q.acquire("t", 1, 0.0).ok
    d = q.acquire("t", 1, 0.0)
    assert not d.ok and d.retry_after_s == 1.5
    q.release("t", 0.0)
    assert q.open_requests("t") == 0
    assert q.acquire("t", 1, 0.0).ok
    q.refund("t", 1, 0.0)  # never ran: request token and slot come back
    assert q.open_requests("t") == 0


def test_controller_rejects_with_tenant_quota() -> None:
    pol = Policy.model_validate(
        {
            "tenants": [{"name": "t", "requestsPerMinute": 1, "maxConcurrency": 5}],
            "limiter": {"algorithm": "fixed", "fixedLimit": 1},
        }
    )
    clock = FakeClock()
    c = Controller(pol, clock, ["b0"])
    assert c.arrive(RequestInfo("a", "t", 0, "m", 10, 10)).queued
    adm = c.arrive(RequestInfo("b", "t", 0, "m", 10, 10))
    assert adm.code is RejectCode.TENANT_QUOTA and adm.retry_after_s == 60.0
    c.dispatch()
    c.on_finish("a", Outcome.OK, 10, 5)
    clock.set(60.0)
    assert c.arrive(RequestInfo("c", "t", 0, "m", 10, 10)).queued
    assert c.snapshot()["classes"]["P0"]["rejected"] == {"tenant_quota": 1}


def test_hot_reload_changes_quotas() -> None:
    q = InProcessQuotas([Tenant(name="t", requests_per_minute=1)])
    assert q.acquire("t", 1, 0.0).ok
    assert not q.acquire("t", 1, 0.0).ok
    q.set_limits([Tenant(name="t")], 0.0)  # quota removed
    assert q.acquire("t", 1, 0.0).ok
