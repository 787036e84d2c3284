"""`sluice serve --workers N`: N processes on one port (SO_REUSEPORT), each with its own
limiters, whose /metrics add up whichever worker answers the scrape."""

from __future__ import annotations

import os
import re
import signal
import time

import httpx
import pytest
from conftest import SimFactory
from gateway_proc import GatewayProcess, start_gateway

from sluice.bench.prom_text import parse_metrics

pytestmark = pytest.mark.integration

POLICY = """
tenants:
  - {name: agents, apiKeys: [sk-demo-p1], priority: 1}
admin: {apiKeys: [sk-demo-admin]}
limiter: {algorithm: fixed, fixedLimit: 3}
server: {shutdownGrace: 2s}
"""
BODY = {"model": "sluice-sim", "max_tokens": 5, "ignore_eos": True, "prompt": [1, 2, 3]}
AUTH = {"Authorization": "Bearer sk-demo-p1"}


def _worker_pids(gw: GatewayProcess) -> list[int]:
    line = next(x for x in gw.output if "Sluice listening on" in x)
    match = re.search(r"pids ([\d, ]+)\)", line)
    assert match is not None, line
    return [int(p) for p in match.group(1).split(", ")]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _wait_gone(pids: list[int], within: float) -> None:
    deadline = time.monotonic() + within
    while any(_alive(p) for p in pids):
        assert time.monotonic() < deadline, f"workers still running: {pids}"
        time.sleep(0.02)


def _post_alone(gw: GatewayProcess) -> httpx.Response:
    """One completion on a connection of its own: the kernel picks a worker for each."""
    return httpx.post(
        gw.url + "/v1/completions",
        json=BODY,
        headers={**AUTH, "Connection": "close"},
        timeout=10,
    )


def _scrape(gw: GatewayProcess) -> dict[str, float]:
    # a new connection each time, so the kernel may pick either worker
    return parse_metrics(httpx.get(gw.url + "/metrics", headers={"Connection": "close"}).text)


def test_workers_share_the_port_and_their_metrics_add_up(sim_factory: SimFactory) -> None:
    sim = sim_factory("--profile", "tiny", "--speed", "4")
    gw = start_gateway([sim.url], POLICY, "--workers", "2")
    pids = _worker_pids(gw)
    try:
        assert len(set(pids)) == 2
        with open(f"/proc/{pids[0]}/environ", "rb") as f:
            env = f.read().split(b"\0")
        metrics_dir = next(e for e in env if e.startswith(b"PROMETHEUS_MULTIPROC_DIR="))
        metrics_dir_path = metrics_dir.split(b"=", 1)[1].decode()
        assert os.path.isdir(metrics_dir_path)

        served_by: set[int] = set()
        n = 40
        for _ in range(n):  # one connection per request: the kernel spreads them
            r = _post_alone(gw)
            assert r.status_code == 200
            served_by.add(int(r.headers["X-Request-Id"].split("-")[0], 16))
        assert served_by == set(pids)  # both workers served

        for _ in range(6):  # every scrape, whichever worker answers it, sees all of them
            m = _scrape(gw)
            assert m['sluice_requests_total{outcome="ok",priority="1",route="completions"}'] == n
            assert m['sluice_request_duration_seconds_count{priority="1",route="completions"}'] == n
        # each worker has its own limiter (fixed at 3): the limits add up
        deadline = time.monotonic() + 5
        while _scrape(gw).get('sluice_backend_limit{backend="backend-0"}') != 6.0:
            assert time.monotonic() < deadline, _scrape(gw)
            time.sleep(0.1)
        m = _scrape(gw)
        assert m['sluice_backend_healthy{backend="backend-0"}'] == 1.0
        assert m['sluice_queue_depth{priority="1"}'] == 0.0
        assert m["sluice_policy_last_reload_ok"] == 1.0
    finally:
        code = gw.stop()
    assert code == 0
    _wait_gone(pids, 5.0)
    assert not os.path.exists(metrics_dir_path)  # the master cleans up after itself


def test_with_no_backend_the_master_runs_the_simulated_backends_for_all(
    sim_factory: SimFactory,
) -> None:
    gw = start_gateway([], POLICY, "--workers", "2", "--sim-profile", "tiny", "--sim-speed", "4")
    pids = _worker_pids(gw)
    try:
        line = next(x for x in gw.output if "No backend configured" in x)
        assert "shared by 2 workers" in line
        urls = re.findall(r"http://127\.0\.0\.1:\d+", line)
        assert len(urls) == 2
        for _ in range(10):
            r = _post_alone(gw)
            assert r.status_code == 200
        # one set of simulators, in the master, served every worker
        total = sum(
            parse_metrics(httpx.get(u + "/metrics").text)["vllm:request_success_total"]
            for u in urls
        )
        assert total == 10
    finally:
        assert gw.stop() == 0
    _wait_gone(pids, 5.0)


def test_a_worker_that_dies_stops_the_gateway_instead_of_running_half_sized(
    sim_factory: SimFactory,
) -> None:
    sim = sim_factory("--profile", "tiny")
    gw = start_gateway([sim.url], POLICY, "--workers", "2")
    pids = _worker_pids(gw)
    try:
        os.kill(pids[0], signal.SIGKILL)
        code = gw.proc.wait(timeout=10)
    finally:
        gw.stop()
    assert code == 1
    _wait_gone(pids, 5.0)
    assert any("exited with code -9" in x for x in gw.output)


def test_workers_must_be_a_positive_number() -> None:
    with pytest.raises(RuntimeError, match="must be at least 1"):
        start_gateway([], POLICY, "--workers", "0", timeout=10)
