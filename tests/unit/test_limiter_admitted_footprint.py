"""The KV cap of the `sluice` limiter follows the mix being admitted, not only the mix
already dispatched: when prompts grow, the limit falls before the short requests queued
ahead of the long ones have been sent (issue 4, prompt-shift)."""

from __future__ import annotations

import pytest

from sluice.config import Policy
from sluice.core.clock import FakeClock
from sluice.core.controller import Controller
from sluice.core.token_cost import TokenCostModel
from sluice.core.types import BackendMetrics, Outcome, RequestInfo

# 100 blocks of 16 = 1,600 tokens; the sluice limiter's budget is 80 % of it = 1,280
KV = {"num_gpu_blocks": 100, "block_size": 16}


def test_admitted_footprints_are_averaged_per_model() -> None:
    m = TokenCostModel(admitted_alpha=0.5)
    assert m.admitted_footprint(frozenset({"a"})) is None
    assert m.admitted_footprint(frozenset()) is None
    m.note_admitted("a", 100)
    m.note_admitted("a", 300)
    m.note_admitted("b", 1000)
    assert m.admitted_footprint(frozenset({"a"})) == 200.0
    assert m.admitted_footprint(frozenset({"b"})) == 1000.0
    # a backend serving both may get either: the larger
    assert m.admitted_footprint(frozenset({"a", "b"})) == 1000.0
    # a backend serving any model follows every admission: 100, 300, then 1000
    assert m.admitted_footprint(frozenset()) == 600.0
    assert m.admitted_footprint(frozenset({"c"})) is None


def test_the_admitted_ewma_weighs_like_the_other_estimates_by_default() -> None:
    m = TokenCostModel(alpha=0.25)
    m.note_admitted("a", 100)
    m.note_admitted("a", 500)
    assert m.admitted_footprint(frozenset({"a"})) == 200.0


def _controller() -> tuple[Controller, FakeClock]:
    policy = Policy.model_validate(
        {
            "limiter": {"algorithm": "sluice", "initialLimit": 20, "maxLimit": 100},
            "dispatcher": {"reserved": {"p0": 0.0}},
        }
    )
    clock = FakeClock()
    c = Controller(
        policy.core_settings(),
        clock,
        ["b0"],
        limiter_kwargs={"sluice": {"footprint_alpha": 1.0}},
        cost_model=TokenCostModel(admitted_alpha=1.0),
    )
    c.on_metrics("b0", BackendMetrics(at=0.0, **KV))  # type: ignore[arg-type]
    return c, clock


def _req(rid: str, prompt: int) -> RequestInfo:
    # max_tokens 40: the first output guess is half of it, so the footprint is prompt + 20
    return RequestInfo(rid, "t", 1, "m", prompt, 40)


def test_long_prompts_admitted_lower_the_limit_before_they_are_dispatched() -> None:
    c, clock = _controller()
    for i in range(12):
        c.arrive(_req(f"s{i}", 80))  # footprint 100
    assert len(c.step().assignments) == 12  # floor(1280 / 100) = 12 fit the KV budget
    assert c.snapshot().backends["b0"].limit == 12
    for i in range(3):
        c.arrive(_req(f"long{i}", 380))  # footprint 400, queued behind the short ones
    clock.set(1.0)
    c.on_finish("s0", Outcome.OK, 80, 20)
    # the short requests still in flight are not what comes next: 1280 / 400
    assert c.snapshot().backends["b0"].limit == 3
    assert c.step().assignments == []  # 11 in flight > 3


@pytest.mark.parametrize("models", [None, ["m"]])
def test_a_backend_follows_the_admissions_for_the_models_it_serves(
    models: list[str] | None,
) -> None:
    c, clock = _controller()
    c.set_backends(["b0", "b1"])
    c.set_backend_models("b1", ["other-model"])
    if models is not None:
        c.set_backend_models("b0", models)
    c.arrive(_req("s0", 80))
    assert [a.backend for a in c.step().assignments] == ["b0"]
    assert c.arrive(RequestInfo("other", "t", 1, "other-model", 1180, 40)).admitted
    clock.set(1.0)
    c.on_finish("s0", Outcome.OK, 80, 20)
    # b0 serving any model may get the 1,200-token request: floor(1280 / 1200); serving
    # only "m", it will not, and its cap stays at floor(1280 / 100)
    want = 1 if models is None else 12
    assert c.snapshot().backends["b0"].limit == want
