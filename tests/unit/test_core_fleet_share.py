"""A gateway's part of the fleet of replicas sharing its backends (core/fleet_share.py),
and how the controller feeds it: exact values, time passed in."""

from __future__ import annotations

import math

import pytest

from sluice.config import Policy
from sluice.core.clock import FakeClock
from sluice.core.controller import Controller
from sluice.core.fleet_share import FleetShare
from sluice.core.types import BackendMetrics, Outcome, RequestInfo


def test_before_any_evidence_a_replica_assumes_one_of_16() -> None:
    f = FleetShare()
    assert f.value == 1 / 16
    f.observe(0, 0, 0.0, 1.0)  # an idle backend says nothing about who else sends
    assert f.value == 1 / 16
    assert f.describe() == {"share": 1 / 16, "prior": 1 / 16, "requests_seen": 0.0}


def test_one_of_two_replicas_learns_a_half() -> None:
    f = FleetShare(prior=0.25)
    f.observe(4, 4, 8.0, 0.0)  # 8 requests there, 4 ours
    assert f.value == pytest.approx((4 + 0.25 * 4) / (8 + 4))  # 5/12
    for _ in range(99):
        f.observe(4, 4, 8.0, 0.0)
    assert f.value == pytest.approx((400 + 1) / (800 + 4))  # toward 1/2


def test_requests_sent_since_the_last_scrape_are_not_counted_as_shown() -> None:
    f = FleetShare(prior=0.25)
    # 4 of ours in flight, 2 sent since the last scrape: the engine may not show them yet
    f.observe(2, 4, 8.0, 0.0)
    assert f.value == pytest.approx((2 + 1) / (8 + 4))  # 1/4, not 5/12


def test_a_gateway_whose_scrapes_show_only_its_own_requests_is_alone() -> None:
    f = FleetShare(prior=0.25)
    f.observe(3, 3, 3.0, 0.0)
    assert f.value == pytest.approx((3 + 1) / (3 + 4))  # 3 seen: not yet sure
    f.observe(1, 3, 3.0, 0.0)  # two of them sent since: still none surely another's
    assert f.value == 1.0
    f.observe(3, 3, 4.0, 0.0)  # one there that cannot be ours (another replica's)
    assert f.value == pytest.approx((3 + 1 + 3 + 1) / (3 + 3 + 4 + 4))  # 4/7


def test_evidence_fades_with_busy_time_and_an_idle_gap_counts_little() -> None:
    f = FleetShare(0.25, tau_s=5.0, max_gap_s=0.5)
    f.observe(4, 4, 8.0, 0.0)  # one of two
    f.observe(0, 0, 8.0, 100.0)  # 100 s idle between: ages like 0.5 s; none ours now
    d = math.exp(-0.5 / 5.0)
    assert f.value == pytest.approx((4 * d + 0.25 * 4 * d) / (8 * d + 8 + 4 * d))


def test_a_known_count_of_processes_sets_the_prior() -> None:
    f = FleetShare()
    f.expect_peers(8)
    assert f.value == 0.125
    f.expect_peers(0)
    assert f.value == 1.0


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
    return Controller(policy, FakeClock(), ["b0"])


def _send(c: Controller, rid: str) -> None:
    c.arrive(RequestInfo(rid, "t", 1, "m", 300, 60))
    c.dispatch()


def _scrape(c: Controller, running: float) -> None:
    m = BackendMetrics(
        at=0.0, running=running, waiting=0.0, kv_usage=0.1, num_gpu_blocks=256, block_size=16
    )
    c.on_metrics("b0", m)


def test_the_controller_counts_as_shown_only_requests_sent_before_the_last_scrape() -> None:
    c = _controller()
    _send(c, "a")
    _send(c, "b")
    _scrape(c, running=6.0)  # a and b were sent since the start: not surely in it
    assert c.fleet_share() == pytest.approx((0 + 0.25) / (6 + 4))  # the prior: 1/16 of 4
    _send(c, "c")
    _scrape(c, running=6.0)  # a and b surely are now, c maybe not
    assert c.fleet_share() == pytest.approx((0 + 2 + 0.25) / (6 + 6 + 4))
    c.on_finish("c", Outcome.OK, prompt_tokens=300, completion_tokens=60)
    _send(c, "d")
    _scrape(c, running=6.0)  # a and b again; d is new
    assert c.fleet_share() == pytest.approx((2 + 2 + 0.25) / (18 + 4))
    assert c.snapshot()["fleet"]["share"] == pytest.approx(c.fleet_share())


def test_a_lone_controller_takes_the_whole_kv_budget() -> None:
    c = _controller()
    _scrape(c, running=0.0)  # an idle backend of 4,096 tokens
    _send(c, "a")
    _send(c, "b")  # a fresh gateway claims 1/16 of the room: b waits for a scrape
    assert c.snapshot()["backends"]["b0"]["inflight"] == 1
    for _ in range(3):
        _scrape(c, running=1.0)
        assert c.snapshot()["backends"]["b0"]["kv_budget_tokens"] < 0.8 * 4096
    _scrape(c, running=1.0)  # 4 requests seen, none another's
    assert c.fleet_share() == 1.0
    assert c.snapshot()["backends"]["b0"]["kv_budget_tokens"] == pytest.approx(0.8 * 4096)
    assert [a.request_id for a in c.dispatch()] == ["b"]
