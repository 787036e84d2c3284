"""The sluice limiter's reactions, with exact values."""

from __future__ import annotations

import math

import pytest

from sluice.core.limiters import SluiceLimiter
from sluice.core.types import BackendMetrics, Sample

# prompt 436 + the fixed part 64 = 500 tokens of prefill work
PROMPT = 436


def limiter(initial: int = 20, **kw: object) -> SluiceLimiter:
    args: dict[str, object] = {"probe_jitter": 0.0, "probe_interval_s": 10.0}
    args.update(kw)
    return SluiceLimiter(1, 200, initial, **args)  # type: ignore[arg-type]


def ttft(
    lim: SluiceLimiter,
    seconds: float,
    now: float,
    sent_at: float | None = None,
    ahead: float = 0.0,
) -> None:
    sample = Sample(ttft_s=seconds, prompt_tokens=PROMPT, sent_at=sent_at, prefill_ahead=ahead)
    lim.on_sample(sample, now)


# -- hard signals from a scrape ----------------------------------------------------------


def test_a_request_waiting_for_the_next_step_is_not_queueing() -> None:
    lim = limiter()
    lim.on_dispatch(20, 100, 0.0)
    lim.on_metrics(BackendMetrics(at=0.0, waiting=2, running=18, kv_usage=0.5), 0.0)
    lim.on_metrics(BackendMetrics(at=0.25, waiting=0, running=20, kv_usage=0.5), 0.25)
    lim.on_metrics(BackendMetrics(at=0.5, waiting=1, running=19, kv_usage=0.5), 0.5)
    assert lim.limit == 20 and lim.cuts == 0


def test_waiting_on_two_scrapes_cuts_at_once_and_only_once_per_drain() -> None:
    lim = limiter()
    lim.on_dispatch(20, 100, 0.0)
    lim.on_metrics(BackendMetrics(at=-0.25, waiting=2, running=18, kv_usage=0.5), -0.25)
    assert lim.limit == 20
    lim.on_metrics(BackendMetrics(at=0.0, waiting=2, running=18, kv_usage=0.5), 0.0)
    assert lim.limit == 16  # 20 * 0.8
    assert lim.last_cut_reason == "waiting"
    # the next scrape still shows the backlog, but 20 in flight > 16: the cut has not
    # taken effect yet, so no second cut
    lim.on_metrics(BackendMetrics(at=0.3, waiting=2, running=18), 0.3)
    assert lim.limit == 16
    # once in-flight is down to the limit and the backend still queues: cut again
    lim.on_release(16, 0.5)
    lim.on_metrics(BackendMetrics(at=0.55, waiting=1, running=16), 0.55)
    assert lim.limit == 12  # floor(12.8)


def test_cuts_at_most_once_per_interval() -> None:
    lim = limiter()
    lim.on_dispatch(10, 100, 0.0)
    lim.on_metrics(BackendMetrics(at=-0.25, waiting=1), -0.25)
    lim.on_metrics(BackendMetrics(at=0.0, waiting=1), 0.0)
    assert lim.limit == 16
    lim.on_metrics(BackendMetrics(at=0.1, kv_usage=0.95), 0.1)  # 0.1 s < 0.25 s
    assert lim.limit == 16
    lim.on_metrics(BackendMetrics(at=0.25, kv_usage=0.95), 0.25)
    assert lim.limit == 12
    assert lim.last_cut_reason == "kv"


def test_rising_preemption_counter_cuts() -> None:
    lim = limiter()
    lim.on_dispatch(20, 100, 0.0)
    lim.on_metrics(BackendMetrics(at=0.0, preemptions_total=5), 0.0)  # first: a baseline
    assert lim.limit == 20
    lim.on_metrics(BackendMetrics(at=0.25, preemptions_total=5), 0.25)
    assert lim.limit == 20
    lim.on_metrics(BackendMetrics(at=0.5, preemptions_total=7), 0.5)
    assert lim.limit == 16
    assert lim.last_cut_reason == "preemption"


def test_more_in_flight_than_running_cuts_when_waiting_is_not_exported() -> None:
    lim = limiter()
    lim.on_dispatch(20, 100, 0.0)
    lim.on_metrics(BackendMetrics(at=0.0, running=18), 0.0)  # 2 in transit: fine
    assert lim.limit == 20
    lim.on_metrics(BackendMetrics(at=0.25, running=17), 0.25)  # 3 > max(2, 2.0)
    assert lim.limit == 16


# -- TTFT ----------------------------------------------------------------------------------


def test_a_ttft_jump_cuts() -> None:
    lim = limiter()
    lim.on_dispatch(5, 100, 0.0)
    ttft(lim, 0.05, 0.1)  # the first: base 0.05 / 500 = 1e-4 s per token
    assert lim.ttft_base == pytest.approx(1e-4)
    assert lim.expected_ttft(PROMPT) == pytest.approx(0.05)
    assert lim.limit == 20
    # 0.25 s where 0.05 s is expected: x = 5 > 3
    ttft(lim, 0.25, 0.2, sent_at=0.15)
    assert lim.limit == 16
    assert lim.last_cut_reason == "ttft"
    # a slow answer to a request sent before the cut says nothing about the new limit
    ttft(lim, 0.5, 0.6, sent_at=0.1)
    assert lim.limit == 16
    # one sent after the cut does
    ttft(lim, 0.5, 0.7, sent_at=0.3)
    assert lim.limit == 12


def test_prefill_ahead_and_the_step_time_are_not_congestion() -> None:
    lim = limiter()
    lim.on_dispatch(5, 100, 0.0)
    ttft(lim, 0.05, 0.0)  # base 1e-4
    # behind 4,500 tokens of other prompts: 5,000 tokens of prefill, 0.5 s expected
    assert lim.expected_ttft(PROMPT + 4500) == pytest.approx(0.5)
    ttft(lim, 0.6, 0.1, sent_at=0.05, ahead=4500)  # x = 1.2
    assert lim.limit == 20 and lim.cuts == 0
    # with a 40 ms step (TPOT), a request waits 1.5 steps on average before its prefill
    lim.on_sample(Sample(ttft_s=0.05, tpot_s=0.04, e2e_s=2.0, sent_at=0.0), 0.2)
    assert lim.expected_ttft(PROMPT) == pytest.approx(1.5 * 0.04 + 0.05)
    ttft(lim, 0.2, 0.3, sent_at=0.25)  # x = 0.2 / 0.11 = 1.82
    assert lim.cuts == 0


def test_a_host_slow_with_nothing_of_ours_on_it_is_not_queueing() -> None:
    """The real CPU vLLM beside a pooling engine answered first tokens 3-12x its windowed
    best with nothing else of ours on it: the first-token signals are judged against what
    the host gives a request alone (host_factor), not against the lucky best."""
    lim = limiter()
    lim.on_dispatch(1, 100, 0.0)

    def first_token(seconds: float, now: float, inflight: int = 1) -> None:
        sample = Sample(
            ttft_s=seconds, prompt_tokens=PROMPT, sent_at=now - seconds, inflight=inflight
        )
        lim.on_sample(sample, now)

    first_token(0.05, 0.1)  # the best: base 1e-4, 0.05 s expected
    assert lim.host_factor(0.1) == 1.0
    first_token(0.225, 0.5)  # x = 4.5 alone: without the factor, 4.5 > 3 would cut
    assert lim.host_factor(0.5) == pytest.approx(4.5 / 1.5)
    assert lim.cuts == 0
    # beside requests of ours the first token says nothing of the host alone
    first_token(0.25, 1.0, inflight=6)  # x = 5: EWMA 4.75, under 3 x 3 = 9
    assert lim.cuts == 0 and lim.host_factor(1.0) == pytest.approx(4.5 / 1.5)
    # the pending alarm waits the same factor longer: 4 x 0.05 x 3
    assert lim.ttft_alarm_after(PROMPT) == pytest.approx(0.6)
    # well past the host's own slowness is queueing: x = 20, EWMA > 9
    first_token(1.0, 2.0, inflight=6)
    assert lim.cuts == 1 and lim.last_cut_reason == "ttft"


def test_slow_first_tokens_beside_our_own_requests_are_queueing() -> None:
    lim = limiter()
    lim.on_dispatch(20, 100, 0.0)
    lim.on_sample(Sample(ttft_s=0.05, prompt_tokens=PROMPT, sent_at=0.0, inflight=1), 0.05)
    for i in range(8):
        now = 0.3 + 0.01 * i
        lim.on_sample(Sample(ttft_s=0.2, prompt_tokens=PROMPT, sent_at=now - 0.2, inflight=20), now)
    assert lim.host_factor(0.4) == 1.0  # x = 4 with 20 of ours in flight: a cut
    assert lim.cut_reasons == {"ttft": 1}
    # a lone first token sets the host factor; after tpot_floor_s (300 s) it is forgotten
    lim.on_sample(Sample(ttft_s=0.2, prompt_tokens=PROMPT, sent_at=0.5, inflight=1), 0.7)
    assert lim.host_factor(0.7) == pytest.approx(4.0 / 1.5)
    assert lim.host_factor(0.7 + 300.1) == 1.0


def test_a_moderate_ttft_rise_neither_cuts_nor_grows() -> None:
    lim = limiter()
    lim.on_dispatch(20, 100, 0.0)
    ttft(lim, 0.05, 0.0)  # base
    ttft(lim, 0.05, 0.1)  # x = 1: grows (slow start) to 21
    assert lim.limit == 21
    ttft(lim, 0.1, 0.2)  # x = 2, EWMA 1.5 <= 1.5: grows to 22
    assert lim.limit == 22
    ttft(lim, 0.1, 0.3)  # EWMA 1.75, between 1.5 and 3: holds
    assert lim.limit == 22
    assert lim.cuts == 0


def test_no_growth_while_inflight_is_far_below_the_limit() -> None:
    lim = limiter()
    lim.on_dispatch(5, 100, 0.0)  # 5 of 20
    for i in range(10):
        ttft(lim, 0.05, 0.1 * i)
    assert lim.limit == 20
    lim.on_dispatch(16, 100, 1.0)  # 16 >= 0.8 * 20: near the limit
    ttft(lim, 0.05, 1.0)
    assert lim.limit == 21  # slow start: +1 per good sample


def test_near_the_limit_counts_the_share_p1_and_p2_may_use() -> None:
    lim = limiter(usable_share=0.8)  # reserved.p0 = 0.2: P1/P2 fill at most 16 of 20
    lim.on_dispatch(13, 100, 0.0)  # 13 >= 0.8 * 16
    ttft(lim, 0.05, 0.0)
    ttft(lim, 0.05, 0.1)
    assert lim.limit == 21


def test_growth_slows_after_the_first_cut() -> None:
    lim = limiter(initial=100)
    lim.on_dispatch(100, 100, 0.0)
    lim.on_metrics(BackendMetrics(at=-0.25, waiting=1), -0.25)
    lim.on_metrics(BackendMetrics(at=0.0, waiting=1), 0.0)
    assert lim.latency_limit == 80.0
    lim.on_metrics(BackendMetrics(at=0.25, waiting=0), 0.25)  # the backlog is gone
    lim.on_release(80, 0.3)
    ttft(lim, 0.05, 0.3)  # base
    ttft(lim, 0.05, 0.35)
    assert lim.latency_limit == pytest.approx(80 + 4 / 80**0.5)  # +growth / sqrt(limit)
    assert lim.limit == 80


def test_no_growth_under_hard_congestion_or_high_kv() -> None:
    lim = limiter()
    lim.on_dispatch(20, 100, 0.0)
    lim.on_metrics(BackendMetrics(at=0.0, kv_usage=0.85), 0.0)  # above kv_low 0.8
    ttft(lim, 0.05, 0.1)
    ttft(lim, 0.05, 0.2)
    assert lim.limit == 20
    lim.on_metrics_stale(0.3)  # latency-only control: forget the scrape
    ttft(lim, 0.05, 0.4)
    assert lim.limit == 21


def test_base_latency_is_re_measured() -> None:
    lim = limiter()  # probe windows of 10 s, no jitter
    lim.on_dispatch(5, 100, 0.0)  # 5 in flight: no growth while the limit is 20
    for t in range(10):
        ttft(lim, 0.05, float(t), sent_at=float(t))  # 1e-4 s per token
    # the workload changes: every TTFT is now 4x what the old base predicts
    ttft(lim, 0.2, 10.5, sent_at=10.5)  # x = 4, EWMA 2.5
    assert lim.limit == 20
    ttft(lim, 0.2, 11.0, sent_at=11.0)  # EWMA 3.25 > 3: cut
    assert lim.limit == 16
    for t in range(12, 21):
        ttft(lim, 0.2, float(t), sent_at=float(t))
    # with the old minimum every new sample looks congested: a cut each second
    assert lim.latency_limit == pytest.approx(16 * 0.8**9)
    assert lim.ttft_base == pytest.approx(1e-4)
    # the window that began at 10.5 ends at 20.5: the old minimum is forgotten and the
    # new TTFT is the base; no more cuts, and growth resumes once the EWMA settles
    ttft(lim, 0.2, 20.6, sent_at=20.6)
    assert lim.ttft_base == pytest.approx(4e-4)
    cut_before = lim.cuts
    for k in range(1, 4):
        ttft(lim, 0.2, 20.6 + 0.1 * k, sent_at=20.6 + 0.1 * k)
    assert lim.cuts == cut_before
    # the EWMA (alpha 0.5) had climbed from 1 toward 4 over 11 samples, then falls to 1
    climbed = 4 - 3 * 0.5**11
    assert lim.ttft_ratio == pytest.approx(1 + (climbed - 1) * 0.5**4)
    assert lim.latency_limit > 16 * 0.8**9  # grew again


def test_pending_ttft_alarm() -> None:
    lim = limiter()
    assert lim.ttft_alarm_after(PROMPT) is None  # no base yet
    lim.on_dispatch(20, 100, 0.0)
    ttft(lim, 0.05, 0.0)
    assert lim.ttft_alarm_after(PROMPT) == pytest.approx(4 * 0.05)
    lim.on_sample(Sample(ttft_s=0.2, sent_at=0.1, pending=True), 0.3)
    assert lim.limit == 16
    assert lim.last_cut_reason == "ttft-pending"


# -- TPOT, drops, KV budget ----------------------------------------------------------------


def test_tpot_above_its_target_cuts() -> None:
    lim = limiter()
    lim.on_dispatch(20, 100, 0.0)
    lim.on_sample(Sample(ttft_s=0.05, tpot_s=0.01, e2e_s=1.0, sent_at=0.0), 1.0)
    assert lim.tpot_target(1.0) == pytest.approx(0.03)  # max(30 ms, 3 x base 10 ms)
    assert lim.limit == 20
    lim.on_sample(Sample(ttft_s=0.05, tpot_s=0.03, e2e_s=1.0, sent_at=0.4), 1.4)
    assert lim.limit == 20  # EWMA 0.016
    # EWMA 0.016 + 0.3 * (0.1 - 0.016) = 0.0412 > 0.03
    lim.on_sample(Sample(ttft_s=0.05, tpot_s=0.1, e2e_s=1.0, sent_at=0.5), 1.5)
    assert lim.limit == 16
    assert lim.last_cut_reason == "tpot"


def test_tpot_target_follows_a_slow_model() -> None:
    lim = limiter()
    lim.on_sample(Sample(tpot_s=0.05, e2e_s=1.0), 0.0)
    assert lim.tpot_target(0.0) == pytest.approx(0.15)  # 3 x base above the 30 ms floor


def test_sustained_load_does_not_raise_the_tpot_target() -> None:
    # the windowed base forgets the light moments within two windows (10 s here); the
    # target keeps the lowest TPOT of the last 5 min for the same mix
    lim = limiter()
    lim.on_dispatch(20, 500, 0.0)
    lim.on_sample(Sample(tpot_s=0.012, e2e_s=1.0), 0.0)
    assert lim.tpot_target(0.0) == pytest.approx(0.036)
    for k in range(1, 60):  # a minute of full batches at 20 ms per token, same mix
        lim.on_dispatch(20, 500, float(k))
        lim.on_sample(Sample(tpot_s=0.020, e2e_s=1.0), float(k))
    assert lim.describe()["tpot_base_s"] == pytest.approx(0.020)  # the window moved on
    assert lim.tpot_target(60.0) == pytest.approx(0.036)  # still 3 x 12 ms, not 3 x 20


def test_a_new_request_mix_gets_a_new_tpot_target() -> None:
    lim = limiter()
    lim.on_dispatch(20, 500, 0.0)
    lim.on_sample(Sample(tpot_s=0.012, e2e_s=1.0), 0.0)
    for k in range(1, 200):  # prompts 8x longer: the mix's footprint moves past 1.5x
        lim.on_dispatch(20, 4000, 0.1 * k)
    for k in range(30, 60):
        lim.on_sample(Sample(tpot_s=0.025, e2e_s=1.0), float(k))
    assert lim.tpot_target(60.0) == pytest.approx(0.075)  # 3 x the new mix's 25 ms


def test_drops_cut_once_per_window() -> None:
    lim = limiter()
    lim.on_dispatch(20, 100, 0.0)
    lim.on_sample(Sample(e2e_s=1.0, dropped=True, sent_at=0.0), 1.0)
    assert lim.limit == 16
    lim.on_sample(Sample(e2e_s=1.0, dropped=True, sent_at=0.5), 2.0)  # sent before the cut
    assert lim.limit == 16
    lim.on_sample(Sample(e2e_s=1.0, dropped=True, sent_at=1.5), 2.5)
    assert lim.limit == 12


def test_kv_budget_caps_the_limit_when_prompts_grow() -> None:
    lim = limiter(footprint_alpha=1.0)
    lim.on_metrics(BackendMetrics(at=0.0, num_gpu_blocks=100, block_size=16), 0.0)
    assert lim.kv_budget_tokens == pytest.approx(1280.0)  # 0.8 * 1600
    lim.on_dispatch(1, 100, 0.0)
    assert lim.limit == 12  # floor(1280 / 100) < 20
    lim.on_dispatch(2, 400, 0.1)  # prompts jump: 400 tokens per request
    assert lim.limit == 3


def test_describe_is_plain_data() -> None:
    lim = limiter()
    lim.on_dispatch(20, 100, 0.0)
    lim.on_metrics(BackendMetrics(at=-0.25, waiting=1), -0.25)
    lim.on_metrics(BackendMetrics(at=0.0, waiting=1), 0.0)
    d = lim.describe()
    assert d["cuts"] == 1 and d["cut_reasons"] == {"waiting": 1}
    assert d["slow_start"] is False


# -- a backend shared with other gateway replicas ----------------------------------------

# 256 blocks of 16 = 4,096 tokens; the budget is 0.8 of it = 3,276.8
TINY_KV = {"num_gpu_blocks": 256, "block_size": 16}


def kept(share: float, footprint: float = 360.0) -> float:
    """The shared budget: 3,276.8 less the spread of the replicas' draws, sqrt(R) / 2
    requests of our footprint for R = 1 / share (core/kv_budget.py)."""
    return 3276.8 - 0.5 * math.sqrt(1.0 / share) * footprint


def shared(own_requests: int, footprint: int = 360, fleet_share: float = 0.25) -> SluiceLimiter:
    lim = limiter()
    lim.on_metrics(BackendMetrics(at=0.0, **TINY_KV), 0.0)  # type: ignore[arg-type]
    for n in range(1, own_requests + 1):
        lim.on_dispatch(n, footprint, 0.0)
    # as the controller tells it before each scrape (core/fleet_share.py)
    lim.on_fleet(float(own_requests * footprint), fleet_share, False)
    return lim


def scrape(lim: SluiceLimiter, running: int, kv_usage: float, waiting: int = 0) -> None:
    m = BackendMetrics(at=1.0, running=running, waiting=waiting, kv_usage=kv_usage, **TINY_KV)  # type: ignore[arg-type]
    lim.on_metrics(m, 1.0)


def test_a_lone_gateway_has_the_whole_budget_whatever_the_usage() -> None:
    lim = shared(3, fleet_share=1.0)
    scrape(lim, running=3, kv_usage=0.6)
    assert lim.kv_budget_tokens == pytest.approx(3276.8)
    assert lim.limit == 9  # floor(3276.8 / 360)


@pytest.mark.parametrize("replicas", [1, 2, 4, 8, 16])
def test_replicas_starting_on_an_idle_backend_claim_its_room_once_between_them(
    replicas: int,
) -> None:
    # R replicas that all see an idle backend and then get a burst must not each take the
    # whole budget before their next scrape: each claims its part of the fleet.
    budgets = []
    for _ in range(replicas):
        lim = shared(0, fleet_share=1.0 / replicas)
        scrape(lim, running=0, kv_usage=0.0)
        budgets.append(lim.kv_budget_tokens)
    assert budgets[0] == pytest.approx(3276.8 / replicas)
    assert sum(budgets) == pytest.approx(3276.8)


def test_with_other_replicas_we_claim_our_share_of_the_room_left_by_their_requests() -> None:
    lim = shared(3, fleet_share=1 / 3)
    # 9 requests there, 3 ours: the others' 6 will hold 6 * 360 tokens (more than the
    # 2,048 - 1,080 of the usage that is not ours yet); the room left is kept(1/3) -
    # 1,080 - 2,160 (negative: 275 too many), of which our part is
    # (3 + 4 * 1/3) / (9 + 4) = 1/3
    scrape(lim, running=8, waiting=1, kv_usage=0.5)
    claim = 1080 + (kept(1 / 3) - 1080 - 2160) / 3
    assert lim.kv_budget_tokens == pytest.approx(claim)  # 988.3
    assert lim.limit == 3  # ceil(988.3 / 360): shared, the budget decides
    # the budget holds until the next scrape: one of ours leaving frees its room to us
    lim.on_release(2, 1.1)
    assert lim.kv_budget_tokens == pytest.approx(claim)


def test_our_claim_leans_toward_our_part_of_the_fleet_on_a_backend_with_few_requests() -> None:
    # 2 requests there, both ours, but we are one of 4 (the others' first requests may
    # not show yet): we claim (2 + 4 * 0.25) / (2 + 4) = 1/2 of the room; the usage not
    # ours (819.2 - 720) counts as the others'
    lim = shared(2, fleet_share=0.25)
    scrape(lim, running=2, kv_usage=0.2)
    assert lim.kv_budget_tokens == pytest.approx(720 + (kept(0.25) - 720 - 99.2) / 2)


def test_the_others_waiting_requests_count_against_the_room() -> None:
    lim = shared(2, fleet_share=1 / 3)
    # 4 requests of others still waiting: not in the usage yet, but they will be; our
    # claim is (2 + 4/3) / (6 + 4) = 1/3
    scrape(lim, running=2, waiting=4, kv_usage=0.2)
    assert lim.kv_budget_tokens == pytest.approx(720 + (kept(1 / 3) - 720 - 4 * 360) / 3)


def test_over_the_budget_we_give_back_our_share_of_the_excess() -> None:
    lim = shared(3, fleet_share=1 / 3)
    scrape(lim, running=9, kv_usage=0.85)  # 3,481.6 used: 2,401.6 of it the others'
    over = kept(1 / 3) - 1080 - 2401.6  # negative
    assert lim.kv_budget_tokens == pytest.approx(1080 + over / 3)  # 907.8
    assert lim.limit == 3  # ceil(907.8 / 360)


def test_a_replica_with_nothing_in_flight_claims_its_part_of_the_room() -> None:
    lim = shared(0, fleet_share=0.25)
    # 6 requests of others, 2,048 tokens: (0 + 4 * 0.25) / (6 + 4) = 0.1 of 1,228.8 (no
    # request sent yet: no footprint, nothing kept back for the draws)
    scrape(lim, running=6, kv_usage=0.5)
    assert lim.kv_budget_tokens == pytest.approx(122.88)
    scrape(lim, running=12, kv_usage=0.95)  # others overfill it: nothing for us
    assert lim.kv_budget_tokens == 0.0
    # (and the dispatcher sends nothing there: an empty shared backend is not a free one)


def test_stale_metrics_give_the_whole_budget_back() -> None:
    lim = shared(3, fleet_share=1 / 3)
    scrape(lim, running=9, kv_usage=0.5)
    assert lim.kv_budget_tokens == pytest.approx(1080 + (kept(1 / 3) - 1080 - 2160) / 3)
    lim.on_metrics_stale(1.5)
    assert lim.kv_budget_tokens == pytest.approx(3276.8)
    # the others left: our claim is (3 + 4/3) / (3 + 4) of the room
    scrape(lim, running=3, kv_usage=0.3)
    room = kept(1 / 3) - 1080 - 148.8
    assert lim.kv_budget_tokens == pytest.approx(1080 + (13 / 21) * room)


def test_the_kv_cap_follows_the_footprint_of_the_requests_being_admitted() -> None:
    admitted: list[float | None] = [None]
    lim = limiter(footprint_alpha=1.0, demand_footprint=lambda: admitted[0])
    lim.on_metrics(BackendMetrics(at=0.0, num_gpu_blocks=100, block_size=16), 0.0)
    lim.on_dispatch(1, 100, 0.0)
    assert lim.limit == 12  # floor(1280 / 100): nothing admitted yet
    admitted[0] = 400.0  # long prompts arrive; short ones are still being sent
    lim.on_release(0, 0.1)
    assert lim.limit == 3  # floor(1280 / 400)
    lim.on_dispatch(1, 100, 0.2)
    assert lim.limit == 3
    admitted[0] = 50.0  # short prompts arrive: the cap waits for the long ones queued
    lim.on_dispatch(2, 400, 0.3)
    assert lim.limit == 3
    lim.on_dispatch(3, 100, 0.4)
    assert lim.limit == 12


def test_a_cut_lowers_the_limit_in_force_when_the_kv_cap_holds_the_latency_limit_above_it() -> None:
    # a short-prompt phase grew the latency limit to 100; long prompts make the KV cap the
    # limit in force (12): a TPOT cut from 100 (to 80) would change nothing
    lim = limiter(initial=100, footprint_alpha=1.0, cut_from_cap=True)
    lim.on_metrics(BackendMetrics(at=0.0, num_gpu_blocks=100, block_size=16), 0.0)
    lim.on_dispatch(12, 100, 0.0)
    assert (lim.latency_limit, lim.limit) == (100.0, 12)
    lim.on_sample(Sample(e2e_s=1.0, dropped=True, sent_at=0.0), 1.0)
    assert lim.latency_limit == pytest.approx(9.6)  # 0.8 x the 12 in force
    assert lim.limit == 9
    # without it (sluice's default) the cut is absorbed: 80 is still above the cap
    old = limiter(initial=100, footprint_alpha=1.0)
    old.on_metrics(BackendMetrics(at=0.0, num_gpu_blocks=100, block_size=16), 0.0)
    old.on_dispatch(12, 100, 0.0)
    old.on_sample(Sample(e2e_s=1.0, dropped=True, sent_at=0.0), 1.0)
    assert (old.latency_limit, old.limit) == (80.0, 12)


def test_a_cut_the_kv_cap_does_not_absorb_acts_on_the_latency_limit() -> None:
    lim = limiter(initial=14, footprint_alpha=1.0, cut_from_cap=True)
    lim.on_metrics(BackendMetrics(at=0.0, num_gpu_blocks=100, block_size=16), 0.0)
    lim.on_dispatch(12, 100, 0.0)
    assert lim.limit == 12  # floor(1280 / 100) < 14
    lim.on_sample(Sample(e2e_s=1.0, dropped=True, sent_at=0.0), 1.0)
    assert lim.latency_limit == pytest.approx(11.2)  # 0.8 x 14: below the 12 in force
    assert lim.limit == 11


def test_the_prefill_budget_is_the_prefill_whose_expected_ttft_is_the_target() -> None:
    lim = limiter(prefill_ttft_s=0.45)
    assert lim.prefill_budget_tokens is None  # no TTFT base yet
    ttft(lim, 0.02, 0.0)  # base 0.02 / 500 = 40 us per token
    # (0.45 - 1.5 x step 0) / 40 us - 64 fixed
    assert lim.prefill_budget_tokens == pytest.approx(0.45 / 4e-5 - 64)
    lim.on_sample(Sample(ttft_s=0.02, tpot_s=0.02, e2e_s=1.0, sent_at=0.0), 0.5)
    # a step of 20 ms in progress: a new request waits for it first
    assert lim.prefill_budget_tokens == pytest.approx((0.45 - 1.5 * 0.02) / 4e-5 - 64)
    assert limiter(prefill_ttft_s=None).prefill_budget_tokens is None
