"""Invariants of the Controller under random sequences of events (hypothesis)."""

from __future__ import annotations

from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sluice.config import Policy
from sluice.core.clock import FakeClock
from sluice.core.controller import Controller, Step
from sluice.core.kv_budget import SharedRoom
from sluice.core.limiters import Limiter, LimiterBase, LimiterContext, make_limiter
from sluice.core.request_record import RequestState
from sluice.core.settings import LimiterSettings
from sluice.core.types import BackendMetrics, Outcome, RejectCode, RequestInfo, Sample

BACKENDS = ["b0", "b1"]
ALGORITHMS = ["fixed", "sluice", "vegas-seed", "gradient"]

arrive = st.tuples(
    st.just("arrive"),
    st.integers(0, 2),  # priority
    st.sampled_from(["A", "B", "C"]),  # C has a quota
    st.integers(1, 3000),  # prompt tokens
    st.one_of(st.none(), st.floats(0.0, 30.0)),  # client deadline, from now
)
# which request: an index into the live ones, or (when `any_id`) into all ids ever seen
pick = st.tuples(st.integers(0, 40), st.booleans())
op = st.one_of(
    arrive,
    arrive,
    st.tuples(st.just("dispatch")),
    st.tuples(st.just("dispatch")),
    st.tuples(st.just("expire")),
    st.tuples(st.just("finish"), pick, st.sampled_from(list(Outcome))),
    st.tuples(st.just("first_token"), pick),
    st.tuples(st.just("cancel"), pick),
    st.tuples(st.just("advance"), st.floats(0.0, 5.0)),
    st.tuples(
        st.just("metrics"),
        st.sampled_from(BACKENDS),
        st.integers(0, 3),  # waiting
        st.floats(0.0, 1.0),  # kv usage
        st.integers(0, 5),  # preemptions
    ),
    st.tuples(st.just("stale"), st.sampled_from(BACKENDS)),
    st.tuples(st.just("health"), st.sampled_from(BACKENDS), st.booleans()),
)
ops_strategy = st.lists(op, min_size=10, max_size=150)


def make_policy(
    algorithm: str,
    limit: int = 2,
    dispatcher: dict[str, Any] | None = None,
    tokens_per_minute: int | None = None,
) -> Policy:
    """Three classes (tail, early drop, fast reject), a tight fixed-size limit and one
    tenant with request, concurrency and (optionally) token quotas."""

    def queue(p: int, drop: str, timeout: str) -> dict[str, Any]:
        return {
            "priority": p,
            "name": f"q{p}",
            "maxQueueSize": 6,
            "timeout": timeout,
            "dropPolicy": drop,
        }

    tenant: dict[str, Any] = {"name": "C", "requestsPerMinute": 20, "maxConcurrency": 3}
    if tokens_per_minute is not None:
        tenant["tokensPerMinute"] = tokens_per_minute
    doc: dict[str, Any] = {
        "queues": [
            queue(0, "tail", "8s"),
            queue(1, "early-drop-on-pressure", "15s"),
            queue(2, "fast-reject", "20s"),
        ],
        "limiter": {
            "algorithm": algorithm,
            "fixedLimit": limit,
            "minLimit": 1,
            "initialLimit": limit,
            "maxLimit": 6,
        },
        "tenants": [tenant],
    }
    if dispatcher is not None:
        doc["dispatcher"] = dispatcher
    return Policy.model_validate(doc)


class CheckedLimiter(LimiterBase):
    """Delegates to a real limiter and checks, at each dispatch, that the request was
    placed while the backend was below the limit in force at that moment."""

    def __init__(self, inner: Limiter, violations: list[str]) -> None:
        self.inner = inner
        self.violations = violations

    @property
    def limit(self) -> int:
        return self.inner.limit

    @property
    def kv_budget_tokens(self) -> float | None:
        return self.inner.kv_budget_tokens

    @property
    def kv_shared(self) -> SharedRoom | None:
        return self.inner.kv_shared

    def on_sample(self, sample: Sample, now: float) -> None:
        self.inner.on_sample(sample, now)

    def on_metrics(self, m: BackendMetrics, now: float) -> None:
        self.inner.on_metrics(m, now)

    def on_metrics_stale(self, now: float) -> None:
        self.inner.on_metrics_stale(now)

    def on_dispatch(self, inflight: int, footprint_tokens: int, now: float) -> None:
        if inflight > self.inner.limit:  # `inflight` already counts this request
            self.violations.append(f"{inflight} in flight over limit {self.inner.limit}")
        self.inner.on_dispatch(inflight, footprint_tokens, now)

    def on_release(self, inflight: int, now: float) -> None:
        self.inner.on_release(inflight, now)

    def ttft_alarm_after(self, prompt_tokens: float) -> float | None:
        return self.inner.ttft_alarm_after(prompt_tokens)


def check_counters(snap: dict[str, Any]) -> None:
    for cls in snap.classes.values():
        assert cls.arrived == cls.admitted + sum(cls.rejected.values())
        assert cls.admitted == (
            cls.queued + cls.dispatched + sum(cls.dropped.values()) + cls.cancelled_queued
        )


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(algorithm=st.sampled_from(ALGORITHMS), ops=ops_strategy)
def test_random_event_sequences_keep_the_invariants(algorithm: str, ops: list[tuple]) -> None:
    clock = FakeClock()
    violations: list[str] = []

    def factory(context: LimiterContext, lp: LimiterSettings, initial: int | None) -> Limiter:
        kw: dict[str, Any] = {"seed": context.backend} if lp.algorithm == "sluice" else {}
        return CheckedLimiter(make_limiter(lp, initial_limit=initial, **kw), violations)

    c = Controller(
        make_policy(algorithm).core_settings(),
        clock,
        BACKENDS,
        rate_tau_s=1.0,
        limiter_factory=factory,
    )
    queued: set[str] = set()  # waiting in a class queue
    inflight: dict[str, str] = {}  # id -> backend, reported by a step
    # dispatched by arrive() (the queues were empty), to be reported by the next step
    unreported: dict[str, str] = {}
    ids: list[str] = []
    finished = cancelled_inflight = 0

    def drive(s: Step) -> None:
        """Act on one step as the gateway's bridge does."""
        # those placed on arrival first, on the backend they were placed on
        early = [(a.request_id, a.backend) for a in s.assignments[: len(unreported)]]
        assert early == list(unreported.items())
        for a in s.assignments[len(unreported) :]:
            assert a.request_id in queued
            queued.discard(a.request_id)
        inflight.update((a.request_id, a.backend) for a in s.assignments)
        unreported.clear()
        for r in s.rejections:
            assert r.request_id in queued
            queued.discard(r.request_id)
            assert r.queued_s >= 0 and r.retry_after_s > 0
        assert s.wake_at is None or s.wake_at == s.wake_at  # a number, never NaN

    def choose(p: tuple[int, bool], live: list[str]) -> str | None:
        index, any_id = p
        pool = ids if any_id or not live else live
        return pool[index % len(pool)] if pool else None

    for step in ops:
        kind = step[0]
        if kind == "arrive":
            _, prio, tenant, prompt, dl = step
            rid = f"r{len(ids)}"
            ids.append(rid)
            deadline = None if dl is None else clock.now() + dl
            adm = c.arrive(
                RequestInfo(rid, tenant, prio, "m", prompt, 200, client_deadline=deadline)
            )
            if adm.admitted:
                if c.state_of(rid) is RequestState.INFLIGHT:
                    # only a request that found every queue empty skips them
                    assert not queued
                    backend = c.backend_of(rid)
                    assert backend is not None
                    unreported[rid] = backend
                else:
                    queued.add(rid)
            elif adm.code is RejectCode.TOO_LARGE:  # never retried: no Retry-After
                assert prompt * 4 > 200 * 16 and adm.retry_after_s == 0
            else:
                assert adm.code is not None and 0 < adm.retry_after_s <= 60
        elif kind in ("dispatch", "expire"):  # the shell's pass: one step
            drive(c.step())
        elif kind in ("finish", "first_token"):
            rid = choose(step[1], sorted(inflight))
            if rid is None:
                continue
            if kind == "first_token":
                c.on_first_token(rid)
            else:
                c.on_finish(rid, step[2], 100, 20)
                if rid in inflight:
                    del inflight[rid]
                    finished += 1
                elif rid in unreported:  # a driver that never waited for its report
                    del unreported[rid]
                    finished += 1
        elif kind == "cancel":
            rid = choose(step[1], sorted(queued | inflight.keys() | unreported.keys()))
            if rid is None:
                continue
            c.cancel(rid)
            queued.discard(rid)
            if rid in inflight:
                del inflight[rid]
                cancelled_inflight += 1
            elif rid in unreported:  # its slot is back and it will not be reported
                del unreported[rid]
                cancelled_inflight += 1
        elif kind == "advance":
            clock.advance(step[1])
        elif kind == "metrics":
            _, name, waiting, kv, pre = step
            c.on_metrics(
                name,
                BackendMetrics(
                    at=clock.now(),
                    waiting=waiting,
                    kv_usage=kv,
                    running=1,
                    preemptions_total=pre,
                    num_gpu_blocks=200,
                    block_size=16,
                ),
            )
        elif kind == "stale":
            c.metrics_stale(step[1])
        elif kind == "health":
            c.set_backend_health(step[1], step[2])

        # every request is in exactly one state, the one its driver was told
        for rid in ids:
            state = c.state_of(rid)
            if rid in queued:
                assert state is RequestState.QUEUED
            elif rid in inflight or rid in unreported:
                assert state is RequestState.INFLIGHT
                assert c.backend_of(rid) == inflight.get(rid, unreported.get(rid))
            else:
                assert state is RequestState.GONE
        snap = c.snapshot()
        check_counters(snap)
        for name, b in snap.backends.items():
            on_it = [be for be in (*inflight.values(), *unreported.values()) if be == name]
            assert b.inflight == len(on_it)
        assert sum(cls.queued for cls in snap.classes.values()) == len(queued)
        assert 0.0 <= snap.pressure <= 1.0

    assert violations == []  # never placed over the limit in force
    classes = c.snapshot().classes.values()
    dispatched = sum(cls.dispatched for cls in classes)
    assert sum(sum(cls.finished.values()) for cls in classes) == finished
    assert sum(cls.cancelled_inflight for cls in classes) == cancelled_inflight
    assert dispatched == len(inflight) + len(unreported) + finished + cancelled_inflight
