"""Stalls of the host (core/stall_log.py): the time the host did not run the gateway is
taken out of the latency samples and the first-token alarms, exactly."""

from __future__ import annotations

import pytest

from sluice.config import Policy
from sluice.core.clock import FakeClock
from sluice.core.controller import Controller
from sluice.core.limiters import LimiterBase, LimiterContext, SluiceLimiter
from sluice.core.settings import LimiterSettings
from sluice.core.stall_log import StallLog
from sluice.core.types import Outcome, RequestInfo, Sample


def test_the_log_sums_the_stalled_part_of_a_span_and_merges_reports_of_one_stall() -> None:
    log = StallLog(keep_s=10.0)
    log.add(1.0, 2.0)
    log.add(3.0, 3.5)
    log.add(3.2, 4.0)  # the same stall, seen again longer: one stall 3.0-4.0
    assert log.stalled(0.0, 10.0) == pytest.approx(2.0)
    assert log.stalled(1.5, 3.5) == pytest.approx(0.5 + 0.5)
    assert log.stalled(2.0, 3.0) == 0.0
    assert log.total_s == pytest.approx(2.0)
    log.add(5.0, 5.0)  # nothing
    log.add(20.0, 21.0)  # the first two are now older than keep_s: forgotten
    assert log.stalled(0.0, 30.0) == pytest.approx(1.0)
    assert log.total_s == pytest.approx(3.0)  # the metric counts every stall once


class Recorder(LimiterBase):
    """A limiter that records its samples and asks for an alarm 0.5 s after dispatch."""

    def __init__(self) -> None:
        self.samples: list[tuple[Sample, float]] = []

    @property
    def limit(self) -> int:
        return 4

    def on_sample(self, sample: Sample, now: float) -> None:
        self.samples.append((sample, now))

    def ttft_alarm_after(self, prefill_tokens: float) -> float | None:
        return 0.5


def controller() -> tuple[Controller, FakeClock, StallLog, Recorder]:
    limiter = Recorder()

    def factory(context: LimiterContext, lp: LimiterSettings, initial: int | None) -> Recorder:
        return limiter

    policy = Policy.model_validate({"dispatcher": {"reserved": {"p0": 0.0}}})
    clock, log = FakeClock(), StallLog()
    c = Controller(policy.core_settings(), clock, ["b0"], limiter_factory=factory, stalls=log)
    return c, clock, log, limiter


def test_a_stall_is_not_the_engines_time_to_first_token_nor_its_pace() -> None:
    c, clock, log, limiter = controller()
    clock.set(1.0)
    c.arrive(RequestInfo("a", "t", 0, "m", 200, 11))
    assert [a.request_id for a in c.step().assignments] == ["a"]
    log.add(1.1, 1.4)  # the host stopped for 0.3 s before the first token was seen
    clock.set(1.45)
    c.on_first_token("a")
    log.add(2.0, 3.0)  # and for 1 s while it streamed
    clock.set(3.45)
    c.on_finish("a", Outcome.OK, prompt_tokens=200, completion_tokens=11)
    (first, _), (end, _) = limiter.samples
    assert first.ttft_s == pytest.approx(0.15)  # 0.45 s seen, 0.3 s of it stalled
    assert first.stalled_s == pytest.approx(0.3)  # said, for the floors (below)
    assert end.ttft_s == pytest.approx(0.15)
    assert end.stalled_s == pytest.approx(1.3)
    assert end.e2e_s == pytest.approx(2.45 - 1.3)
    assert end.tpot_s == pytest.approx((1.15 - 0.15) / 10)


def test_a_first_token_alarm_gives_the_engine_its_whole_time_after_a_stall() -> None:
    c, clock, log, limiter = controller()
    c.arrive(RequestInfo("a", "t", 0, "m", 200, 11))
    assert c.step().wake_at == pytest.approx(0.5)
    log.add(0.2, 0.6)  # the host stopped 0.4 s of the 0.5 s the alarm allowed
    clock.set(0.6)
    wake_at = c.step().wake_at
    assert wake_at == pytest.approx(0.9)  # 0.2 s of engine time so far
    assert limiter.samples == []
    clock.set(wake_at)
    c.step()
    ((pending, at),) = limiter.samples
    assert pending.pending and at == pytest.approx(0.9)
    assert pending.ttft_s == pytest.approx(0.5)  # its whole allowance, all the engine's


def test_without_stalls_the_samples_are_the_clocks() -> None:
    c, clock, _, limiter = controller()
    c.arrive(RequestInfo("a", "t", 0, "m", 200, 11))
    c.step()
    clock.set(0.3)
    c.on_first_token("a")
    assert limiter.samples[0][0].ttft_s == pytest.approx(0.3)
    assert limiter.samples[0][0].stalled_s == 0.0


def test_a_corrected_sample_counts_but_sets_no_floor() -> None:
    """A stall correction can take more than the host's pause (the engine ran on while the
    gateway waited for a CPU): first tokens of ~0 s, whose minimum became the TTFT base,
    every later first token 100-1,000x "expected" and overdue. Corrected samples still
    count as evidence (the TTFT ratio), but the floors learn from uncorrected ones."""
    lim = SluiceLimiter(1, 64, 8, seed=1)
    first = {"prompt_tokens": 436, "inflight": 1, "sent_at": 0.0}  # 436 + 64 fixed = 500
    lim.on_sample(Sample(ttft_s=0.05, **first), 1.0)  # 100 us a token
    assert lim.ttft_base == pytest.approx(1e-4)
    lim.on_sample(Sample(ttft_s=0.0005, stalled_s=0.2, **first), 1.1)
    assert lim.ttft_base == pytest.approx(1e-4)  # not 1 us
    assert lim.ttft_ratio == pytest.approx(0.01)  # counted: judged against the base
    end = {"completion_tokens": 11, "e2e_s": 1.0, "ttft_s": 0.05}
    lim.on_sample(Sample(tpot_s=0.02, **first | end), 2.0)
    lim.on_sample(Sample(tpot_s=0.001, stalled_s=0.3, **first | end), 2.1)
    assert lim.describe()["tpot_base_s"] == pytest.approx(0.02)
