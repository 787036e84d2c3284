"""One priority class's queue: per-tenant fair sub-queues with deficit round robin.

Structure (every operation O(1) amortised, except DRR turns over tenants):
  * `by_arrival`: every queued record in arrival order (OrderedDict; read-only outside),
    for the oldest request (class timeout, head sojourn) and O(1) removal by request id;
  * one OrderedDict per tenant, in arrival order, for that tenant's next request;
  * a deque of active tenants for deficit round robin on estimated tokens: on its turn a
    tenant earns quantum * weight tokens of credit and is served while its head request's
    estimated cost fits in its credit; an emptied tenant loses its credit. The quantum is
    the largest cost seen so far, so a weight-1 tenant is served at least once per turn;
  * a heap of client deadlines (lazy deletion) for requests that carry one;
  * a returns lane: requests that came back in the return slot a refusal booked for them
    (`return_slots`), served before the tenants' queues in the order they came back (the
    promise of the slot: ahead of fresh arrivals of the class);
  * per model, its requests in arrival order (the returns lane's too): when the class's
    next request waits for its model's backends, the oldest request of another model,
    whose backends have room, may go first (the dispatcher's `_another_model`), rather
    than wait behind it.
  * `parked`: requests taken out of the round robin or the returns lane (a large request
    that has held the others back as long as it may, see the dispatcher): still queued,
    in `by_arrival`, tried before the round robin's next request but never holding it back.

The drop rules themselves are in `drop_policy`; this class finds what is due given the
slack the policy asks for.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict, deque

from sluice.core.request_record import RequestRecord
from sluice.core.settings import QueueSettings


class TenantQueue:
    __slots__ = ("active", "deficit", "items", "name", "turn", "weight")

    def __init__(self, name: str, weight: float) -> None:
        self.name = name
        self.weight = weight
        self.items: OrderedDict[str, RequestRecord] = OrderedDict()
        self.deficit = 0.0
        self.turn = False  # credit already granted for the current turn
        self.active = False  # in the round-robin deque


class ClassQueue:
    def __init__(self, policy: QueueSettings) -> None:
        self.policy = policy
        self.by_arrival: OrderedDict[str, RequestRecord] = OrderedDict()
        self._tenants: dict[str, TenantQueue] = {}
        self._active: deque[TenantQueue] = deque()
        self._deadlines: list[tuple[float, int, str]] = []
        self._quantum = 1.0
        self.returns: OrderedDict[str, RequestRecord] = OrderedDict()
        self.by_model: dict[str, OrderedDict[str, RequestRecord]] = {}
        self.parked: OrderedDict[str, RequestRecord] = OrderedDict()

    @property
    def priority(self) -> int:
        return self.policy.priority

    def __len__(self) -> int:
        return len(self.by_arrival)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self.by_arrival

    def oldest(self) -> RequestRecord | None:
        for rec in self.by_arrival.values():
            return rec
        return None

    def head_sojourn(self, now: float) -> float:
        rec = self.oldest()
        return 0.0 if rec is None else now - rec.enqueued_at

    def tenant_depths(self) -> dict[str, int]:
        depths = {name: len(t.items) for name, t in self._tenants.items() if t.items}
        for rec in self.parked.values():
            depths[rec.tenant] = depths.get(rec.tenant, 0) + 1
        return depths

    # -- add / remove ------------------------------------------------------------------

    def push(self, rec: RequestRecord, *, returning: bool = False) -> None:
        self.by_arrival[rec.request_id] = rec
        if rec.deadline is not None:
            heapq.heappush(self._deadlines, (rec.deadline, rec.seq, rec.request_id))
        if rec.cost > self._quantum:
            self._quantum = float(rec.cost)
        of_model = self.by_model.get(rec.model)
        if of_model is None:
            of_model = self.by_model[rec.model] = OrderedDict()
        of_model[rec.request_id] = rec
        if returning:
            self.returns[rec.request_id] = rec
            return
        t = self._tenants.get(rec.tenant)
        if t is None:
            t = self._tenants[rec.tenant] = TenantQueue(rec.tenant, rec.weight)
        else:
            t.weight = rec.weight
        t.items[rec.request_id] = rec
        if not t.active:
            t.active = True
            t.turn = False
            self._active.append(t)

    def remove(self, request_id: str) -> RequestRecord | None:
        """Take a request out wherever it is (client gone, dropped). O(1)."""
        rec = self.by_arrival.pop(request_id, None)
        if rec is not None:
            elsewhere = (self.parked and self.parked.pop(request_id, None) is not None) or (
                self.returns and self.returns.pop(request_id, None) is not None
            )
            if not elsewhere:
                t = self._tenants[rec.tenant]
                del t.items[request_id]
                if not t.items:
                    t.deficit = 0.0  # an emptied tenant keeps no credit (DRR)
            of_model = self.by_model[rec.model]
            del of_model[request_id]
            if not of_model:
                del self.by_model[rec.model]
            if not self.by_arrival:
                self._deadlines.clear()  # all stale: lazy deletion must not pile them up
        return rec

    def park(self, rec: RequestRecord) -> None:
        """Take a queued request out of the round robin (or the returns lane); it stays
        queued (`parked`)."""
        if self.returns.pop(rec.request_id, None) is None:
            t = self._tenants[rec.tenant]
            del t.items[rec.request_id]
            if not t.items:
                t.deficit = 0.0
        self.parked[rec.request_id] = rec

    # -- deficit round robin -----------------------------------------------------------

    def peek(self) -> RequestRecord | None:
        """The request DRR serves next (stable until the queue changes); returns first."""
        if self.returns:
            return next(iter(self.returns.values()))
        active = self._active
        while active:
            t = active[0]
            if not t.items:
                active.popleft()
                t.active = False
                t.turn = False
                t.deficit = 0.0
                continue
            if not t.turn:
                t.deficit += self._quantum * t.weight
                t.turn = True
            head = next(iter(t.items.values()))
            if head.cost <= t.deficit:
                return head
            t.turn = False
            active.rotate(-1)
        return None

    def pop(self) -> RequestRecord | None:
        rec = self.peek()
        if rec is None:
            return None
        if self.returns:
            return self.remove(rec.request_id)
        t = self._active[0]
        t.deficit -= rec.cost
        self.remove(rec.request_id)
        if not t.items:
            self._active.popleft()
            t.active = False
            t.turn = False
        return rec

    def take(self, rec: RequestRecord) -> None:
        """Take `rec` out of its turn (another model's request that may go first): its
        tenant is charged its cost as if DRR had served it, so it waits the longer for its
        next turn."""
        if rec.request_id not in self.parked and rec.request_id not in self.returns:
            self._tenants[rec.tenant].deficit -= rec.cost
        self.remove(rec.request_id)

    # -- deadlines ---------------------------------------------------------------------

    def pop_due(self, now: float, slack: float) -> list[RequestRecord]:
        """Remove and return the requests whose wait is over: queued longer than the class
        timeout minus `slack`, or past their client deadline minus `slack`."""
        due: list[RequestRecord] = []
        cutoff = now + slack - self.policy.timeout  # enqueued at or before this: due
        while self.by_arrival:
            rec = next(iter(self.by_arrival.values()))
            if rec.enqueued_at > cutoff:
                break
            self.remove(rec.request_id)
            due.append(rec)
        heap = self._deadlines
        limit = now + slack
        while heap:
            deadline, _, rid = heap[0]
            if rid not in self.by_arrival:
                heapq.heappop(heap)  # already gone: lazy deletion
                continue
            if deadline > limit:
                break
            heapq.heappop(heap)
            gone = self.remove(rid)
            if gone is not None:
                due.append(gone)
        return due

    def next_due(self, slack: float) -> float | None:
        """When `pop_due` will next have work (None if never)."""
        at: float | None = None
        oldest = self.oldest()
        if oldest is not None:
            at = oldest.enqueued_at + self.policy.timeout - slack
        heap = self._deadlines
        while heap and heap[0][2] not in self.by_arrival:
            heapq.heappop(heap)
        if heap:
            d = heap[0][0] - slack
            at = d if at is None else min(at, d)
        return at

    def is_due(self, rec: RequestRecord, now: float, slack: float) -> bool:
        if now + slack >= rec.enqueued_at + self.policy.timeout:
            return True
        return rec.deadline is not None and now + slack >= rec.deadline

    # -- passing straight through ------------------------------------------------------

    def idle(self) -> bool:
        """Nothing queued and no round-robin turn left over: a lone request pushed now and
        popped at once would leave the queue as it found it, but for the quantum."""
        return not self.by_arrival and not self._active

    def due_at_once(self, rec: RequestRecord, now: float, slack: float) -> bool:
        """A request pushed now would be dropped by the next pass (`pop_due`'s test or
        `is_due`'s) rather than dispatched."""
        return self.is_due(rec, now, slack) or rec.enqueued_at <= now + slack - self.policy.timeout

    def passed(self, rec: RequestRecord) -> None:
        """`rec` was dispatched on arrival without a push and pop: account for it as they
        would have (its cost still raises the DRR quantum)."""
        if rec.cost > self._quantum:
            self._quantum = float(rec.cost)
