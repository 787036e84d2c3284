"""Pressure: one number in [0, 1] from limit use, queue delay, backlog and backends."""

from __future__ import annotations

import pytest

from sluice.config import Policy
from sluice.core.clock import FakeClock
from sluice.core.controller import Controller
from sluice.core.pressure import PressureInputs, backend_congestion, compute_pressure
from sluice.core.types import BackendMetrics, RequestInfo


def inputs(**kw: float) -> PressureInputs:
    base = {
        "inflight": 0,
        "limit_total": 10,
        "queued": 0,
        "max_sojourn_ratio": 0.0,
        "backend_congestion": 0.0,
    }
    base.update(kw)
    return PressureInputs(**base)  # type: ignore[arg-type]


def test_formula() -> None:
    assert compute_pressure(inputs()) == 0.0
    assert compute_pressure(inputs(inflight=5)) == 0.25
    assert compute_pressure(inputs(inflight=10)) == 0.5  # saturated, keeping up
    assert compute_pressure(inputs(inflight=10, queued=4)) == 0.7  # backlog 0.4
    assert compute_pressure(inputs(inflight=10, queued=4, max_sojourn_ratio=0.8)) == 0.9
    assert compute_pressure(inputs(inflight=10, queued=40, max_sojourn_ratio=3.0)) == 1.0
    assert compute_pressure(inputs(inflight=2, backend_congestion=1.0)) == 0.6
    assert compute_pressure(inputs(limit_total=0)) == 0.5  # nothing healthy
    assert compute_pressure(inputs(limit_total=0, queued=1)) == 1.0


def test_backend_congestion() -> None:
    assert backend_congestion(None, None) == 0.0
    assert backend_congestion(0.5, 0) == 0.0
    assert backend_congestion(0.9, 0) == pytest.approx(0.5)  # (0.9 - 0.85) / 0.1
    assert backend_congestion(0.99, None) == 1.0
    assert backend_congestion(0.1, 3) == 1.0  # the backend is queueing


def test_controller_pressure_from_its_state() -> None:
    pol = Policy.model_validate({"limiter": {"algorithm": "fixed", "fixedLimit": 2}})
    clock = FakeClock()
    c = Controller(pol.core_settings(), clock, ["b0", "b1"])
    for i in range(4):
        c.arrive(RequestInfo(f"r{i}", "t", 0, "m", 10, 10))
    assert c.pressure() == 0.5 * 0 + 0.5 * 1.0  # 4 queued / limit 4, nothing in flight
    c.step()
    assert c.pressure() == 0.5  # 4 in flight of 4
    c.arrive(RequestInfo("q", "t", 1, "m", 10, 10))
    clock.set(7.5)  # P1 timeout 15 s: sojourn ratio 0.5 beats backlog 1/4
    assert c.pressure() == 0.75
    c.on_metrics("b0", BackendMetrics(at=7.5, kv_usage=0.5, waiting=2))
    c.on_metrics("b1", BackendMetrics(at=7.5, kv_usage=0.5, waiting=0))
    assert c.pressure() == 0.75  # backends: mean(1, 0) = 0.5
    c.on_metrics("b1", BackendMetrics(at=7.6, kv_usage=0.96))
    assert c.pressure() == 1.0
    c.metrics_stale("b0")
    c.metrics_stale("b1")
    assert c.pressure() == 0.75
    c.set_backend_health("b1", False)  # 2 in flight on b0 of its 2; b1 no longer counts
    assert c.pressure() == 0.5 + 0.5 * 0.5
