"""Profiles (public figures, overrides, speed) and the Prometheus exposition."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest
from prometheus_client.parser import text_string_to_metric_families

from sluice.sim.driver import EngineDriver, RequestHandle
from sluice.sim.engine import Engine, EngineRequest, StepResult
from sluice.sim.metrics import SimMetrics, build_1_2_5_buckets
from sluice.sim.profiles import PROFILES, get_profile

H100 = PROFILES["h100-llama3-8b"]
TINY = PROFILES["tiny"]


def test_the_h100_profile_follows_the_public_figures() -> None:
    # Llama-3-8B: 2 (K and V) x 32 layers x 8 KV heads x 128 dims x 2 bytes
    assert 2 * 32 * 8 * 128 * 2 == 128 * 1024
    assert H100.kv_capacity_tokens == 448_000
    assert H100.kv_capacity_tokens * 128 * 1024 / 2**30 == pytest.approx(54.7, abs=0.1)
    assert (H100.max_num_seqs, H100.max_num_batched_tokens, H100.block_size) == (1024, 8192, 16)
    # prefill near 25k tokens/s; one decode step of one request near 6 ms
    assert 1 / H100.per_token_s == pytest.approx(24_600, rel=0.05)
    assert H100.step_time(1, 100, 100) == pytest.approx(0.0061, abs=0.0002)


def test_the_tiny_profile_is_exhausted_by_a_few_dozen_long_requests() -> None:
    assert 10 <= TINY.kv_capacity_tokens // 300 <= 30
    assert TINY.step_time(1, 0, 0) < 0.01


def test_profile_overrides_and_speed() -> None:
    bigger = dataclasses.replace(TINY, num_gpu_blocks=1024)
    assert bigger.kv_capacity_tokens == 16_384
    fast = TINY.scaled(10)
    assert fast.step_overhead_s == pytest.approx(TINY.step_overhead_s / 10)
    assert fast.num_gpu_blocks == TINY.num_gpu_blocks
    with pytest.raises(ValueError):
        TINY.scaled(0)
    with pytest.raises(ValueError, match="unknown profile"):
        get_profile("nope")


def test_token_buckets_are_vllms_1_2_5_series() -> None:
    assert build_1_2_5_buckets(2048) == (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000)


def _samples(metrics: SimMetrics) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = metrics.exposition().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_exposition_reflects_the_engine_and_its_steps() -> None:
    engine = Engine(
        dataclasses.replace(TINY, step_overhead_s=0.05, per_token_s=0.0, per_kv_token_s=0.0)
    )
    metrics = SimMetrics(engine, "m")
    engine.submit(EngineRequest("a", 16, 3, 3), now=0.0)
    engine.submit(EngineRequest("b", 16, 3, 3), now=0.0)
    now = 0.0
    while engine.has_work():
        result = engine.step(now)
        metrics.observe_step(result)
        now = result.end
    s = _samples(metrics)
    lab = (("engine", "0"), ("model_name", "m"))
    assert s[("vllm:num_requests_running", lab)] == 0
    assert s[("vllm:generation_tokens_total", lab)] == 6
    assert s[("vllm:prompt_tokens_total", lab)] == 32
    assert s[("vllm:request_success_total", (*lab[:1], ("finished_reason", "length"), lab[1]))] == 2
    # TTFT 0.05 s for both (one prefill step); 4 inter-token latencies of 0.05 s
    assert s[("vllm:time_to_first_token_seconds_count", lab)] == 2
    assert s[("vllm:time_to_first_token_seconds_bucket", (*lab[:1], ("le", "0.04"), lab[1]))] == 0
    assert s[("vllm:time_to_first_token_seconds_bucket", (*lab[:1], ("le", "0.06"), lab[1]))] == 2
    assert s[("vllm:inter_token_latency_seconds_count", lab)] == 4
    assert s[("vllm:inter_token_latency_seconds_sum", lab)] == pytest.approx(0.2)
    assert s[("vllm:e2e_request_latency_seconds_sum", lab)] == pytest.approx(0.3)
    assert s[("vllm:request_time_per_output_token_seconds_sum", lab)] == pytest.approx(0.1)


def test_each_metrics_object_has_its_own_registry() -> None:
    a = SimMetrics(Engine(TINY), "a")
    b = SimMetrics(Engine(TINY), "b")
    assert a.registry is not b.registry
    assert b'model_name="a"' in a.exposition() and b'model_name="a"' not in b.exposition()


async def test_the_driver_delivers_tokens_in_real_time_and_sleeps_when_idle() -> None:
    profile = dataclasses.replace(TINY, step_overhead_s=0.002, per_token_s=0.0)
    driver = EngineDriver(Engine(profile))
    driver.start()
    try:
        handle = RequestHandle(lambda i, reason: f"{i}:{reason};".encode())
        loop = asyncio.get_running_loop()
        started = loop.time()
        driver.submit(EngineRequest("a", 10, 5, 5), handle)
        received = b""
        while not handle.done:
            await handle.wait()
            received += handle.take()
        elapsed = loop.time() - started
        assert received == b"0:None;1:None;2:None;3:None;4:length;"
        assert elapsed >= 5 * 0.002  # five steps of 2 ms, not faster
        steps = driver.steps
        assert steps == 5
        await asyncio.sleep(0.05)  # observe: an idle engine does not step
        assert driver.steps == steps
    finally:
        await driver.stop()


async def test_the_driver_aborts_at_the_next_step() -> None:
    steps: asyncio.Queue[StepResult] = asyncio.Queue()
    driver = EngineDriver(Engine(TINY), on_step=steps.put_nowait)
    driver.start()
    try:
        driver.submit(EngineRequest("a", 100, 1000, 1000), RequestHandle(None))
        first = await steps.get()
        assert first.num_prompt_tokens == 100 and driver.engine.num_running == 1
        # Steps computed so far; the last one is in progress (it runs to its end, with a
        # token for "a") and the abort lands in the one after it.
        in_progress = driver.steps
        driver.abort("a")
        seen = 1
        while seen < in_progress:
            step = await steps.get()
            seen += 1
            assert step.finished == [] and len(step.tokens) == 1
        nxt = await steps.get()
        assert [(f.request_id, f.finish_reason) for f in nxt.finished] == [("a", "abort")]
        assert driver.engine.num_running == 0
        assert driver.engine.free_blocks == TINY.num_gpu_blocks
    finally:
        await driver.stop()


async def test_metrics_report_the_last_step_as_vllm_does_not_a_request_just_submitted() -> None:
    """vLLM V1 publishes its scheduler's stats at the end of each step; a request that
    arrives during a step is handed to the scheduler before the next one, so it is never
    counted as waiting unless a step leaves it unscheduled (issue 16: the simulator used
    to count it, and its scrapes showed waiting requests an idle-capacity vLLM never
    shows)."""
    profile = dataclasses.replace(TINY, step_overhead_s=0.02, per_token_s=0.0)
    engine = Engine(profile)
    driver = EngineDriver(engine)
    metrics = SimMetrics(engine, "m", snapshot=lambda: driver.published)
    driver.start()

    def gauges() -> tuple[float, float]:
        values = {
            s.name: s.value
            for fam in text_string_to_metric_families(metrics.exposition().decode())
            for s in fam.samples
        }
        return values["vllm:num_requests_running"], values["vllm:num_requests_waiting"]

    try:
        a = RequestHandle(lambda i, reason: b".")
        driver.submit(EngineRequest("a", 10, 50, 50), a)
        await a.wait()  # a's first step ended; the next one is running
        a.take()
        b = RequestHandle(lambda i, reason: b".")
        driver.submit(EngineRequest("b", 10, 5, 5), b)  # during that step
        assert engine.num_waiting == 1  # the engine holds it ...
        assert gauges() == (1.0, 0.0)  # ... but no step has left it waiting
        await b.wait()  # the step after that one scheduled it
        assert gauges() == (2.0, 0.0)
    finally:
        await driver.stop()
