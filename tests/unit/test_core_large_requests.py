"""Large requests (issue 14, item 6), with a fake clock: a prompt larger than the KV cache
of every backend serving its model is refused at arrival (400 context_length_exceeded,
never retried); one that fits only an empty backend holds the requests behind it back for
at most `dispatcher.holdForLarge` (2 s), then waits without holding anyone back."""

from __future__ import annotations

from sluice.config import Policy
from sluice.core.clock import FakeClock
from sluice.core.controller import Controller
from sluice.core.limiters import LimiterBase, LimiterContext
from sluice.core.request_record import RequestState
from sluice.core.settings import LimiterSettings
from sluice.core.types import BackendMetrics, Outcome, RejectCode, RequestInfo

BUDGET = 1000.0  # KV tokens the backend's limiter allows in flight
CAPACITY = 100 * 16  # its whole KV cache, from the scrape


class Budgeted(LimiterBase):
    @property
    def limit(self) -> int:
        return 8

    @property
    def kv_budget_tokens(self) -> float | None:
        return BUDGET


def controller(
    scraped: bool = True, metrics: BackendMetrics | None = None
) -> tuple[Controller, FakeClock]:
    policy = Policy.model_validate(
        {
            "queues": [
                {"priority": 0, "name": "p0", "maxQueueSize": 100, "timeout": "8s",
                 "dropPolicy": "tail"},
                {"priority": 1, "name": "p1", "maxQueueSize": 100, "timeout": "15s",
                 "dropPolicy": "tail"},
                {"priority": 2, "name": "p2", "maxQueueSize": 100, "timeout": "60s",
                 "dropPolicy": "tail"},
            ],
            "dispatcher": {"reserved": {"p0": 0.0}},
        }
    )  # fmt: skip

    def factory(context: LimiterContext, lp: LimiterSettings, initial: int | None) -> Budgeted:
        return Budgeted()

    clock = FakeClock()
    c = Controller(policy.core_settings(), clock, ["b0"], limiter_factory=factory)
    if scraped:
        c.on_metrics("b0", metrics or BackendMetrics(at=0.0, num_gpu_blocks=100, block_size=16))
    return c, clock


def req(rid: str, prio: int, tenant: str, prompt: int, max_tokens: int = 100) -> RequestInfo:
    return RequestInfo(rid, tenant, prio, "m", prompt, max_tokens)


def test_a_prompt_larger_than_every_kv_cache_is_refused_at_arrival() -> None:
    c, _ = controller()
    adm = c.arrive(req("huge", 1, "a", prompt=CAPACITY + 1))
    assert (adm.admitted, adm.code, adm.retry_after_s) == (False, RejectCode.TOO_LARGE, 0.0)
    assert c.snapshot().classes["P1"].rejected == {"context_length_exceeded": 1}
    # one that fits the cache (if not the budget) is queued as usual
    assert c.arrive(req("fits", 1, "a", prompt=CAPACITY - 100)).admitted


def test_a_cache_stated_in_tokens_refuses_as_one_stated_in_blocks() -> None:
    # SGLang's max_total_num_tokens, TGI's max_batch_total_tokens, llama.cpp's slots' n_ctx
    c, _ = controller(metrics=BackendMetrics(at=0.0, kv_capacity_tokens=CAPACITY))
    assert c.arrive(req("huge", 1, "a", prompt=CAPACITY + 1)).code is RejectCode.TOO_LARGE
    assert c.arrive(req("fits", 1, "a", prompt=CAPACITY - 100)).admitted


def test_an_estimated_kv_cache_refuses_nothing() -> None:
    # SGLang 0.4's used / usage, off by up to 5 % (its usage is rounded to 2 decimals)
    estimate = BackendMetrics(at=0.0, kv_capacity_tokens=CAPACITY, kv_capacity_estimated=True)
    c, _ = controller(metrics=estimate)
    assert c.arrive(req("huge", 1, "a", prompt=CAPACITY + 1)).admitted


def test_an_unknown_kv_cache_refuses_nothing() -> None:
    c, _ = controller(scraped=False)
    assert c.arrive(req("huge", 1, "a", prompt=10 * CAPACITY)).admitted


def test_a_request_that_needs_an_empty_backend_holds_the_others_back_two_seconds() -> None:
    c, clock = controller()
    assert c.arrive(req("busy", 2, "etl", prompt=100)).admitted  # a long answer in flight
    assert [a.request_id for a in c.step().assignments] == ["busy"]
    # P1 tenant a: 1,200 + 50 expected output > the 1,000 budget: only an empty backend
    assert c.arrive(req("big", 1, "a", prompt=1200)).admitted
    assert c.step().assignments == []  # it waits, holding the backend for itself
    clock.set(0.1)
    c.arrive(req("small", 1, "b", prompt=50))  # another P1 tenant
    c.arrive(req("low", 2, "etl", prompt=50))
    step = c.step()
    assert step.assignments == [] and step.wake_at == 2.0  # when the hold ends
    clock.set(1.99)
    assert c.step().assignments == []
    clock.set(2.0)
    assert [a.request_id for a in c.step().assignments] == ["small", "low"]
    assert c.state_of("big") is RequestState.QUEUED
    # it goes as soon as the backend is empty, ahead of what came after it
    clock.set(3.0)
    c.arrive(req("later", 1, "b", prompt=50))
    for rid in ("busy", "small", "low"):
        c.on_finish(rid, Outcome.OK, 100, 10)
    assert [a.request_id for a in c.step().assignments] == ["big"]
    assert [a.request_id for a in c.step().assignments] == []  # "later" does not fit beside it
    c.on_finish("big", Outcome.OK, 1200, 10)
    assert [a.request_id for a in c.step().assignments] == ["later"]


def test_a_parked_large_request_still_times_out_with_its_class() -> None:
    c, clock = controller()
    c.arrive(req("busy", 2, "etl", prompt=100))
    c.step()
    c.arrive(req("big", 1, "a", prompt=1200))
    clock.set(2.0)
    c.step()
    clock.set(15.0)
    step = c.step()
    assert [(r.request_id, r.code) for r in step.rejections] == [("big", RejectCode.QUEUE_TIMEOUT)]
