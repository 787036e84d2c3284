"""The kit the bench, bench/overhead and the tests share: Prometheus text views and /proc."""

from __future__ import annotations

import os
import subprocess
import sys

from sluice.bench.procfs import CpuSampler, cpu_summary, process_cpu_s, process_tree, rss_mib
from sluice.bench.prom_text import first, gauge_values, parse_metrics, series

EXPOSITION = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 3.0
# HELP vllm:request_success_total Count of successfully processed requests.
# TYPE vllm:request_success_total counter
vllm:request_success_total{engine="0",finished_reason="stop",model_name="m"} 5.0
vllm:request_success_total{engine="0",finished_reason="abort",model_name="m"} 2.0
vllm:request_success_total{engine="1",finished_reason="abort",model_name="m"} 1.0
# HELP sluice_up Up.
# TYPE sluice_up gauge
sluice_up 1.0
"""


def test_parse_metrics_sums_over_labels_and_drops_the_engine_labels() -> None:
    m = parse_metrics(EXPOSITION)
    assert m["vllm:num_requests_running"] == 3.0
    assert m["vllm:request_success_total"] == 8.0
    assert m['vllm:request_success_total{finished_reason="abort"}'] == 3.0
    key = 'vllm:request_success_total{engine="1",finished_reason="abort",model_name="m"}'
    assert m[key] == 1.0
    assert m["sluice_up"] == 1.0


def test_series_keeps_each_label_set_and_first_finds_one() -> None:
    s = series(EXPOSITION)
    assert len(s) == 5
    assert s[("vllm:request_success_total", (("engine", "1"), ("finished_reason", "abort"),
                                              ("model_name", "m")))] == 1.0  # fmt: skip
    assert first(s, "vllm:num_requests_running") == 3.0
    assert first(s, "vllm:missing") is None


def test_gauge_values_is_the_same_sum_by_a_line_scan() -> None:
    names = ("vllm:num_requests_running", "vllm:request_success_total", "sluice_up", "absent")
    assert gauge_values(EXPOSITION, names) == {
        "vllm:num_requests_running": 3.0,
        "vllm:request_success_total": 8.0,
        "sluice_up": 1.0,
        "absent": 0.0,
    }


def test_process_cpu_and_tree_of_live_and_gone_processes() -> None:
    child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"],
                             stdin=subprocess.PIPE)  # fmt: skip
    try:
        assert child.pid in process_tree(os.getpid())
        assert process_tree(child.pid) == [child.pid]
        assert (process_cpu_s(os.getpid()) or 0.0) > 0.0
        assert rss_mib(os.getpid()) > 1.0
    finally:
        assert child.stdin is not None
        child.stdin.close()
        child.wait()
    assert process_cpu_s(child.pid) is None
    assert rss_mib(child.pid) == 0.0


def test_cpu_summary_flags_a_saturated_machine() -> None:
    assert cpu_summary([0.5, 0.95])["saturated"] is True
    assert cpu_summary([0.5, 0.6]) | {"cores": None} == {
        "busy_fraction_max": 0.6, "busy_fraction_mean": 0.55, "cores": None, "samples": 2,
        "saturated": False,
    }  # fmt: skip
    assert cpu_summary([])["saturated"] is False
    sampler = CpuSampler()
    sampler.sample()
    assert 0.0 <= sampler.mean() <= 1.0
