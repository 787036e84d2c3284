"""A gateway's part of the fleet of replicas sharing its backends (core/fleet_share.py),
and how the controller feeds it: exact values, time passed in."""

from __future__ import annotations

import math

import pytest

from sluice.config import Policy
from sluice.core.clock import FakeClock
from sluice.core.controller import Controller
from sluice.core.fleet_share import FleetShare
from sluice.core.snapshot import FleetSnapshot
from sluice.core.types import BackendMetrics, Outcome, RequestInfo


def test_before_any_evidence_a_replica_assumes_one_of_16() -> None:
    f = FleetShare()
    assert f.value == 1 / 16
    f.observe(0, 0, 0.0, 1.0)  # an idle backend says nothing about who else sends
    assert f.value == 1 / 16
    assert f.describe() == FleetSnapshot(
        share=1 / 16, estimate=0.0625, prior=1 / 16, processes=None, requests_seen=0.0
    )


def test_one_of_two_replicas_learns_a_half() -> None:
    f = FleetShare(prior=0.25)
    f.observe(4, 0, 8.0, 0.0)  # 8 requests there, 4 ours
    assert f.value == pytest.approx((4 + 0.25 * 4) / (8 + 4))  # 5/12
    for _ in range(99):
        f.observe(4, 0, 8.0, 0.0)
    assert f.value == pytest.approx((400 + 1) / (800 + 4))  # toward 1/2


def test_requests_in_flight_count_as_shown_up_to_what_the_scrape_shows() -> None:
    f = FleetShare(prior=0.25)
    f.observe(4, 0, 8.0, 0.0)  # 4 of ours in flight (some sent since the engine's step)
    assert f.value == pytest.approx((4 + 1) / (8 + 4))
    f.observe(6, 0, 3.0, 0.0)  # 6 of ours in flight, 3 shown: at most 3 are ours there
    assert f.value == pytest.approx((4 + 3 + 1) / (8 + 3 + 4))


def test_the_share_never_falls_below_the_prior() -> None:
    f = FleetShare(prior=0.25)
    for _ in range(50):
        f.observe(0, 0, 10.0, 0.0)  # the others hold everything
    assert f.estimate == pytest.approx(1 / (500 + 4))
    assert f.value == 0.25  # a starved replica keeps claiming its prior


def test_a_gateway_whose_scrapes_show_only_its_own_requests_is_alone() -> None:
    f = FleetShare(prior=0.25)
    f.observe(3, 0, 3.0, 0.0)
    assert f.value == pytest.approx((3 + 1) / (3 + 4))  # 3 seen: not yet sure
    f.observe(3, 0, 3.0, 0.0)  # 6 seen, none another's
    assert f.value == 1.0
    f.observe(3, 0, 4.0, 0.0)  # one there that cannot be ours: 1 of 10 (another's)
    assert f.value == pytest.approx((3 + 3 + 3 + 1) / (3 + 3 + 4 + 4))  # 5/7


def test_a_lone_gateway_is_alone_again_after_a_stray_request() -> None:
    """The bug of `sluice bench fleet`'s one gateway (share 0.56 for good): a request the
    engine still showed that was not in flight (an abort it had not processed yet)
    counted as another replica's, and the ratio of such strays to requests seen never
    went back to 0 as both faded with the same decay."""
    clock = FakeClock()
    f = FleetShare()
    d = math.exp(-0.25 / 5.0)
    f.observe(4, 0, 4.0, clock.now())
    clock.advance(0.25)
    f.observe(3, 0, 4.0, clock.now())  # one there that is not ours: 1 of 8 seen
    assert f.value == pytest.approx((4 * d + 3 + 0.25 * d) / (4 * d + 4 + 4 * d))
    for _ in range(30):  # 7.5 s of only ours: the stray fades under 2 % of what was seen
        clock.advance(0.25)
        f.observe(4, 0, 4.0, clock.now())
    assert f.value == 1.0
    clock.advance(0.25)
    f.observe(3, 1, 4.0, clock.now())  # one of ours left since the last scrape: not a peer
    assert f.value == 1.0


def test_evidence_fades_with_busy_time_and_an_idle_gap_counts_little() -> None:
    f = FleetShare(0.25, tau_s=5.0, max_gap_s=0.5)
    f.observe(4, 0, 8.0, 0.0)  # one of two
    f.observe(0, 0, 8.0, 100.0)  # 100 s idle between: ages like 0.5 s; none ours now
    d = math.exp(-0.5 / 5.0)
    assert f.estimate == pytest.approx((4 * d + 0.25 * 4 * d) / (8 * d + 8 + 4 * d))


def test_a_known_count_of_processes_is_the_share() -> None:
    f = FleetShare()
    f.observe(8, 0, 8.0, 0.0)
    f.observe(8, 0, 8.0, 0.0)
    assert f.value == 1.0  # alone, as far as the scrapes tell
    f.expect_peers(8)
    assert f.value == 0.125  # eight processes (--workers, Redis): 1/8 whatever they show
    f.expect_peers(0)
    assert f.value == 1.0


def test_a_withdrawn_count_leaves_the_share_to_the_scrapes_again() -> None:
    f = FleetShare()
    f.expect_peers(1)  # the policy said: one gateway
    assert f.value == 1.0 and not f.fresh
    f.expect_peers(None)  # a reload dropped `fleet.gateways`
    assert f.fresh and f.prior == 1 / 16 and f.value == 1 / 16
    f.observe(2, 0, 4.0, 0.0)  # half of what the backend shows is ours
    assert f.value == pytest.approx((2 + 1 / 16 * 4) / (4 + 4))


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"prior": 0.0}, "prior"),
        ({"prior": 1.5}, "prior"),
        ({"prior_weight": 0.0}, "prior_weight"),
        ({"tau_s": 0.0}, "tau_s"),
        ({"max_gap_s": -1.0}, "max_gap_s"),
    ],
)
def test_bad_parameters_are_refused(kwargs: dict[str, float], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        FleetShare(**kwargs)


# -- the controller feeds it from its scrapes ----------------------------------------------


def _controller() -> Controller:
    policy = Policy.model_validate(
        {
            "limiter": {"algorithm": "sluice", "initialLimit": 8, "maxLimit": 64},
            "dispatcher": {"reserved": {"p0": 0.0}},
        }
    )
    return Controller(policy.core_settings(), FakeClock(), ["b0"])


def _send(c: Controller, rid: str) -> None:
    c.arrive(RequestInfo(rid, "t", 1, "m", 300, 60))
    c.step()


def _scrape(c: Controller, running: float) -> None:
    m = BackendMetrics(
        at=0.0, running=running, waiting=0.0, kv_usage=0.1, num_gpu_blocks=256, block_size=16
    )
    c.on_metrics("b0", m)


def test_the_controller_counts_its_requests_in_flight_and_those_that_just_left() -> None:
    c = _controller()
    _send(c, "a")
    _send(c, "b")
    _scrape(c, running=6.0)  # a and b of 6
    assert c.fleet_share() == pytest.approx((2 + 0.25) / (6 + 4))
    _send(c, "c")
    c.on_finish("a", Outcome.CANCELLED, prompt_tokens=300, completion_tokens=0)
    _scrape(c, running=6.0)  # b and c of 6; a left since: maybe shown, not another's
    assert c.fleet_share() == pytest.approx((2 + 2 + 0.25) / (6 + 6 + 4))
    assert c.snapshot().fleet.share == pytest.approx(c.fleet_share())


def test_a_lone_controller_takes_the_whole_kv_budget() -> None:
    c = _controller()
    _send(c, "a")  # before any scrape: no budget yet
    for _ in range(3):
        _scrape(c, running=1.0)  # 1, 2, 3 requests seen: not yet sure it is alone
        assert c.fleet_share() < 1.0
        assert c.snapshot().backends["b0"].kv_budget_tokens < 0.8 * 4096
    _scrape(c, running=1.0)  # 4 requests seen, none another's
    assert c.fleet_share() == 1.0
    assert c.snapshot().backends["b0"].kv_budget_tokens == pytest.approx(0.8 * 4096)
    _send(c, "b")
    assert c.snapshot().backends["b0"].inflight == 2
