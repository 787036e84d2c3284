"""Bridges the core Controller's decisions to the request handlers that wait on them.

A handler submits its request through `arrive`: placed at once, the Admission carries its
assignment; queued, the handler awaits `wait(request_id)`. Every event that may free a slot
calls `pump()`, which runs one controller step (what may go now, what must be dropped, when
to look again) and wakes the matching handlers; when nothing is queued or to be reported
(the controller is quiet) there is nothing for a step to do and it is skipped. A timer
wakes the pump when the time a step named comes (a queue timeout, a first-token alarm),
so timeouts need no polling."""

from __future__ import annotations

import asyncio

from sluice.core.clock import Clock
from sluice.core.controller import Controller
from sluice.core.types import Admission, Assignment, Rejection, RequestInfo


class DispatchBridge:
    def __init__(self, controller: Controller, clock: Clock) -> None:
        self._controller = controller
        self._clock = clock
        self._waiters: dict[str, asyncio.Future[Assignment | Rejection]] = {}
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at: float | None = None

    def arrive(self, info: RequestInfo) -> Admission:
        """The controller's answer to this arrival (`Controller.arrive` with take=True)."""
        admission = self._controller.arrive(info, take=True)
        if admission.assignment is not None and info.first_token_visible:
            # it may have armed a first-token alarm: the timer must fire for it
            at = self._controller.next_alarm_at()
            if at is not None:
                self._arm_timer(at)
        return admission

    async def wait(self, request_id: str) -> Assignment | Rejection:
        """Wait for the request's turn. If the waiting task is cancelled (its client hung
        up), the request leaves the queue at once."""
        # Below the limit the request goes at once: no future, no suspension.
        decision = self._pump(request_id)
        if decision is not None:
            return decision
        fut: asyncio.Future[Assignment | Rejection] = asyncio.get_running_loop().create_future()
        self._waiters[request_id] = fut
        try:
            return await fut
        except asyncio.CancelledError:
            self._waiters.pop(request_id, None)
            self._controller.cancel(request_id)
            self.pump()
            raise

    def pump(self) -> None:
        if not self._controller.quiet():
            self._pump(None)

    def _pump(self, own: str | None) -> Assignment | Rejection | None:
        """Act on one controller step; returns the decision about `own` (the caller's
        request, which has no waiter yet) if the step made one."""
        found: Assignment | Rejection | None = None
        assignments, rejections, wake_at = self._controller.step()
        for assignment in assignments:
            if assignment.request_id == own:
                found = assignment
            elif not self._resolve(assignment.request_id, assignment):
                # Its handler is gone: give the slot back.
                self._controller.cancel(assignment.request_id)
        for rejection in rejections:
            if rejection.request_id == own:
                found = rejection
            else:
                self._resolve(rejection.request_id, rejection)
        if wake_at is not None:
            self._arm_timer(wake_at)
        return found

    def _resolve(self, request_id: str, decision: Assignment | Rejection) -> bool:
        fut = self._waiters.pop(request_id, None)
        if fut is None or fut.done():
            return False
        fut.set_result(decision)
        return True

    def _arm_timer(self, wake_at: float) -> None:
        # Keep an armed timer that fires no later than needed: re-arming on every request
        # (each dispatch sets a first-token alarm) costs more than a wake-up for nothing.
        if self._timer_at is not None and self._timer_at <= wake_at:
            return
        if self._timer is not None:
            self._timer.cancel()
        self._timer_at = wake_at
        delay = max(0.0, wake_at - self._clock.now())
        self._timer = asyncio.get_running_loop().call_later(delay, self._on_timer)

    def _on_timer(self) -> None:
        self._timer = None
        self._timer_at = None
        self._pump(None)  # always: due alarms fire in the step

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        for fut in self._waiters.values():
            if not fut.done():
                fut.cancel()
        self._waiters.clear()
