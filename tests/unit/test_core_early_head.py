"""When a stream's head may go before its first event (core/early_head.py): only while
nothing says the backend could still refuse the request after its head."""

from __future__ import annotations

from sluice.config import Policy
from sluice.core.clock import FakeClock
from sluice.core.controller import Controller
from sluice.core.early_head import EarlyHead
from sluice.core.types import Assignment, BackendMetrics, Outcome, RequestInfo


def test_waiting_on_two_scrapes_in_a_row_holds_heads_for_the_memory() -> None:
    rule = EarlyHead(memory_s=30.0)
    assert rule.allowed(metrics_fresh=True, now=0.0)
    assert not rule.allowed(metrics_fresh=False, now=0.0)  # nothing fresh says it has room
    rule.on_scrape(2, 1.0)  # one scrape: an arrival between two engine steps
    rule.on_scrape(0, 2.0)
    rule.on_scrape(1, 3.0)
    assert rule.allowed(True, 3.0)
    rule.on_scrape(None, 4.0)  # an engine that does not say breaks the run
    rule.on_scrape(3, 5.0)
    assert rule.allowed(True, 5.0)
    rule.on_scrape(4, 6.0)  # queueing: two in a row
    assert not rule.allowed(True, 6.0)
    rule.on_scrape(0, 7.0)
    assert not rule.allowed(True, 35.9)
    assert rule.allowed(True, 36.0)


def test_an_overload_refusal_holds_heads_for_the_memory() -> None:
    rule = EarlyHead(memory_s=30.0)
    rule.on_refusal(10.0)
    assert not rule.allowed(True, 39.9)
    assert rule.allowed(True, 40.0)


def _assigned(c: Controller, rid: str) -> Assignment:
    admission = c.arrive(RequestInfo(rid, "t", 0, "m", 100, 10), take=True)
    assert admission.assignment is not None
    return admission.assignment


def test_the_controller_tells_each_assignment() -> None:
    policy = Policy.model_validate({"limiter": {"algorithm": "fixed", "fixedLimit": 8}})
    clock = FakeClock()
    c = Controller(policy.core_settings(), clock, ["b0"])
    assert not _assigned(c, "a").early_head  # no scrape yet
    c.on_metrics("b0", BackendMetrics(at=0.0, waiting=0, running=1))
    assert _assigned(c, "b").early_head
    clock.set(1.0)
    c.on_finish("b", Outcome.OVERLOADED)  # the backend refused one: it may be full
    assert not _assigned(c, "c").early_head
    clock.set(31.0)
    assert _assigned(c, "d").early_head
    c.metrics_stale("b0")
    assert not _assigned(c, "e").early_head
    c.on_metrics("b0", BackendMetrics(at=31.0, waiting=0, running=1))
    with_deadline = RequestInfo("f", "t", 0, "m", 100, 10, give_up_at=61.0)
    admission = c.arrive(with_deadline, take=True)
    assert admission.assignment is not None and not admission.assignment.early_head
    assert _assigned(c, "g").early_head  # the same moment, no deadline stated
