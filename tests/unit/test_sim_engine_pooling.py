"""Prefill-only (pooling) requests in the simulated engine and in its vLLM metrics: KV
blocks for the prompt only, done in the step that computes it, no token, counted as vLLM
V1 counts a pooling request."""

from __future__ import annotations

import asyncio

import pytest
from prometheus_client.parser import text_string_to_metric_families

from sluice.sim.driver import EngineDriver, RequestHandle
from sluice.sim.engine import FINISH_ABORT, FINISH_STOP, Engine, EngineRequest
from sluice.sim.metrics import SimMetrics
from sluice.sim.profiles import PROFILES, Profile

# blocks of 4 tokens, 10 blocks, 16 tokens per step, step = 10 ms + 1 ms per token
SMALL = Profile(
    name="small",
    description="hand-checkable",
    num_gpu_blocks=10,
    block_size=4,
    max_num_seqs=8,
    max_num_batched_tokens=16,
    max_model_len=40,
    step_overhead_s=0.010,
    per_token_s=0.001,
    per_kv_token_s=0.0,
    per_attn_pair_s=0.0,
)


def test_a_pooling_request_holds_its_prompts_blocks_and_finishes_in_that_step() -> None:
    engine = Engine(SMALL)
    engine.submit(engine.make_pooling_request("e1", 10), now=0.0)  # 3 blocks
    engine.submit(EngineRequest("g1", 6, 5, 5), now=0.0)  # 2 blocks, then decodes
    step = engine.step(0.0)
    assert step.num_scheduled_tokens == 16
    assert step.duration == pytest.approx(0.010 + 0.016)
    # the embedding is done at the end of its prefill step: no token, finish "stop"
    assert [e.request_id for e in step.tokens] == ["g1"]
    (done,) = step.finished
    assert (done.request_id, done.finish_reason, done.pooling) == ("e1", FINISH_STOP, True)
    assert (done.generation_tokens, done.prompt_tokens) == (0, 10)
    assert done.first_token == done.last_token == done.finished == pytest.approx(0.026)
    assert done.ttft == pytest.approx(0.026)
    assert done.decode_time == 0.0
    assert step.num_prompt_tokens == 16 and step.num_generation_tokens == 1
    # its 3 blocks are free again; the generation keeps its 2
    assert engine.free_blocks == 8
    assert not engine.is_active("e1")
    snap = engine.snapshot()
    assert snap.finished_total[FINISH_STOP] == 1
    assert (snap.prompt_tokens_total, snap.generation_tokens_total) == (16, 1)


def test_a_long_pooling_prompt_is_prefilled_in_chunks_and_may_fill_the_context() -> None:
    engine = Engine(SMALL)
    engine.check_fits(40, 1, pooling=True)  # no room kept for an output token
    with pytest.raises(ValueError):
        engine.check_fits(40, 1)
    engine.submit(engine.make_pooling_request("e1", 40), now=0.0)  # all 10 blocks
    steps = []
    held = []
    while engine.has_work():
        steps.append(engine.step(steps[-1].end if steps else 0.0))
        held.append(engine.blocks_of("e1"))
    assert [s.num_scheduled_tokens for s in steps] == [16, 16, 8]
    assert [len(s.finished) for s in steps] == [0, 0, 1]
    assert held == [4, 8, 0]  # blocks for what is computed, all freed when done
    assert engine.free_blocks == SMALL.num_gpu_blocks
    assert all(not s.tokens for s in steps)


def test_a_pooling_request_aborted_while_waiting_frees_nothing_and_counts_an_abort() -> None:
    engine = Engine(SMALL)
    engine.submit(engine.make_pooling_request("big", 40), now=0.0)
    engine.submit(engine.make_pooling_request("e2", 4), now=0.0)
    engine.step(0.0)  # big takes the whole budget; e2 waits
    engine.abort("e2", now=0.02)
    step = engine.step(0.03)
    assert [(s.request_id, s.finish_reason) for s in step.finished] == [("e2", FINISH_ABORT)]
    assert engine.snapshot().finished_total[FINISH_ABORT] == 1


def _samples(metrics: SimMetrics) -> dict[str, float]:
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(metrics.exposition().decode()):
        for s in family.samples:
            key = s.name + (
                f"{{{s.labels['finished_reason']}}}" if "finished_reason" in s.labels else ""
            )
            out[key] = out.get(key, 0.0) + s.value
    return out


def test_metrics_count_a_pooling_request_as_vllm_does() -> None:
    engine = Engine(SMALL)
    metrics = SimMetrics(engine, "m")
    engine.submit(engine.make_pooling_request("e1", 10), now=0.0)
    metrics.observe_step(engine.step(0.0))
    m = _samples(metrics)
    assert m["vllm:request_success_total{stop}"] == 1
    assert m["vllm:prompt_tokens_total"] == 10
    assert m["vllm:generation_tokens_total"] == 0
    # its output counts as a first token; it generated 0 tokens and has no max_tokens
    assert m["vllm:time_to_first_token_seconds_count"] == 1
    assert m["vllm:time_to_first_token_seconds_sum"] == pytest.approx(0.020)
    assert m["vllm:inter_token_latency_seconds_count"] == 0
    assert m["vllm:request_generation_tokens_count"] == 1
    assert m["vllm:request_generation_tokens_sum"] == 0
    assert m["vllm:request_prompt_tokens_sum"] == 10
    assert m["vllm:request_params_max_tokens_count"] == 0
    assert m["vllm:request_time_per_output_token_seconds_count"] == 1
    assert m["vllm:request_time_per_output_token_seconds_sum"] == 0
    assert m["vllm:e2e_request_latency_seconds_count"] == 1


async def test_the_driver_wakes_a_pooling_handle_when_its_prompt_is_done() -> None:
    engine = Engine(PROFILES["tiny"].scaled(10))
    driver = EngineDriver(engine)
    driver.start()
    try:
        handle = RequestHandle(None)
        driver.submit(engine.make_pooling_request("e1", 100), handle)
        await asyncio.wait_for(handle.wait(), 5)
        assert handle.done and handle.finish_reason == FINISH_STOP
        assert handle.generated == 0
        assert engine.free_blocks == engine.num_gpu_blocks
    finally:
        await driver.stop()
