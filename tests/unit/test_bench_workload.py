"""The workload generator and the scenario files: seeded, exact where the scenario asks
for exactness (`process: uniform`), clear errors for bad scenarios."""

from __future__ import annotations

import itertools
import random

import pytest

from sluice.bench.scenario import (
    ScenarioError,
    builtin_scenarios,
    load_scenario,
    parse_scenario,
)
from sluice.bench.workload import draw_length, generate, retry_delay, unit_hash

BASE = """
name: t
phases:
  - name: a
    duration: 2s
    rateRps: 10
    process: uniform
    mix: {P0: 0.2, P1: 0.4, P2: 0.4}
    prompt: 100
    output: {dist: uniform, low: 5, high: 9}
    maxTokens: 16
  - name: b
    duration: 1s
    rateRps: 4
    prompt: {dist: fixed, value: 300}
"""


def test_uniform_process_gives_exact_counts_times_and_shares() -> None:
    s = parse_scenario(BASE)
    reqs = generate(s, [10.0, 4.0], seed=1, max_model_len=2048)
    assert len(reqs) == 24  # 2 s x 10/s + 1 s x 4/s
    assert [round(r.arrival, 6) for r in reqs[:3]] == [0.0, 0.1, 0.2]
    assert [round(r.arrival, 6) for r in reqs[20:]] == [2.0, 2.25, 2.5, 2.75]
    first = reqs[:20]
    assert [sum(r.priority == p for r in first) for p in (0, 1, 2)] == [4, 8, 8]
    assert {r.prompt_tokens for r in first} == {100}
    assert {r.prompt_tokens for r in reqs[20:]} == {300}  # phase b's own prompt
    assert all(5 <= r.output_tokens <= 9 and r.max_tokens == 16 for r in reqs)  # inherited
    assert [r.request_id for r in reqs[:3]] == ["r0", "r1", "r2"]
    assert {r.tenant for r in reqs} == {"chat-app", "agents", "batch-etl"}


def test_same_seed_same_workload_other_seed_other_workload() -> None:
    s = load_scenario("burst")
    a = generate(s, [30.0, 120.0, 30.0], seed=7, max_model_len=8192)
    b = generate(s, [30.0, 120.0, 30.0], seed=7, max_model_len=8192)
    c = generate(s, [30.0, 120.0, 30.0], seed=8, max_model_len=8192)
    key = [(r.arrival, r.priority, r.prompt_tokens, r.output_tokens) for r in a]
    assert key == [(r.arrival, r.priority, r.prompt_tokens, r.output_tokens) for r in b]
    assert key != [(r.arrival, r.priority, r.prompt_tokens, r.output_tokens) for r in c]


def test_poisson_rate_and_mix_are_right_on_average() -> None:
    text = BASE.replace("process: uniform", "process: poisson").replace(
        "duration: 2s", "duration: 200s"
    )
    s = parse_scenario(text)
    reqs = [r for r in generate(s, [50.0, 0.0], seed=3, max_model_len=2048) if r.phase == 0]
    # 10,000 expected; Poisson sd = 100, so 4 sd either side
    assert 9600 <= len(reqs) <= 10400
    p0 = sum(r.priority == 0 for r in reqs) / len(reqs)
    assert 0.18 <= p0 <= 0.22
    gaps = [b.arrival - a.arrival for a, b in itertools.pairwise(reqs)]
    assert all(g >= 0 for g in gaps)


def test_prompts_are_cut_to_fit_the_context() -> None:
    s = parse_scenario(BASE.replace("prompt: 100", "prompt: 5000"))
    reqs = generate(s, [10.0, 0.0], seed=1, max_model_len=2048)
    assert {r.prompt_tokens for r in reqs} == {2048 - 16}


def test_length_distributions() -> None:
    rng = random.Random(0)
    s = parse_scenario(
        BASE.replace("prompt: 100", "prompt: {dist: lognormal, median: 500, sigma: 0.8, max: 4000}")
    )
    dist = s.phases[0].prompt
    draws = sorted(draw_length(dist, rng) for _ in range(4001))
    assert 450 <= draws[2000] <= 550  # the median
    assert draws[-1] <= 4000 and draws[0] >= 1
    assert draws[3900] > 2 * draws[2000]  # a long tail


def test_cancel_and_deadline_come_from_the_phase_clients() -> None:
    text = (
        BASE
        + """    clients:
      P0: {deadline: 5s, cancel: {probability: 1.0, afterTokens: 3}}
clients:
  P0: {deadline: 30s}
"""
    )
    s = parse_scenario(text)
    reqs = generate(s, [10.0, 4.0], seed=1, max_model_len=2048)
    a0 = [r for r in reqs if r.phase == 0 and r.priority == 0]
    b0 = [r for r in reqs if r.phase == 1 and r.priority == 0]
    assert a0 and all(r.deadline == 30.0 and r.cancel_after is None for r in a0)
    assert b0 and all(r.deadline == 5.0 and r.cancel_after == 3 for r in b0)
    assert all(r.deadline is None for r in reqs if r.priority == 1)


def test_retry_delay_follows_retry_after_with_and_without_jitter() -> None:
    text = BASE + "clients:\n  P0: {retry: {maxAttempts: 3, spread: 0}}\n"
    s = parse_scenario(text)
    exact = next(r for r in generate(s, [10.0, 0.0], seed=1, max_model_len=2048) if r.priority == 0)
    assert retry_delay(exact, 0, 2.5, seed=1) == 2.5
    s = parse_scenario(BASE + "clients:\n  P0: {retry: {maxAttempts: 3, spread: 0.5}}\n")
    jittered = next(
        r for r in generate(s, [10.0, 0.0], seed=1, max_model_len=2048) if r.priority == 0
    )
    d = retry_delay(jittered, 0, 2.0, seed=1)
    assert 2.0 <= d <= 3.0
    assert d == 2.0 * (1 + 0.5 * unit_hash(1, jittered.index, 1))
    # no advice: exponential back-off
    assert 1.0 <= retry_delay(jittered, 0, None, seed=1) <= 1.5
    assert 4.0 <= retry_delay(jittered, 2, None, seed=1) <= 6.0


def test_unit_hash_is_uniform_enough_and_stable() -> None:
    xs = [unit_hash(1, i) for i in range(10000)]
    assert all(0.0 <= x < 1.0 for x in xs)
    assert 0.48 <= sum(xs) / len(xs) <= 0.52
    assert unit_hash(1, 5, 2) == unit_hash(1, 5, 2) != unit_hash(1, 5, 3)


@pytest.mark.parametrize("name", builtin_scenarios())
def test_builtin_scenarios_load(name: str) -> None:
    s = load_scenario(name)
    assert s.name == name
    assert s.duration > 0
    assert s.slos["P0"].ttft == 1.0 and s.slos["P0"].tpot == 0.1
    if "P2" not in s.spec.slos:  # the default; output-shift's long answers get longer
        assert s.slos["P2"].e2e == 60.0
    real = s.for_real_mode()
    assert real.spec.backends.profile == "tiny"
    assert all(p.prompt.min >= 1 for p in real.phases)


def test_the_required_scenarios_exist() -> None:
    assert {
        "steady",
        "burst",
        "prompt-shift",
        "cancel-storm",
        "retry-storm",
        "backend-failure",
        "scale",
    } <= set(builtin_scenarios())
    burst = load_scenario("burst")
    assert [p.rate for p in burst.phases] == [0.7, 3.0, 0.7]
    assert burst.phases[1].end - burst.phases[1].start == 20.0
    assert burst.phases[0].mix == {"P0": 0.2, "P1": 0.4, "P2": 0.4}
    scale = load_scenario("scale")
    assert scale.spec.backends.count == 32 and scale.phases[0].rate_rps == 10000


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (("rateRps: 10\n", "rateRps: 10\n    rate: 1\n"), "phases.0: give exactly one of"),
        (("name: t\n", "name: t\nbogus: 1\n"), "bogus: Extra inputs are not permitted"),
        (("prompt: 100", "prompt: {dist: uniform, low: 9, high: 3}"), "low` <= `high"),
        (("    maxTokens: 16\n", ""), "the first phase must set maxTokens"),
    ],
)
def test_bad_scenarios_name_the_field(change: tuple[str, str], message: str) -> None:
    with pytest.raises(ScenarioError) as info:
        parse_scenario(BASE.replace(*change, 1))
    assert any(message in line for line in info.value.errors), info.value.errors


def test_unknown_scenario_lists_the_known_ones() -> None:
    with pytest.raises(ScenarioError) as info:
        load_scenario("no-such-scenario")
    assert "burst" in info.value.errors[0]


def test_backend_overrides_and_bad_profile() -> None:
    s = parse_scenario(
        BASE + "backends: {count: 1, profile: tiny, overrides: {numGpuBlocks: 300}}\n"
    )
    assert s.spec.backends.build_profile().num_gpu_blocks == 300
    with pytest.raises(ScenarioError):
        parse_scenario(BASE + "backends: {profile: nope}\n")
    with pytest.raises(ScenarioError):
        parse_scenario(BASE + "backends: {profile: tiny, overrides: {warpDrive: 1}}\n")


ROUTES = """
routes:
  chat: {share: 3}
  embeddings: {share: 1, pooling: true, prompt: 700}
"""


def test_routes_share_the_requests_and_pooling_ones_generate_nothing() -> None:
    s = parse_scenario(BASE.replace("name: t\n", "name: t\n" + ROUTES))
    reqs = generate(s, [100.0, 4.0], seed=1, max_model_len=2048)
    embeddings = [r for r in reqs if r.route == "embeddings"]
    chat = [r for r in reqs if r.route == "chat"]
    assert embeddings and all(r.pooling for r in embeddings) and not any(r.pooling for r in chat)
    assert 0.15 < len(embeddings) / len(reqs) < 0.35  # a share of 1 in 4
    # their own prompt, and no output room: done when the prompt is computed
    assert {(r.prompt_tokens, r.max_tokens, r.output_tokens) for r in embeddings} == {(700, 1, 1)}
    assert all(r.max_tokens == 16 for r in chat)


def test_one_route_leaves_the_workload_as_it_was() -> None:
    """A scenario without `routes` draws nothing more: its figures stay the same."""
    plain = parse_scenario(BASE)
    chat_only = parse_scenario(BASE.replace("name: t\n", "name: t\nroutes: {chat: {share: 1}}\n"))
    a = generate(plain, [10.0, 4.0], seed=3, max_model_len=2048)
    b = generate(chat_only, [10.0, 4.0], seed=3, max_model_len=2048)
    assert a == b and {r.route for r in a} == {"chat"}
