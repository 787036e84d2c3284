"""The host's other work in virtual time (bench/noise.py): `computeNoise` on every step, or
only in the host's busy spells (`episodes`)."""

from __future__ import annotations

import random

import pytest

from sluice.bench.noise import ComputeNoise, EpisodeClock, Episodes
from sluice.bench.runner import run_virtual
from sluice.bench.scenario import ScenarioError, load_scenario


def test_spells_alternate_and_take_their_share_of_the_time() -> None:
    clock = Episodes(busy_s=1.0, quiet_s=3.0).clock(seed=1, backend=0)
    step = 0.01
    busy = sum(clock.busy_at(i * step) for i in range(1_000_000))  # 10,000 s
    assert busy * step / 10_000 == pytest.approx(0.25, abs=0.02)
    assert not Episodes(1.0, 3.0).clock(seed=1, backend=0).busy_at(0.0)  # starts quiet


def test_each_backend_has_its_own_spells_and_a_seed_repeats_them() -> None:
    def spells(seed: int, backend: int) -> list[bool]:
        clock = Episodes(1.0, 3.0).clock(seed, backend)
        return [clock.busy_at(t * 0.1) for t in range(2_000)]

    assert spells(1, 0) == spells(1, 0)
    assert spells(1, 0) != spells(1, 1)


def test_a_clock_read_late_catches_up_over_every_spell_it_missed() -> None:
    rng = random.Random(7)
    clock = EpisodeClock(Episodes(0.001, 0.001), rng)
    assert clock.busy_at(1_000.0) in (True, False)  # about a million switches, no error


@pytest.mark.parametrize(("busy", "quiet"), [(0.0, 1.0), (1.0, -1.0)])
def test_spells_need_positive_lengths(busy: float, quiet: float) -> None:
    with pytest.raises(ValueError, match="busy > 0 and quiet > 0"):
        Episodes(busy, quiet)


def test_a_scenario_states_the_spells_and_refuses_bad_ones() -> None:
    spec = load_scenario("cpu-host-p0").spec.backends.compute_noise
    assert spec is not None and spec.episodes is not None
    assert (spec.p50, spec.p99, spec.episodes.busy, spec.episodes.quiet) == (4, 15, 1.0, 3.0)
    noise = {"p50": 4, "p99": 15, "episodes": {"busy": "1s", "quiet": 0}}
    bad = {"count": 1, "profile": "vllm-cpu-tiny", "computeNoise": noise}
    with pytest.raises(ScenarioError, match=r"computeNoise\.episodes\.quiet"):
        load_scenario("cpu-host-p0", {"backends": bad})


def test_quiet_spells_leave_the_engine_at_its_fitted_speed() -> None:
    """The same P0-only load on the same host: busy in spells it is faster than busy all
    the time, and slower than a quiet host (direct arm: the engine's own first tokens)."""

    def p0_ttft_p95(noise: dict[str, object] | None) -> float:
        backends = {"count": 1, "profile": "vllm-cpu-tiny", "computeNoise": noise}
        scenario = load_scenario("cpu-host-p0", {"backends": backends})
        result = run_virtual(scenario, ["direct"])["arms"]["direct"]
        return float(result["classes"]["P0"]["ttft_p95_s"])

    quiet = p0_ttft_p95(None)
    spells = p0_ttft_p95({"p50": 4, "p99": 15, "episodes": {"busy": "1s", "quiet": "3s"}})
    always = p0_ttft_p95({"p50": 4, "p99": 15})
    # seed 1: 0.10 s on a quiet host, 0.60 s busy a quarter of the time, 18 s busy always
    assert quiet < 0.2 < spells < 1.0 < always


def test_noise_without_spells_draws_on_every_step() -> None:
    noise = ComputeNoise(3.0, 12.0)
    rng = noise.sampler(seed=1, backend=0)
    draws = [noise.draw(rng) for _ in range(20_000)]
    assert sorted(draws)[10_000] == pytest.approx(3.0, rel=0.05)
    assert sorted(draws)[19_800] == pytest.approx(12.0, rel=0.1)
