"""Token cost: prompt estimate corrected by reported usage, learned output length."""

from __future__ import annotations

import pytest

from sluice.core.token_cost import TokenCostModel


def test_first_guess_is_a_fraction_of_max_tokens() -> None:
    m = TokenCostModel()
    assert m.expected_output("t", "m", 200) == 100.0
    assert m.footprint("t", "m", 500, 200) == 600


def test_prompt_estimate_is_corrected_by_reported_usage() -> None:
    m = TokenCostModel(alpha=0.5)
    m.observe("t", "m", 100, 120, None)  # the backend counted 20% more
    assert m.prompt_ratio("m") == 1.2
    m.observe("t", "m", 100, 140, None)
    assert m.prompt_ratio("m") == pytest.approx(1.3)
    assert m.prompt_tokens("m", 1000) == pytest.approx(1300.0)
    assert m.prompt_ratio("other") == 1.0  # per model


def test_output_length_is_learned_per_tenant_and_model_and_capped() -> None:
    m = TokenCostModel(alpha=0.5)
    m.observe("t", "m", 100, None, 40)
    m.observe("t", "m", 100, None, 80)
    assert m.expected_output("t", "m", 1000) == 60.0
    assert m.expected_output("t", "m", 30) == 30.0  # never more than max_tokens
    assert m.expected_output("u", "m", 1000) == 500.0  # another tenant: first guess
    assert m.footprint("t", "m", 100, 1000) == 160


def test_absurd_ratios_are_clamped() -> None:
    m = TokenCostModel(alpha=1.0)
    m.observe("t", "m", 10, 10_000, None)
    assert m.prompt_ratio("m") == 4.0
    m.observe("t", "m", 10_000, 1, None)
    assert m.prompt_ratio("m") == 0.25
