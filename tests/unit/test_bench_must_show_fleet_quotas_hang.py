"""`sluice bench fleet-quotas-hang`, in virtual time: the 4 replicas of `fleet-quotas`
sharing tenant quotas through Redis, which hangs (every call times out, its data kept)
from 35 to 60 s while the replicas are replaced one by one from 40 s. Only the fleet's
arm runs (the quota figures need no reference arm; 9 s of CPU).

What must hold (bench/quota_figures.py has the definitions):

* a hanging Redis costs the first requests a stall, not a timeout each: the replicas go
  local within STALL_S of the hang, no request goes through unchecked, and P0 (chat-app
  has a quota) keeps its TTFT;
* a replica started while Redis is lost holds its estimated part of the fleet, not every
  quota: the shares held at once stay within half a quota of one;
* the replicas drained while Redis is lost hand back within their grace, nothing is
  forgiven, and once all are back Redis offers no more than one exact bucket beyond what
  it cannot learn of;
* a tenant is not left in debt by the hand-back: after the return it gets what one exact
  bucket allows, with short Retry-Afters.

Before (the same run on the parent of these fixes): P0 93.6 % (TTFT p95 1.03 s), 115 of
batch-etl's requests unchecked, the shares summing to 5.0 (the replacements whole),
batch-etl admitted 512,143 tokens a minute during the outage against 100,000, 12,170 of
its tokens never handed back, 43,623 forgiven, Retry-After up to 60 s after the return.
A failure gives the measured figures. Not weakened to pass."""

from __future__ import annotations

from typing import Any

import pytest

from sluice.bench.runner import run_virtual
from sluice.bench.scenario import load_scenario
from sluice.core.fleet_share import PRIOR
from sluice.core.quota_failover import STALL_S

LIMITS = (("tokens", "tokens_per_minute"), ("requests", "requests_per_minute"))
HANG_AT = 35.0
ORIGINALS = {0, 1, 2, 3}  # the replicas from the start; 4-7 replace them during the hang


@pytest.fixture(scope="module")
def results() -> dict[str, Any]:
    return run_virtual(load_scenario("fleet-quotas-hang"), arms=["sluice"])


def _tenants(results: dict[str, Any]) -> dict[str, Any]:
    tenants: dict[str, Any] = results["arms"]["sluice"]["quotas"]["tenants"]
    return tenants


def _limits(t: dict[str, Any]) -> list[str]:
    return [what for what, key in LIMITS if t[key]]


def _period(t: dict[str, Any], name: str) -> dict[str, Any]:
    period: dict[str, Any] = next(p for p in t["periods"] if p["name"] == name)
    return period


def test_the_replicas_go_local_within_a_stall_and_nothing_goes_unchecked(
    results: dict[str, Any],
) -> None:
    for name, t in _tenants(results).items():
        (o,) = t["outages"]
        firsts = {s["replica"]: s["t"] for s in o["shares"] if s["replica"] in ORIGINALS}
        # a stall, then the loop's turn and a round trip at most
        assert max(firsts.values()) <= HANG_AT + STALL_S + 0.05, (
            f"{name}: the replicas went local at {firsts} s, Redis hung at {HANG_AT:g} s "
            f"(want within {STALL_S} s; before: 1.5-2.8 s)"
        )
        assert o["unchecked_requests"] == 0, (
            f"{name}: {o['unchecked_requests']} requests let through unchecked (before: 115 "
            "of batch-etl's)"
        )
    p0 = results["arms"]["sluice"]["classes"]["P0"]
    assert p0["ttft_p95_s"] < 0.5 and p0["slo_attainment"] >= 0.97, (
        f"P0 TTFT p95 {p0['ttft_p95_s']} s, SLO {p0['slo_attainment']} (want < 0.5 s and "
        ">= 97 %; before 1.03 s and 93.6 %: each of chat-app's requests waited the 1 s call "
        "timeout)"
    )
    assert _tenants(results)["chat-app"]["refusals"]["tenant_quota"] == 0


def test_replicas_started_while_redis_is_lost_are_not_alone(results: dict[str, Any]) -> None:
    for name, t in _tenants(results).items():
        (o,) = t["outages"]
        fresh = [s["fraction"] for s in o["shares"] if s["replica"] not in ORIGINALS]
        # no count: the fleet prior (1/16), or what a first scrape of its own requests
        # estimated if one came before its first request went local (1/12 for the first
        # replacement since the limiter's calm floor, session 14), never below the prior;
        # not a whole quota (before the fix: 1.0 each)
        assert len(fresh) == 4 and all(PRIOR <= f <= 1 / 8 for f in fresh), (
            f"{name}: the replacements took {fresh} (before: 1.0 each)"
        )
        # the others' shares (one quota) and a replacement's estimate, which runs above
        # a quarter at times (1.22 on this seed, 1.32 on seed 3)
        assert o["fraction_sum_held_max"] <= 1.5, (
            f"{name}: the replicas held {o['fraction_sum_held_max']} of the quota at once "
            "(want <= 1.5; before: every replacement a whole quota, 5.0 in all)"
        )
        for what in _limits(t):
            f = o[what]
            assert f["local_admitted"] <= f["failover_bound"], (
                f"{name}: {f['local_admitted']} {what} admitted while Redis hung, over the "
                f"failover bound {f['failover_bound']} (the shares' levels "
                f"{f['shares_start']} + their refill {f['shares_refill']} + given back "
                f"{f['given_back_by_earlier']} + overdraw {f['local_overdraw']})"
            )


def test_every_replica_hands_back_and_nothing_is_forgiven(results: dict[str, Any]) -> None:
    for name, t in _tenants(results).items():
        (o,) = t["outages"]
        assert o["replicas_handed_back"] == 8, (
            f"{name}: {o['replicas_handed_back']} of 8 replicas handed back (the 4 drained "
            "during the hang within their grace; before: 4, their use lost)"
        )
        assert t["forgiven"] == {"tokens": 0, "requests": 0}, f"{name}: forgave {t['forgiven']}"
        after = _period(t, "after")
        for what in _limits(t):
            ret = o[f"return_{what}"]
            assert ret["not_handed_back"] == 0
            assert ret["handed_out_twice"] <= ret["bound"], (
                f"{name}: once every replica had handed back ({o['hand_back_done_s']} s) "
                f"Redis held {ret['store_after']} {what} where one exact bucket held "
                f"{ret['ideal_after']}: {ret['handed_out_twice']} handed out twice, over "
                f"{ret['bound']}"
            )
            # the debt to one exact bucket as the hang ended (the replacements' first
            # buckets) is charged back: it does not grow after the return
            during = _period(t, "outage")[f"excess_over_overdraw_{what}_max"]
            over = after[f"excess_over_overdraw_{what}_max"]
            assert over <= max(ret["handed_out_twice"], during), (
                f"{name}: after the return the fleet's debt to one exact bucket grew from "
                f"{during} to {over} {what} past the overdraw (before: 129,779 to 133,443 "
                "of batch-etl's tokens)"
            )


def test_a_tenant_is_not_left_in_debt_after_the_return(results: dict[str, Any]) -> None:
    tenants = _tenants(results)
    for name, what in (("agents", "requests"), ("batch-etl", "tokens")):
        t = tenants[name]
        p = _period(t, "after")
        used = p[f"admitted_{what}"] / p[f"allowed_{what}"]
        assert used >= 0.9, (
            f"{name} after the return: admitted {p[f'admitted_{what}']} {what} of the "
            f"{p[f'allowed_{what}']} one exact bucket allows ({100 * used:.1f} %, want >= 90 %)"
        )
        retry = t["refusals"]["retry_after_max_s"]
        assert retry < 30, f"{name}: Retry-After up to {retry} s (before: 60 s, in debt)"
