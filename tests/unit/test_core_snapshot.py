"""The controller's typed snapshot and its one JSON form (core/snapshot.py)."""

from __future__ import annotations

import orjson

from sluice.config import Policy
from sluice.core.clock import FakeClock
from sluice.core.controller import Controller
from sluice.core.snapshot import ControllerSnapshot
from sluice.core.types import BackendMetrics, Outcome, RequestInfo


def busy_controller() -> Controller:
    """Two backends (one scraped, one without metrics), two requests in flight on a
    limit of 2, one queued, one finished."""
    doc = {
        "limiter": {"algorithm": "sluice", "initialLimit": 2, "minLimit": 1},
        "dispatcher": {"reserved": {"p0": 0.0}},
    }
    clock = FakeClock()
    c = Controller(Policy.model_validate(doc).core_settings(), clock, ["b0", "b1"])
    c.set_backend_models("b0", ["m", "a"])
    c.set_backend_health("b1", False)
    scrape = BackendMetrics(
        at=0.0,
        running=1,
        waiting=0,
        kv_usage=0.25,
        num_gpu_blocks=10_000,
        block_size=16,
        engine="vllm",
        signals=frozenset({"running", "kv_usage"}),
    )
    c.on_metrics("b0", scrape)
    for i, tenant in enumerate(("A", "B", "A", "B")):
        c.arrive(RequestInfo(f"r{i}", tenant, 1, "m", 100, 50))
        c.step()
    clock.advance(1.0)
    c.on_finish("r0", Outcome.OK, 100, 20)
    c.step()
    return c


def test_the_snapshot_is_typed_and_its_counters_add_up() -> None:
    s = busy_controller().snapshot()
    p1 = s.classes["P1"]
    assert (p1.arrived, p1.admitted, p1.dispatched, p1.queued) == (4, 4, 3, 1)
    assert p1.finished == {"ok": 1}
    assert p1.tenants_queued == {"B": 1}
    b0 = s.backends["b0"]
    assert (b0.healthy, b0.limit, b0.inflight, b0.kv_usage, b0.models) == (
        True,
        2,
        2,
        0.25,
        ("a", "m"),
    )
    assert b0.engine == "vllm" and b0.signals is not None and b0.signals["kv_usage"] is True
    assert b0.signals["preemptions"] is False
    assert b0.limiter is not None and b0.limiter["cuts"] == 0
    b1 = s.backends["b1"]
    assert (b1.healthy, b1.metrics_fresh, b1.engine, b1.signals) == (False, False, None, None)
    assert s.algorithm == "sluice" and s.fleet.share == 1 / 16  # the prior: no evidence yet


def test_as_dict_is_the_json_shape_and_from_dict_reads_it_back() -> None:
    s = busy_controller().snapshot()
    d = s.as_dict()
    assert list(d) == [
        "pressure",
        "algorithm",
        "expected_ttft_s",
        "aged_dispatches",
        "fleet",
        "classes",
        "backends",
    ]
    assert list(d["classes"]) == ["P0", "P1", "P2"]
    assert list(d["classes"]["P1"]) == [
        "name",
        "queued",
        "head_sojourn_s",
        "dispatch_rate",
        "arrival_rate",
        "retry_after_s",
        "returns",
        "tenants_queued",
        "arrived",
        "admitted",
        "rejected",
        "dispatched",
        "dropped",
        "cancelled_queued",
        "cancelled_inflight",
        "finished",
    ]
    assert list(d["backends"]["b0"]) == [
        "healthy",
        "limit",
        "inflight",
        "inflight_tokens",
        "kv_budget_tokens",
        "kv_usage",
        "waiting",
        "metrics_fresh",
        "models",
        "engine",
        "signals",
        "outputs_bounded",
        "ceiling",
        "limiter",
    ]
    assert d["backends"]["b0"]["models"] == ["a", "m"]  # a list in the JSON
    assert list(d["fleet"]) == ["share", "estimate", "prior", "processes", "requests_seen"]
    # what a gateway's /admin/state serves, read back (the real-mode bench) is the same value
    served = orjson.loads(orjson.dumps(d))
    assert ControllerSnapshot.from_dict(served) == s


def test_a_limiter_with_nothing_to_describe_has_no_limiter_key() -> None:
    doc = {"limiter": {"algorithm": "fixed", "fixedLimit": 3}}
    c = Controller(Policy.model_validate(doc).core_settings(), FakeClock(), ["b0"])
    s = c.snapshot()
    assert s.backends["b0"].limiter is None
    assert "limiter" not in s.as_dict()["backends"]["b0"]
