"""Tenant quotas: requests/tokens per minute and max concurrency, with Retry-After."""

from __future__ import annotations

import pytest

from sluice.config import Policy, Tenant
from sluice.core.clock import FakeClock
from sluice.core.controller import Controller
from sluice.core.quota import InProcessQuotas, QuotaShare, local_fraction, refilled, settlement
from sluice.core.settings import TenantLimits
from sluice.core.types import Outcome, RejectCode, RequestInfo


def test_requests_per_minute() -> None:
    q = InProcessQuotas([TenantLimits(name="t", requests_per_minute=2)])
    assert q.acquire("t", 10, 0.0).ok
    assert q.acquire("t", 10, 0.0).ok
    d = q.acquire("t", 10, 0.0)
    assert not d.ok and d.retry_after_s == 30.0  # 2 per minute: one every 30 s
    d = q.acquire("t", 10, 20.0)
    assert not d.ok and d.retry_after_s == pytest.approx(10.0)
    assert q.acquire("t", 10, 30.0).ok
    assert q.acquire("other", 10, 0.0).ok  # no quota configured


def test_tokens_per_minute_and_settlement() -> None:
    q = InProcessQuotas([TenantLimits(name="t", tokens_per_minute=600)])  # 10 per second
    assert q.acquire("t", 500, 0.0).ok
    d = q.acquire("t", 200, 0.0)
    assert not d.ok and d.retry_after_s == 10.0  # 100 missing at 10/s
    q.settle("t", -300, 0.0)  # it used 300 fewer tokens than charged
    assert q.acquire("t", 200, 0.0).ok
    # a request larger than a minute's quota waits for a full bucket, then runs charged it
    d = q.acquire("t", 5000, 0.0)
    assert not d.ok and d.retry_after_s == pytest.approx(40.0)  # 200 left: 400 missing
    assert not q.acquire("t", 5000, 39.0).ok
    assert q.acquire("t", 5000, 40.0).ok


def test_max_concurrency_and_refund() -> None:
    q = InProcessQuotas(
        [TenantLimits(name="t", max_concurrency=1, requests_per_minute=2)], concurrency_retry_s=1.5
    )
    assert q.acquire("t", 1, 0.0).ok
    d = q.acquire("t", 1, 0.0)
    assert not d.ok and d.retry_after_s == 1.5  # refused for its slot: nothing charged
    q.release("t", 0.0)
    assert q.acquire("t", 1, 0.0).ok  # its slot again, and the minute's second request
    q.refund("t", 1, 0.0)  # never ran: request token and slot come back
    assert q.acquire("t", 1, 0.0).ok
    q.release("t", 0.0)
    d = q.acquire("t", 1, 0.0)
    assert not d.ok and d.retry_after_s == 30.0  # both requests of the minute used


def test_controller_rejects_with_tenant_quota() -> None:
    pol = Policy.model_validate(
        {
            "tenants": [{"name": "t", "requestsPerMinute": 1, "maxConcurrency": 5}],
            "limiter": {"algorithm": "fixed", "fixedLimit": 1},
        }
    )
    clock = FakeClock()
    c = Controller(pol.core_settings(), clock, ["b0"])
    assert c.arrive(RequestInfo("a", "t", 0, "m", 10, 10)).admitted
    adm = c.arrive(RequestInfo("b", "t", 0, "m", 10, 10))
    assert adm.code is RejectCode.TENANT_QUOTA and adm.retry_after_s == 60.0
    c.step()
    c.on_finish("a", Outcome.OK, 10, 5)
    clock.set(60.0)
    assert c.arrive(RequestInfo("c", "t", 0, "m", 10, 10)).admitted
    assert c.snapshot().classes["P0"].rejected == {"tenant_quota": 1}


def test_a_quota_that_refills_past_the_clients_deadline_cannot_serve_it_in_time() -> None:
    pol = Policy.model_validate(
        {
            "tenants": [{"name": "t", "requestsPerMinute": 2}],
            "limiter": {"algorithm": "fixed", "fixedLimit": 4},
        }
    )
    clock = FakeClock(100.0)
    c = Controller(pol.core_settings(), clock, ["b0"])
    for rid in ("a", "b"):
        assert c.arrive(RequestInfo(rid, "t", 1, "m", 10, 10)).admitted
    # the next request refills in 30 s (2 per minute)
    in_time = c.arrive(RequestInfo("c", "t", 1, "m", 10, 10, client_deadline=131.0))
    assert in_time.code is RejectCode.TENANT_QUOTA and in_time.retry_after_s == 30.0
    late = c.arrive(RequestInfo("d", "t", 1, "m", 10, 10, client_deadline=129.0))
    assert late.code is RejectCode.CANNOT_SERVE_IN_TIME and late.booking is None
    assert late.retry_after_s == 30.0  # the earliest room, for its message
    snap = c.snapshot().classes["P1"]
    assert snap.rejected == {"tenant_quota": 1, "cannot_serve_in_time": 1}
    assert snap.returns.unservable == 1


def test_hot_reload_changes_quotas() -> None:
    q = InProcessQuotas([TenantLimits(name="t", requests_per_minute=1)])
    assert q.acquire("t", 1, 0.0).ok
    assert not q.acquire("t", 1, 0.0).ok
    q.set_limits([TenantLimits(name="t")], 0.0)  # quota removed
    assert q.acquire("t", 1, 0.0).ok


# -- one process's share of a quota enforced apart ------------------------------------------


def test_a_share_scales_every_limit_and_starts_from_its_part_of_what_was_left() -> None:
    q = InProcessQuotas(
        [TenantLimits(name="t", requests_per_minute=10, tokens_per_minute=1200, max_concurrency=5)]
    )
    # a quarter of the quota; the tenant had 4 requests and 600 tokens left of its minute;
    # one request admitted before is still running here
    q.set_share("t", QuotaShare(0.25, requests_level=4.0, tokens_level=600.0, open=1), 0.0)
    # 150 tokens: one more waits for it at 5/s (a refused request is charged nothing)
    d = q.acquire("t", 151, 0.0)
    assert not d.ok and d.retry_after_s == pytest.approx(0.2)
    assert q.acquire("t", 150, 0.0).ok
    # maxConcurrency: ceil(5 / 4) = 2 slots, the running one included
    assert q.acquire("t", 1, 0.0).retry_after_s == 1.0
    q.release("t", 0.0)
    d = q.acquire("t", 1, 0.0)
    assert not d.ok and d.retry_after_s == pytest.approx(24.0)  # 1 was left: 1 at 2.5/min
    # refilled at a quarter of the rate: 10 s later 10 x 2.5 / 60 requests, 50 tokens
    assert q.acquire("t", 1, 10.0).retry_after_s == pytest.approx(14.0)  # 7/12 request short
    assert q.acquire("t", 300, 10.0).retry_after_s == pytest.approx(50.0)  # 250 tokens short
    # a long loss: one share, never more (2.5 requests, 300 tokens)
    assert q.acquire("t", 300, 600.0).ok
    q.release("t", 600.0)
    assert q.acquire("t", 1, 600.0).retry_after_s == pytest.approx(0.2)  # no 301st token
    q.settle("t", -300, 600.0)  # it used none: all 300 back
    assert q.acquire("t", 1, 600.0).ok
    q.release("t", 600.0)
    assert q.acquire("t", 1, 600.0).retry_after_s == pytest.approx(12.0)  # 0.5 request left
    # new limits (a reload) keep the share: a quarter of 2400 tokens, no request limit
    q.set_limits([TenantLimits(name="t", tokens_per_minute=2400)], 600.0)
    assert q.acquire("t", 600, 1200.0).ok
    assert q.acquire("t", 0, 1200.0).ok and q.acquire("t", 0, 1200.0).ok
    assert q.acquire("t", 1, 1200.0).retry_after_s == pytest.approx(0.1)  # 1 token at 10/s


def test_a_share_without_known_levels_starts_full() -> None:
    q = InProcessQuotas([TenantLimits(name="t", tokens_per_minute=1000, max_concurrency=1)])
    q.set_share("t", QuotaShare(0.1), 5.0)
    assert q.acquire("t", 100, 5.0).ok  # a tenth of 1,000 tokens, all there
    assert not q.acquire("t", 1, 5.0).ok  # a cap is never cut to nothing: 1 slot
    q.release("t", 5.0)
    assert q.acquire("t", 1, 5.0).retry_after_s == pytest.approx(0.6)  # 1 token at 100/min


def test_local_fractions_follow_the_traffic_and_add_up_to_one() -> None:
    assert local_fraction(None, 4, 0.1) == 0.25  # nothing known: even shares
    assert local_fraction(0.5, 2, 0.1) == 0.5
    assert local_fraction(0.0, 2, 0.1) == pytest.approx(0.05)  # the floor's even part
    parts = [0.6, 0.3, 0.1, 0.0]
    assert sum(local_fraction(p, 4, 0.1) for p in parts) == pytest.approx(1.0)
    assert local_fraction(1.2, 0, 0.1) == 1.0  # clamped; at least one process


def test_refilled_caps_at_the_capacity() -> None:
    assert refilled(-60.0, 600, 6.0) == 0.0
    assert refilled(500.0, 600, 60.0) == 600.0
    assert refilled(10.0, 600, -1.0) == 10.0  # clocks do not run backwards


# -- issue 14, item 5: what one request may cost its tenant ---------------------------------


def test_a_request_is_charged_at_most_a_full_bucket_and_nothing_if_the_backend_refuses_it() -> None:
    """max_tokens of ten million (or 2^63-1) that the backend refuses (400, no usage)
    must not lock its tenant out: the charge is capped at the bucket, and given back."""
    tenant = Tenant(name="t", tokens_per_minute=100_000)
    policy = Policy(tenants=(tenant,))
    clock = FakeClock()
    c = Controller(policy.core_settings(), clock, ["b0"])
    for i, max_tokens in enumerate((10_000_000, 2**63 - 1)):
        rid = f"huge-{i}"
        assert c.arrive(RequestInfo(rid, "t", 1, "m", 10, max_tokens)).admitted
        c.step()
        c.on_finish(rid, Outcome.CLIENT_ERROR)  # refused by the backend: no usage
        assert c.arrive(RequestInfo(f"next-{i}", "t", 1, "m", 10, 100)).admitted
        c.step()
        c.on_finish(f"next-{i}", Outcome.OK, 10, 50)
    q = InProcessQuotas([tenant.core_settings()])
    assert q.charge_for("t", 2**63 - 1) == 100_000
    assert q.acquire("t", q.charge_for("t", 2**63 - 1), 0.0).ok
    q.settle("t", 10**18, 0.0)  # whatever a backend reports: at most a minute in debt
    d = q.acquire("t", 1, 0.0)
    assert not d.ok and d.retry_after_s == pytest.approx(60.0006)  # 100,001 at 100,000/min
    assert q.acquire("t", 1, 120.0).ok


@pytest.mark.parametrize(
    ("outcome", "usage", "delta"),
    [
        (Outcome.OK, (30, 20), 50 - 400),  # reported usage: the charge becomes it
        (Outcome.CANCELLED, (None, None), 0),  # work was done, unknown how much
        (Outcome.OK, (None, None), 0),  # an answer without usage: the estimate
        (Outcome.CLIENT_ERROR, (None, None), -400),  # refused by the backend
        (Outcome.OVERLOADED, (None, None), -400),
        (Outcome.ERROR, (None, None), -400),
        (Outcome.TIMEOUT, (None, None), -400),
    ],
)
def test_one_settlement_rule(
    outcome: Outcome, usage: tuple[int | None, int | None], delta: int
) -> None:
    assert settlement(400, outcome, *usage) == delta


def test_the_quota_is_charged_what_the_cost_model_expects_as_the_shared_store_is() -> None:
    """One charge rule: the local quota and the Redis gate (which charges
    `Controller.cost_of` before arrival) charge the corrected prompt plus the learned
    output, not prompt + max_tokens."""
    tenant = Tenant(name="t", tokens_per_minute=6_000)
    clock = FakeClock()
    quotas = InProcessQuotas([tenant.core_settings()])
    c = Controller(Policy(tenants=(tenant,)).core_settings(), clock, ["b0"], quotas=quotas)
    first = RequestInfo("a", "t", 1, "m", 100, 1000)
    assert c.cost_of(first) == 100 + 500  # before any usage: half of max_tokens
    c.arrive(first)
    c.step()
    c.on_finish("a", Outcome.OK, 200, 40)  # the prompt was 2x the estimate; 40 out
    second = RequestInfo("b", "t", 1, "m", 100, 1000)
    expected = c.cost_of(second)
    assert expected == round(100 * 2.0 + 40)
    # a probe larger than what is left is refused for the tokens missing (charged nothing)
    before = quotas.acquire("t", 6_000, clock.now())
    c.arrive(second)
    after = quotas.acquire("t", 6_000, clock.now())
    assert not before.ok and not after.ok
    assert after.retry_after_s - before.retry_after_s == pytest.approx(expected / 100)  # 100/s
