"""bench/reserve_frontier.py: the idealised threshold policy docs/bench.md's frontier table
comes from ("What a reserve can buy at best")."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "reserve_frontier.py"


def frontier() -> ModuleType:
    spec = importlib.util.spec_from_file_location("reserve_frontier", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclass looks its module up there
    spec.loader.exec_module(module)
    return module


def test_the_backlog_fills_the_engine_to_the_threshold_and_no_further() -> None:
    m = frontier()
    # P0 so rare that none arrives: P1/P2 alone, refilled at each end
    p = m.simulate(12, 9, p0_rate=1e-9, service=6.0, wait=0.8, horizon=1_000.0,
                   service_sigma=0.0, seed=1)  # fmt: skip
    assert p.running_mean == pytest.approx(9.0, abs=1e-9)


def test_with_room_to_spare_p0_never_waits_and_holds_its_offered_load() -> None:
    m = frontier()
    # no backlog, slots P0 never fills: every P0 request starts at once, and by Little's
    # law the engine runs rate x service of them on average
    p = m.simulate(100, 0, p0_rate=1.3, service=6.0, wait=0.8, horizon=50_000.0,
                   service_sigma=0.5, seed=1)  # fmt: skip
    assert p.p0_on_time == 1.0
    assert p.running_mean == pytest.approx(1.3 * 6.0, rel=0.03)


def test_a_higher_threshold_buys_running_requests_with_p0_waits() -> None:
    m = frontier()
    runs = [m.simulate(12, t, p0_rate=1.3, service=6.0, wait=0.8, horizon=20_000.0,
                       service_sigma=0.0, seed=1) for t in (8, 9, 10)]  # fmt: skip
    assert runs[0].running_mean < runs[1].running_mean < runs[2].running_mean
    assert runs[0].p0_on_time > runs[1].p0_on_time > runs[2].p0_on_time
