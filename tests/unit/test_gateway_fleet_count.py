"""`fleet.gateways` in the policy: a gateway that is told how many replicas share its
backends claims its part of them from its first request (1 / (gateways x workers)),
instead of the cautious 1/16 it starts from when it must learn its part; a reload that
drops the count hands the part back to the scrapes; Redis's live count wins."""

from __future__ import annotations

import pytest

from sluice.config import ConfigError, parse_policy
from sluice.gateway.app import Gateway

BASE = "tenants: [{name: a, apiKeys: [sk-a], priority: 1}]\nadmin: {apiKeys: [sk-admin]}\n"


def _gateway(extra: str = "") -> Gateway:
    return Gateway(parse_policy(BASE + extra))


async def test_a_lone_gateway_told_so_claims_the_whole_backend_from_the_start() -> None:
    assert _gateway().controller.fleet_share() == pytest.approx(1 / 16)  # must learn it
    assert _gateway("fleet: {gateways: 1}\n").controller.fleet_share() == 1.0


async def test_the_count_is_the_replicas_times_their_workers() -> None:
    gateway = _gateway("fleet: {gateways: 3}\n")
    assert gateway.controller.fleet_share() == pytest.approx(1 / 3)
    gateway.set_workers(2)  # `sluice serve --workers 2` on each of the three
    assert gateway.controller.fleet_share() == pytest.approx(1 / 6)
    assert gateway.controller.snapshot().as_dict()["fleet"]["processes"] == 6


async def test_a_reload_changes_the_count_or_hands_the_part_back_to_the_scrapes() -> None:
    gateway = _gateway("fleet: {gateways: 2}\n")
    gateway.apply_policy(parse_policy(BASE + "fleet: {gateways: 4}\n"))
    assert gateway.controller.fleet_share() == pytest.approx(0.25)
    gateway.apply_policy(parse_policy(BASE))
    assert gateway.controller.fleet_share() == pytest.approx(1 / 16)
    gateway.set_workers(2)  # workers alone are a count too
    assert gateway.controller.fleet_share() == pytest.approx(0.5)


async def test_redis_count_of_the_live_processes_wins_over_the_policy() -> None:
    redis = "redis: {url: 'redis://127.0.0.1:1/0'}\n"
    gateway = _gateway("fleet: {gateways: 1}\n" + redis)
    assert gateway.quota_gate is not None
    quotas = gateway.quota_gate.controller_quotas
    quotas.set_processes(5, 0.0)  # a heartbeat counted five
    gateway.controller.expect_peers(5)  # (its on_processes callback)
    gateway.apply_policy(parse_policy(BASE + "fleet: {gateways: 1}\n" + redis))
    assert gateway.controller.fleet_share() == pytest.approx(0.2)


@pytest.mark.parametrize("value", ["0", "-1", "two", "1.5"])
def test_a_count_that_is_not_a_positive_whole_number_is_refused_with_its_path(value: str) -> None:
    with pytest.raises(ConfigError, match=r"fleet\.gateways"):
        parse_policy(BASE + f"fleet: {{gateways: {value}}}\n")
