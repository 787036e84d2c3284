"""Prefill-only requests keep a pooling engine's pipeline full (core/prefill_pipeline.py):
they count at half their prompt in the KV budget, the engine's queue and KV are read
without what that pipeline puts there, and their answer is their first token."""

from __future__ import annotations

import pytest

from sluice.config import Policy
from sluice.core.clock import FakeClock
from sluice.core.controller import Controller
from sluice.core.kv_budget import KvBudget
from sluice.core.prefill_pipeline import PIPELINE_STEPS, engine_view, kv_charge
from sluice.core.types import BackendMetrics, Outcome, RequestInfo

# 256 blocks of 16: a cache of 4,096 tokens, a KV budget of 0.8 of it (3,276.8)
CACHE = {"num_gpu_blocks": 256, "block_size": 16}


def test_a_prefill_only_request_counts_at_its_share_of_a_two_step_pipeline() -> None:
    assert PIPELINE_STEPS == 2
    assert kv_charge(1000, pipelined=True) == 500
    assert kv_charge(1001, pipelined=True) == 501  # rounded up
    assert kv_charge(1001, pipelined=False) == 1001


def test_the_engine_is_read_without_what_our_pipeline_puts_there() -> None:
    m = BackendMetrics(at=1.0, running=3, waiting=4, kv_usage=0.9, num_gpu_blocks=256)
    # 3 prefill-only requests of ours in flight, 2,048 prompt tokens of a 4,096-token cache
    view = engine_view(m, 3, 2048.0, 4096.0)
    assert view.waiting == 1 and view.kv_usage == pytest.approx(0.4)
    assert view.running == 3 and view.num_gpu_blocks == 256  # the rest as scraped
    # never below nothing; unknown stays unknown; none in flight: the scrape itself
    assert engine_view(m, 6, 8192.0, 4096.0).waiting == 0
    assert engine_view(m, 6, 8192.0, 4096.0).kv_usage == 0
    assert engine_view(BackendMetrics(at=1.0), 2, 100.0, None).waiting is None
    assert engine_view(m, 0, 0.0, 4096.0) is m


def _controller() -> tuple[Controller, FakeClock]:
    # the default limiter (it holds the KV budget), a gateway that knows it is alone
    doc = {"limiter": {"initialLimit": 16}}
    clock = FakeClock()
    c = Controller(Policy.model_validate(doc).core_settings(), clock, ["pool"])
    c.expect_peers(1)
    clock.set(1.0)
    c.on_metrics("pool", BackendMetrics(at=1.0, running=0, waiting=0, kv_usage=0.0, **CACHE))
    return c, clock


def _embedding(rid: str, priority: int = 0) -> RequestInfo:
    return RequestInfo(
        rid, "t", priority, "m", 1000, 1, prefill_only=True, first_token_visible=False
    )


def _generation(rid: str, priority: int) -> RequestInfo:
    return RequestInfo(rid, "t", priority, "m", 900, 200, first_token_visible=False)


@pytest.mark.parametrize(
    ("priority", "embeddings", "generations"),
    # P0 has the whole budget (3,276.8 tokens), P1 the unreserved 0.8 of it (2,621.4).
    # Embeddings of 1,000 prompt tokens count 500: 6 of them (whole: 3), the limit 6;
    # P1 then has floor(0.8 x 6) = 4 slots. A generation request of 900 + 100 expected
    # (half its max_tokens) counts whole: 3, and P1 2 (floor(0.8 x 3) slots).
    [(0, 6, 3), (1, 4, 2)],
)
def test_a_backend_takes_two_steps_of_prefill_only_requests(
    priority: int, embeddings: int, generations: int
) -> None:
    for make, want in ((_embedding, embeddings), (_generation, generations)):
        c, _ = _controller()
        for i in range(10):
            c.arrive(make(f"r{i}", priority))
        c.step()
        assert c.snapshot().backends["pool"].inflight == want


def test_requests_our_pipeline_queues_on_purpose_are_not_the_engine_queueing() -> None:
    c, clock = _controller()
    for i in range(4):
        c.arrive(_embedding(f"e{i}"))
    c.step()
    assert c.snapshot().backends["pool"].inflight == 4
    # the engine computes two (2,000 of its 4,096 tokens) and queues the other two
    for t in (11.0, 11.1, 11.2):  # (past the limiter's first cut interval)
        clock.set(t)
        c.on_metrics("pool", BackendMetrics(at=t, running=2, waiting=2, kv_usage=0.5, **CACHE))
    limiter = c.snapshot().backends["pool"].limiter
    assert limiter is not None and limiter["cut_reasons"] == {}
    # a request waiting beyond all four of ours is: two scrapes in a row, a cut
    for t in (11.3, 11.4):
        clock.set(t)
        c.on_metrics("pool", BackendMetrics(at=t, running=2, waiting=5, kv_usage=0.5, **CACHE))
    limiter = c.snapshot().backends["pool"].limiter
    assert limiter is not None and limiter["cut_reasons"] == {"waiting": 1}


def test_an_answer_is_its_first_token_and_ends_its_prefill() -> None:
    c, clock = _controller()
    c.arrive(_embedding("e0"))
    c.arrive(_embedding("e1"))
    c.step()
    b = c._dispatcher.backends["pool"]
    # the second was sent behind the first's prefill
    assert b.prefill_tokens == 2000 and b.pipelined_tokens == 2000
    assert b.records["e1"].prefill_ahead == 1000
    clock.set(1.25)
    c.on_finish("e0", Outcome.OK, prompt_tokens=1000, completion_tokens=0)
    assert b.prefill_tokens == 1000 and b.pipelined == 1
    c.on_finish("e1", Outcome.OK, prompt_tokens=1000, completion_tokens=0)
    assert b.prefill_tokens == 0 and b.pipelined_tokens == 0 and b.inflight_tokens == 0


def test_beside_a_generation_request_a_prefill_only_one_counts_whole() -> None:
    c, _ = _controller()
    c.arrive(_generation("g", 0))  # 1,000 tokens
    for i in range(4):
        c.arrive(_embedding(f"e{i}"))
    c.step()
    b = c._dispatcher.backends["pool"]
    # whole: two embeddings of 1,000 beside it fill the budget of 3,276.8 (3,000)
    assert b.inflight == 3 and b.inflight_tokens == 3000
    assert [r.kv_tokens for r in b.records.values()] == [1000, 1000, 1000]


def test_the_fleets_shared_room_reads_the_engine_as_scraped() -> None:
    """Replicas share the backend: the others' part is the engine's count and KV less ours,
    so what the view set aside as ours goes back in before ours are taken out."""
    raw = BackendMetrics(at=1.0, running=3, waiting=3, kv_usage=0.6, **CACHE)
    view = engine_view(raw, 2, 1000.0, 4096.0)
    assert (view.waiting, view.set_aside_waiting) == (1, 2)
    rooms = []
    for m in (raw, view):
        kv = KvBudget(seed=1)
        kv.on_fleet(own_kv_tokens=500.0, share=0.5, share_fresh=True)
        kv.on_metrics(m, inflight=2)
        rooms.append((kv.tokens, kv.shared))
    assert rooms[0] == rooms[1] and rooms[0][1] is not None
