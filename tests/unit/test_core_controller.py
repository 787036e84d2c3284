"""Controller: the samples it feeds the limiters, backends coming and going, hot reload."""

from __future__ import annotations

import json

import pytest

from sluice.config import Policy
from sluice.core.clock import FakeClock
from sluice.core.controller import HANDOVER_RETRY_S, Controller
from sluice.core.limiters import LimiterBase, LimiterContext, SluiceLimiter
from sluice.core.request_record import RequestState
from sluice.core.settings import LimiterSettings
from sluice.core.types import BackendMetrics, Outcome, RejectCode, RequestInfo, Sample


def policy(limit: int = 4, algorithm: str = "fixed", **extra: object) -> Policy:
    doc: dict[str, object] = {
        "limiter": {"algorithm": algorithm, "fixedLimit": limit, "initialLimit": limit},
        "dispatcher": {"reserved": {"p0": 0.0}},
    }
    doc.update(extra)
    return Policy.model_validate(doc)


def req(rid: str, prio: int = 0, prompt: int = 244, max_tokens: int = 100) -> RequestInfo:
    return RequestInfo(rid, "t", prio, "m", prompt, max_tokens)


class Recorder(LimiterBase):
    def __init__(self, limit: int = 4) -> None:
        self.samples: list[tuple[Sample, float]] = []
        self.events: list[tuple[str, int, float]] = []
        self._limit = limit

    @property
    def limit(self) -> int:
        return self._limit

    def on_sample(self, sample: Sample, now: float) -> None:
        self.samples.append((sample, now))

    def on_dispatch(self, inflight: int, footprint_tokens: int, now: float) -> None:
        self.events.append(("dispatch", inflight, now))

    def on_release(self, inflight: int, now: float) -> None:
        self.events.append(("release", inflight, now))


def recorded(limit: int = 4) -> tuple[Controller, FakeClock, dict[str, Recorder]]:
    recs: dict[str, Recorder] = {}

    def factory(context: LimiterContext, lp: LimiterSettings, initial: int | None) -> Recorder:
        recs[context.backend] = Recorder(limit)
        return recs[context.backend]

    clock = FakeClock()
    return Controller(policy().core_settings(), clock, ["b0"], limiter_factory=factory), clock, recs


def test_samples_at_first_token_and_at_the_end() -> None:
    c, clock, recs = recorded()
    clock.set(1.0)
    c.arrive(req("a"))  # the queues are empty and b0 has room: both go on arrival,
    c.arrive(req("b"))  # and the next pass reports them
    assert [(x.request_id, x.queued_s) for x in c.step().assignments] == [("a", 0.0), ("b", 0.0)]
    clock.set(1.2)
    c.on_first_token("b")
    c.on_first_token("b")  # a repeat is ignored
    clock.set(3.2)
    c.on_finish("b", Outcome.OK, prompt_tokens=250, completion_tokens=101)
    rec = recs["b0"]
    (first, t1), (end, t2) = rec.samples
    assert t1 == 1.2 and t2 == 3.2
    # "a" was sent first and had no first token yet: its prompt is prefill ahead of "b"
    assert first.ttft_s == pytest.approx(0.2)
    assert first == Sample(
        ttft_s=first.ttft_s,
        prompt_tokens=244,
        inflight=2,
        sent_at=1.0,
        prefill_ahead=244.0,
        priority=first.priority,
        max_tokens=100,
    )
    assert end.e2e_s == pytest.approx(2.2)
    assert end.priority == first.priority and end.max_tokens == 100
    assert end.ttft_s == pytest.approx(0.2)
    assert end.tpot_s == pytest.approx(2.0 / 100)
    assert (end.prompt_tokens, end.completion_tokens, end.inflight) == (250, 101, 2)
    assert not end.dropped and end.sent_at == 1.0
    assert rec.events == [("dispatch", 1, 1.0), ("dispatch", 2, 1.0), ("release", 1, 3.2)]


def test_errors_are_drops_and_cancellations_give_no_sample() -> None:
    c, _clock, recs = recorded()
    for rid in ("err", "timeout", "over", "cancelled", "gone"):
        c.arrive(req(rid))
    c.step()
    c.on_finish("err", Outcome.ERROR)
    c.on_finish("timeout", Outcome.TIMEOUT)
    c.on_finish("over", Outcome.OVERLOADED)
    c.on_finish("cancelled", Outcome.CANCELLED)
    assert [s.dropped for s, _ in recs["b0"].samples] == [True, True, True]
    assert recs["b0"].samples[0][0].ttft_s is None  # no first token was seen
    assert c.state_of("cancelled") is RequestState.GONE


def test_unknown_and_repeated_calls_are_no_ops() -> None:
    c, _clock, _ = recorded(limit=1)
    c.cancel("nope")
    c.on_first_token("nope")
    c.on_finish("nope", Outcome.OK)
    c.on_metrics("no-such-backend", BackendMetrics(at=0.0))
    c.metrics_stale("no-such-backend")
    c.set_backend_health("no-such-backend", False)
    c.set_backend_models("no-such-backend", ["x"])
    c.arrive(req("busy"))  # takes b0's only slot on arrival
    c.arrive(req("a"))
    c.on_finish("a", Outcome.OK)  # still queued: not finished
    c.on_first_token("a")  # nor started
    assert c.state_of("a") is RequestState.QUEUED
    assert c.snapshot().classes["P0"].queued == 1
    with pytest.raises(ValueError):
        c.arrive(req("a"))
    with pytest.raises(ValueError):
        c.arrive(RequestInfo("x", "t", 3, "m", 1, 1))


def test_removing_a_backend_keeps_the_others_counts() -> None:
    clock = FakeClock()
    c = Controller(policy(limit=1).core_settings(), clock, ["b0", "b1"])
    c.arrive(req("a"))
    c.arrive(req("b"))
    placed = {x.request_id: x.backend for x in c.step().assignments}
    assert placed == {"a": "b0", "b": "b1"}
    c.set_backends(["b1", "b2"])
    snap = c.snapshot().backends
    assert set(snap) == {"b1", "b2"}
    assert snap["b1"].inflight == 1 and snap["b2"].inflight == 0
    c.on_finish("a", Outcome.OK, 244, 10)  # its backend is gone: no error
    assert c.state_of("a") is RequestState.GONE
    c.arrive(req("c"))
    assert [x.backend for x in c.step().assignments] == ["b2"]
    c.set_backends([])
    adm = c.arrive(req("d"))
    assert adm.code == "no_backend"


def test_hot_reload_keeps_queued_and_in_flight_requests() -> None:
    clock = FakeClock()
    c = Controller(policy(limit=1).core_settings(), clock, ["b0"])
    for rid in ("a", "b", "c"):
        c.arrive(req(rid))
    c.step()
    new = Policy.model_validate(
        {
            "queues": [
                {
                    "priority": 0,
                    "name": "rt",
                    "maxQueueSize": 1,
                    "timeout": "2s",
                    "dropPolicy": "tail",
                },
                {
                    "priority": 1,
                    "name": "p1",
                    "maxQueueSize": 5,
                    "timeout": "15s",
                    "dropPolicy": "tail",
                },
                {
                    "priority": 2,
                    "name": "p2",
                    "maxQueueSize": 5,
                    "timeout": "60s",
                    "dropPolicy": "tail",
                },
            ],
            "limiter": {"algorithm": "fixed", "fixedLimit": 2},
        }
    )
    c.apply_policy(new.core_settings())
    assert c.state_of("a") is RequestState.INFLIGHT
    assert c.state_of("b") is RequestState.QUEUED and c.state_of("c") is RequestState.QUEUED
    assert c.arrive(req("d")).code == "queue_full"  # 2 queued, new size 1
    assert [x.request_id for x in c.step().assignments] == ["b"]  # the new limit 2
    assert c.step().wake_at == 2.0  # the new timeout applies to those already queued
    clock.set(2.0)
    assert [r.request_id for r in c.step().rejections] == ["c"]
    assert c.snapshot().backends["b0"].limit == 2


def test_hot_reload_of_the_algorithm_keeps_the_current_limit() -> None:
    clock = FakeClock()
    c = Controller(policy(limit=6).core_settings(), clock, ["b0"])
    c.apply_policy(
        policy(algorithm="sluice", limiter={"algorithm": "sluice", "maxLimit": 50}).core_settings()
    )
    assert c.snapshot().backends["b0"].limit == 6
    assert c.snapshot().algorithm == "sluice"


def sluice_controller() -> tuple[Controller, FakeClock]:
    """One backend under the sluice limiter starting at 10, no probe jitter."""
    clock = FakeClock()
    c = Controller(
        policy(
            algorithm="sluice", limiter={"algorithm": "sluice", "initialLimit": 10}
        ).core_settings(),
        clock,
        ["b0"],
        limiter_kwargs={"sluice": {"probe_jitter": 0.0}},
    )
    return c, clock


def test_a_non_streamed_answer_is_never_taken_for_an_overdue_first_token() -> None:
    """Its first token is not visible (the answer comes whole at the end): however long it
    takes, it arms no first-token alarm and cuts nothing."""
    c, clock = sluice_controller()
    c.arrive(req("r0", prompt=436))
    c.step()
    clock.set(0.05)
    c.on_first_token("r0")  # a stream: the base is 1e-4 s/token
    c.on_finish("r0", Outcome.OK, 436, 1)
    limiter = c._dispatcher.backends["b0"].limiter
    assert isinstance(limiter, SluiceLimiter)
    whole = RequestInfo("r1", "t", 0, "m", 436, 100, first_token_visible=False)
    c.arrive(whole)
    assert [a.request_id for a in c.step().assignments] == ["r1"]
    assert c.step().wake_at is None  # no alarm armed
    clock.set(60.0)  # a minute later, still generating
    assert c.step().rejections == [] and c.step().assignments == []
    assert limiter.cuts == 0
    c.arrive(req("r2", prompt=436))  # a stream sent now does arm one
    c.step()
    assert c.step().wake_at is not None


def test_sluice_limiter_end_to_end_cut_on_metrics_and_pending_ttft() -> None:
    c, clock = sluice_controller()
    for i in range(12):
        c.arrive(req(f"r{i}", prompt=436))
    assert len(c.step().assignments) == 10
    limiter = c._dispatcher.backends["b0"].limiter
    assert isinstance(limiter, SluiceLimiter)
    clock.set(0.05)
    # r0 went first: nothing ahead; TTFT 0.05 s for 436 + 64 tokens: base 1e-4 s/token
    c.on_first_token("r0")
    assert limiter.ttft_base == pytest.approx(1e-4)
    c.on_finish("r0", Outcome.OK, 436, 1)
    assert [x.request_id for x in c.step().assignments] == ["r10"]
    # r10 waits for the 9 prompts ahead of it (none has a first token) and its own:
    # expected 1e-4 * (10 * 436 + 64) s; overdue after 4 times that
    alarm = 0.05 + 4 * 1e-4 * (10 * 436 + 64)
    # (r1..r9 were sent before there was a base: they carry no alarm)
    assert c.step().wake_at == pytest.approx(alarm)
    clock.set(alarm)
    assert c.step().rejections == []
    assert limiter.cuts == 1
    assert limiter.last_cut_reason == "ttft-pending"
    assert c.snapshot().backends["b0"].limit == 8  # 10 * 0.8
    assert c.step().assignments == []  # 10 in flight > 8
    clock.set(alarm + 1.0)
    c.on_metrics("b0", BackendMetrics(at=clock.now(), waiting=3, running=7))
    assert limiter.cuts == 1  # 10 in flight: the last cut is still draining
    for rid in ("r1", "r2"):
        c.on_finish(rid, Outcome.OK, 436, 1)
    c.on_metrics("b0", BackendMetrics(at=clock.now(), waiting=1, running=7))
    assert limiter.cuts == 2  # 8 in flight, still queueing: cut again
    assert c.snapshot().backends["b0"].limit == 6  # floor(6.4)


def test_snapshot_is_json_and_counters_add_up() -> None:
    clock = FakeClock()
    c = Controller(policy(limit=1).core_settings(), clock, ["b0"])
    c.arrive(req("a"))
    c.arrive(req("b"))
    c.arrive(req("x", prio=1))
    c.step()
    c.cancel("b")
    c.on_metrics("b0", BackendMetrics(at=0.0, kv_usage=0.3, waiting=0))
    snap = c.snapshot()
    json.dumps(snap.as_dict())  # its JSON form: plain values
    p0 = snap.classes["P0"]
    assert p0.arrived == 2 and p0.admitted == 2 and p0.dispatched == 1
    assert p0.cancelled_queued == 1 and p0.queued == 0
    assert snap.classes["P1"].queued == 1
    assert snap.backends["b0"].kv_usage == 0.3
    assert snap.backends["b0"].metrics_fresh is True


def test_a_prefill_only_request_holds_kv_for_its_prompt_and_is_all_ttft() -> None:
    """Embeddings, rerank, score: no output to cost or learn; the whole request is its
    prefill, so the limiter's sample is a time to first token."""
    c, clock, recs = recorded()
    clock.set(1.0)
    c.arrive(RequestInfo("e", "t", 0, "m", 300, 1024, prefill_only=True, first_token_visible=False))
    c.arrive(RequestInfo("g", "t", 0, "m", 300, 1024, first_token_visible=False))
    c.step()
    snap = c.snapshot().backends["b0"]
    # the generation request adds half its max_tokens (nothing learned yet), the other none,
    # and counts in the KV budget at its share of a two-step pipeline (prefill_pipeline)
    assert snap.inflight_tokens == 150 + (300 + 512)
    clock.set(1.4)
    c.on_finish("e", Outcome.OK, prompt_tokens=300, completion_tokens=0)
    # its answer is its first token: a first-token sample, then the end's
    (first, _), (sample, _) = recs["b0"].samples
    assert first.ttft_s == pytest.approx(0.4) and first.e2e_s is None
    assert first.prompt_tokens == 300 and first.prefill_ahead == 0.0
    assert sample.ttft_s == pytest.approx(0.4) and sample.e2e_s == pytest.approx(0.4)
    assert sample.tpot_s is None and sample.completion_tokens == 0
    # it taught no output length: the next generation request is still costed at half
    c.arrive(RequestInfo("g2", "t", 0, "m", 300, 1024, first_token_visible=False))
    c.step()
    assert c.snapshot().backends["b0"].inflight_tokens == 2 * (300 + 512)


def test_sequences_multiply_the_expected_output_and_learn_per_sequence() -> None:
    c, _clock, _recs = recorded()
    c.arrive(RequestInfo("n4", "t", 0, "m", 100, 200, sequences=4, first_token_visible=False))
    c.step()
    assert c.snapshot().backends["b0"].inflight_tokens == 100 + 4 * 100
    c.on_finish("n4", Outcome.OK, prompt_tokens=100, completion_tokens=4 * 50)
    c.arrive(RequestInfo("one", "t", 0, "m", 100, 200, first_token_visible=False))
    c.step()
    # learned 50 a sequence (EWMA's first value is taken as it is)
    assert c.snapshot().backends["b0"].inflight_tokens == 100 + 50


def test_a_pinned_request_waits_for_its_own_backend() -> None:
    """A continuation of a response stored on a backend runs there, even when another
    backend has room; waiting for it does not hold the lower classes back."""
    clock = FakeClock()
    c = Controller(policy(limit=1).core_settings(), clock, ["b0", "b1"])
    c.arrive(req("busy"))
    (first,) = c.step().assignments
    pinned_to = first.backend
    other = "b1" if pinned_to == "b0" else "b0"
    c.arrive(RequestInfo("pinned", "t", 0, "m", 10, 10, backend=pinned_to))
    assert c.step().assignments == []  # its backend is full; the other's free slot is not for it
    c.arrive(req("lower", prio=1))
    assert [(a.request_id, a.backend) for a in c.step().assignments] == [("lower", other)]
    c.on_finish("busy", Outcome.OK, 10, 10)
    assert [(a.request_id, a.backend) for a in c.step().assignments] == [("pinned", pinned_to)]


def test_a_shutting_down_gateway_hands_its_queue_back_and_finishes_what_runs() -> None:
    """SIGTERM: every queued request is handed back at once (503 shutting_down, retry on
    another replica), nothing is admitted any more, what is in flight finishes; the
    counters still add up."""
    clock = FakeClock()
    c = Controller(policy(limit=1).core_settings(), clock, ["b0"])
    c.arrive(req("a"))
    c.step()  # "a" runs
    c.arrive(req("b"))
    c.arrive(req("c", prio=1))
    clock.advance(3.0)
    c.hand_over()
    c.hand_over()  # a second signal changes nothing
    step = c.step()
    assert step.assignments == []
    assert [(r.request_id, r.code.value, r.retry_after_s, r.queued_s) for r in step.rejections] == [
        ("b", "shutting_down", HANDOVER_RETRY_S, 3.0),
        ("c", "shutting_down", HANDOVER_RETRY_S, 3.0),
    ]
    late = c.arrive(req("d"))
    assert (late.admitted, late.code, late.retry_after_s) == (
        False,
        RejectCode.SHUTTING_DOWN,
        HANDOVER_RETRY_S,
    )
    c.on_finish("a", Outcome.OK, 244, 100)
    assert c.step().assignments == []
    snap = c.snapshot().classes
    assert snap["P0"].queued == 0 and snap["P1"].queued == 0
    assert snap["P0"].dropped == {"shutting_down": 1}
    assert snap["P0"].admitted == snap["P0"].dispatched + 1  # "a" ran, "b" handed back
    assert snap["P0"].rejected == {"shutting_down": 1}


def test_limits_are_each_backends_limit_in_force() -> None:
    c, _, _ = recorded(limit=3)
    assert c.limits() == {"b0": 3}
    assert c.limits() == {name: b.limit for name, b in c.snapshot().backends.items()}
