"""The bridge between the controller and waiting handlers: assignments wake the right
handler, a queue timeout fires by itself (no other event needed), and a handler that is
cancelled while queued leaves the queue at once."""

from __future__ import annotations

import asyncio

from sluice.config import parse_policy
from sluice.core.clock import MonotonicClock
from sluice.core.controller import Controller
from sluice.core.limiters import LimiterBase
from sluice.core.types import Assignment, Outcome, RejectCode, Rejection, RequestInfo, Sample
from sluice.gateway.dispatch_bridge import DispatchBridge

POLICY = """
queues:
  - {priority: 0, name: p0, maxQueueSize: 10, timeout: 200ms, dropPolicy: tail}
  - {priority: 1, name: p1, maxQueueSize: 10, timeout: 15s, dropPolicy: tail}
  - {priority: 2, name: p2, maxQueueSize: 10, timeout: 60s, dropPolicy: tail}
limiter: {algorithm: fixed, fixedLimit: 1}
dispatcher: {reserved: {p0: 0.0}}
"""


def _setup() -> tuple[Controller, DispatchBridge]:
    clock = MonotonicClock()
    controller = Controller(parse_policy(POLICY).core_settings(), clock, ["b0"])
    controller.set_backend_health("b0", True)
    return controller, DispatchBridge(controller, clock)


def _req(rid: str) -> RequestInfo:
    return RequestInfo(
        request_id=rid, tenant="t", priority=0, model="m", prompt_tokens=10, max_tokens=10
    )


async def test_assignment_then_timeout_fires_by_itself() -> None:
    controller, bridge = _setup()
    assert controller.arrive(_req("a")).admitted
    first = await bridge.wait("a")
    assert isinstance(first, Assignment) and first.backend == "b0"
    assert controller.arrive(_req("b")).admitted
    # The only slot stays taken: "b" must be dropped by the timer at its 200 ms timeout.
    second = await asyncio.wait_for(bridge.wait("b"), 2.0)
    assert isinstance(second, Rejection) and second.code is RejectCode.QUEUE_TIMEOUT
    assert second.queued_s >= 0.2
    bridge.close()


async def test_a_finished_request_wakes_the_next_one() -> None:
    controller, bridge = _setup()
    controller.arrive(_req("a"))
    await bridge.wait("a")
    controller.arrive(_req("b"))
    waiter = asyncio.create_task(bridge.wait("b"))
    await asyncio.sleep(0)  # let it register
    assert not waiter.done()
    controller.on_finish("a", Outcome.OK, 10, 10)
    bridge.pump()
    decision = await asyncio.wait_for(waiter, 1.0)
    assert isinstance(decision, Assignment)
    bridge.close()


async def test_cancelled_waiter_leaves_the_queue() -> None:
    controller, bridge = _setup()
    controller.arrive(_req("a"))
    await bridge.wait("a")
    controller.arrive(_req("b"))
    waiter = asyncio.create_task(bridge.wait("b"))
    await asyncio.sleep(0)
    waiter.cancel()
    await asyncio.gather(waiter, return_exceptions=True)
    assert controller.snapshot().classes["P0"].queued == 0
    bridge.close()


class _AlarmRecorder(LimiterBase):
    """Limit 1; a first token is due 50 ms after sending; sets `overdue` on the sample
    the controller reports when it is not."""

    def __init__(self) -> None:
        self.overdue = asyncio.Event()

    @property
    def limit(self) -> int:
        return 1

    def ttft_alarm_after(self, prefill_tokens: float) -> float | None:
        return 0.05

    def on_sample(self, sample: Sample, now: float) -> None:
        if sample.pending:
            self.overdue.set()


async def test_a_stream_placed_on_arrival_gets_its_first_token_alarm() -> None:
    """Placed by `arrive` itself (no step, no wait), a stream's overdue first token still
    reaches the limiter with no other event: the bridge armed its timer for the alarm."""
    limiter = _AlarmRecorder()
    clock = MonotonicClock()
    controller = Controller(
        parse_policy(POLICY).core_settings(), clock, ["b0"], limiter_factory=lambda *_: limiter
    )
    controller.set_backend_health("b0", True)
    bridge = DispatchBridge(controller, clock)
    admission = bridge.arrive(_req("s"))  # first_token_visible: a stream
    assert admission.assignment is not None and admission.assignment.backend == "b0"
    await asyncio.wait_for(limiter.overdue.wait(), 2.0)
    bridge.close()
