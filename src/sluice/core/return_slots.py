"""Return slots: a refused request is told to come back when its class is forecast to have
room for it, and that room is booked for it, so that refused clients come back once, spread
out, when there is room (docs/overload.md, "Retry-After").

The forecast. Per class c the controller gives a room rate rho_c: requests per second the
class will be able to start, given what the classes above it take (`Controller` computes
it from the dispatch rates it measures). Time ahead is cut into bins of `bin_s` up to
`horizon_s`. In a bin, the bookings of the classes above take their share of rho_c first
(they are dispatched first); the class's own bookings are laid end to end on a virtual
clock V_c: a new booking starts where the previous one ended, or once the queue ahead of
it has drained (`ahead` / rho_c), and takes one unit of room. Its slot is the time that
unit is complete; its window (the span of one unit, at least a bin, at most 1 s) is how
far after the slot the client should spread its return. Consecutive slots of a class are
1 / rho_c apart, so returns arrive evenly at the rate the class can take them.

Those who do not come back. A booking not claimed by `slot + window + late_s` expires. The
show rate per class (an EWMA over bookings claimed or expired) weights what a booking
takes: when half the refused clients never return, each booking takes half a unit, so
the room is still filled by those who do (never less than `min_weight`).

A forecast that was too low (a burst above ended sooner) leaves room between the returns
booked at the slower pace: fresh arrivals take it, and new bookings go on from V_c at the
new pace (V_c never moves back: returns stay in the order they were refused). A forecast
that was too high leaves bookings denser than the room: those returns wait in their class
queue (ahead of fresh arrivals), within the class timeout; the queue absorbs forecast
errors that are shorter than it.

Everything is a pure function of the calls (time comes in as `now`).
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from dataclasses import dataclass
from typing import NamedTuple


@dataclass(slots=True)
class Booking:
    id: str
    priority: int
    tenant: str
    made: float  # when the refusal booked it (core clock)
    slot: float  # when its room is forecast (core clock): where it is booked
    due: float  # when the client is told to come back: the slot less the lead
    window: float  # it may come back up to this long after `due` (its jitter)
    weight: float  # the room it takes (the show rate when booked)
    expires: float


class Claim(NamedTuple):
    """A request recognised as a return in its slot; `made`: when its refusal booked it
    (None for a booking of another replica, known only by its token)."""

    made: float | None


class Offer(NamedTuple):
    """The answer to `ReturnLedger.offer`: `slot` None = no room forecast within the
    horizon; `booking` None with a slot = the slot is past the client's deadline, or a
    quote (nothing was booked); `due`: when its client would be told to come back."""

    slot: float | None
    booking: Booking | None
    due: float | None = None


class ReturnLedger:
    def __init__(
        self,
        priorities: int = 3,
        *,
        bin_s: float = 0.1,
        horizon_s: float = 60.0,
        early_s: float = 0.25,
        late_s: float = 5.0,
        max_window_s: float = 1.0,
        window_share: float = 0.5,
        show_alpha: float = 0.05,
        min_weight: float = 0.5,
        min_due_s: float = 0.1,
        due_bin_s: float = 0.01,
        peak_s: float = 0.1,
        return_share: float = 1.0,
        id_prefix: str = "",
    ) -> None:
        if bin_s <= 0 or horizon_s <= 0:
            raise ValueError("bin_s and horizon_s must be positive")
        self.bin_s = bin_s
        self.horizon_s = horizon_s
        self.early_s = early_s
        self.late_s = late_s
        self.max_window_s = max_window_s
        self.window_share = window_share
        self.show_alpha = show_alpha
        self.min_weight = min_weight
        self.min_due_s = min_due_s
        self.due_bin_s = due_bin_s
        self.peak_s = peak_s
        self.return_share = return_share
        self._prefix = id_prefix
        self._n = priorities
        # bins[i][p]: the room class p's bookings take in bin (base + i)
        self._bins: deque[list[float]] = deque()
        self._base = 0
        self._bookings: dict[str, Booking] = {}
        # returns due (all classes) per due_bin_s bin, for _quiet_from
        self._dues: dict[int, int] = {}
        self._dues_from = 0
        self._expiry: list[tuple[float, str]] = []
        self._v = [0.0] * priorities  # where each class's bookings end
        self._last_due = [0.0] * priorities
        self._show = [1.0] * priorities
        self._outstanding = [0] * priorities
        self._seq = 0
        self.claimed = [0] * priorities
        self.expired = [0] * priorities

    # -- reading ----------------------------------------------------------------------

    def outstanding(self, priority: int) -> int:
        """Bookings not yet claimed nor expired."""
        return self._outstanding[priority]

    def show_rate(self, priority: int) -> float:
        return self._show[priority]

    def booked_until(self, priority: int, now: float) -> float:
        """How far ahead the class's room is booked (0 when it is not)."""
        return max(0.0, self._v[priority] - now)

    # -- booking ----------------------------------------------------------------------

    def _weight(self, priority: int) -> float:
        return max(self.min_weight, self._show[priority])

    def offer(
        self,
        priority: int,
        now: float,
        *,
        rate: float,
        ahead: float,
        tenant: str,
        not_after: float | None = None,
        lead_s: float = 0.0,
        excess: float = 0.0,
        decay_s: float = 1.0,
        capacity: float = 0.0,
        book: bool = True,
    ) -> Offer:
        """The earliest slot with room for one more request of the class, booked unless it
        is past `not_after` (the client's deadline) or `book` is False (a quote: what a
        refusal would be told now). The class's room, in requests per second, tau seconds
        ahead: `rate - excess * exp(-tau / decay_s)` (the classes above take `excess` more
        than their long-run share now, a burst expected to pass); `ahead`:
        requests that go before it (the queues of the class and those above); `lead_s`:
        how much earlier than its slot the client is told to come back (it waits in the
        queue, ahead of fresh arrivals, for at most that long if the forecast holds);
        `capacity`: requests per second the gateway starts in all (returns of all classes
        are told to come back no faster than that: a bin that has its share of returns
        due pushes the next one to a later bin)."""
        if book:
            self.expire(now)
        horizon_end = now + self.horizon_s + lead_s
        if rate <= 0.0:
            return Offer(None, None)
        t = max(self._v[priority], now + self._drain_time(ahead, rate, excess, decay_s))
        if t >= horizon_end:
            return Offer(None, None)
        weight = self._weight(priority)
        need = weight
        w = self.bin_s
        i = math.floor(t / w)
        taken: list[tuple[int, float]] = []  # (bin, room) the unit takes, bin by bin
        while True:
            end = (i + 1) * w
            k = i - self._base
            above = 0.0
            if 0 <= k < len(self._bins):
                row = self._bins[k]
                for p in range(priority):
                    above += row[p]
            density = rate - above / w
            if excess:
                density -= excess * math.exp((now - 0.5 * (t + end)) / decay_s)
            if density > 0.0 and end > t:
                dt = need / density
                if t + dt <= end:
                    t += dt
                    taken.append((i, need))
                    break
                taken.append((i, density * (end - t)))
                need -= density * (end - t)
            # by bin index, not from t: floor(t / w) of a bin's end can be the same bin
            i += 1
            t = max(t, end)
            if t >= horizon_end:
                return Offer(None, None)
        slot = t
        spacing = weight / max(rate - excess * math.exp((now - slot) / decay_s), 0.1 * rate)
        # told to come back `lead_s` early, but never before the class's last return plus
        # one spacing: the returns stay spread even where the lead runs into the present
        due = max(now + self.min_due_s, slot - lead_s, self._last_due[priority] + spacing)
        due = min(due, slot)
        window = min(self.max_window_s, self.window_share * spacing)
        if capacity > 0.0:
            due = self._quiet_from(due, capacity, window)
        if due > now + self.horizon_s:
            return Offer(None, None)
        if not book or (not_after is not None and slot > not_after):
            return Offer(slot, None, due)
        self._v[priority] = slot
        self._last_due[priority] = due
        self._seq += 1
        booking = Booking(
            id=f"{self._prefix}{self._seq}",
            priority=priority,
            tenant=tenant,
            made=now,
            slot=slot,
            due=due,
            window=window,
            weight=weight,
            expires=due + window + self.late_s,
        )
        for i, room in taken:
            self._bin(i)[priority] += room
        k = self._due_bin(due)
        self._dues[k] = self._dues.get(k, 0) + 1
        self._bookings[booking.id] = booking
        heapq.heappush(self._expiry, (booking.expires, booking.id))
        self._outstanding[priority] += 1
        return Offer(slot, booking, due)

    @staticmethod
    def _drain_time(ahead: float, rate: float, excess: float, decay_s: float) -> float:
        """How long `ahead` requests take at the room forecast (the integral of
        rate - excess * exp(-tau / decay_s) reaching `ahead`), by bisection."""
        if ahead <= 0.0:
            return 0.0
        if not excess:
            return ahead / rate

        def served(tau: float) -> float:
            return rate * tau - excess * decay_s * (1.0 - math.exp(-tau / decay_s))

        lo, hi = 0.0, ahead / rate + excess * decay_s / rate + 1.0
        for _ in range(40):
            mid = 0.5 * (lo + hi)
            if served(mid) < ahead:
                lo = mid
            else:
                hi = mid
        return hi

    def _due_bin(self, t: float) -> int:
        """The due bin of time t; a bin's own start (i * w in floating point, which can fall
        a hair short of i) is in bin i, as `_quiet_from` places it."""
        return math.floor(t / self.due_bin_s + 1e-9)

    def _quiet_from(self, t: float, capacity: float, window: float) -> float:
        """The first time from t whose neighbourhood has fewer returns due, of all classes,
        than `return_share` x `capacity` allows per `peak_s`: returns of different classes,
        each spread at its own pace, are not told to come back together either. A client
        comes back within `window` after its due time, so any `peak_s` of returns can hold
        the dues of `peak_s + window`: that is the span counted."""
        w = self.due_bin_s
        per_window = max(1.0, self.return_share * capacity * self.peak_s)
        # bins a span of peak_s + window can touch (one more than it covers: it need not
        # start on a bin's edge)
        span = max(1, math.ceil((self.peak_s + window) / w - 1e-9)) + 1
        dues = self._dues
        i = self._due_bin(t)
        limit = i + round(self.horizon_s / w)
        while i < limit:
            counts = [dues.get(j, 0) for j in range(i - span + 1, i + span)]
            # every window of `span` bins that would hold bin i stays under the cap
            if all(sum(counts[j : j + span]) + 1 <= per_window for j in range(span)):
                return max(t, i * w)
            i += 1
        return t

    def _bin(self, i: int) -> list[float]:
        bins = self._bins
        if not bins:
            self._base = i
        elif i < self._base:  # cannot happen for slots ahead of now; be safe
            for _ in range(self._base - i):
                bins.appendleft([0.0] * self._n)
            self._base = i
        while i - self._base >= len(bins):
            bins.append([0.0] * self._n)
        return bins[i - self._base]

    # -- returns ----------------------------------------------------------------------

    def claim(
        self,
        booking_id: str,
        *,
        tenant: str,
        priority: int,
        now: float,
        slot: float | None = None,
    ) -> Claim | None:
        """A request comes back with a booking: a Claim when it is a return in its slot
        (its booking is used up), else None. `slot`: the due time a verified token
        states, for a booking made by another replica (not in this ledger). Too early:
        not a return, and the booking stays for the real one; too late or unknown: not a
        return."""
        self.expire(now)
        b = self._bookings.get(booking_id)
        if b is None:
            if (
                slot is not None
                and slot - self.early_s <= now <= slot + self.max_window_s + self.late_s
            ):
                return Claim(None)
            return None
        if b.tenant != tenant or b.priority != priority or now < b.due - self.early_s:
            return None
        del self._bookings[booking_id]
        self._settle(b, shown=True)
        return Claim(b.made)

    def expire(self, now: float) -> None:
        """Bookings whose return is overdue are no-shows; bins in the past are dropped."""
        heap = self._expiry
        while heap and heap[0][0] < now:
            _, bid = heapq.heappop(heap)
            b = self._bookings.pop(bid, None)
            if b is not None:
                self._settle(b, shown=False)
        old = math.floor(now / self.due_bin_s) - 10
        dues = self._dues
        if dues and old - self._dues_from > 500:
            for k in [k for k in dues if k < old]:
                del dues[k]
            self._dues_from = old
        first = math.floor(now / self.bin_s) - 1
        bins = self._bins
        while bins and self._base < first:
            bins.popleft()
            self._base += 1

    def _settle(self, b: Booking, *, shown: bool) -> None:
        p = b.priority
        self._outstanding[p] -= 1
        self._show[p] += self.show_alpha * ((1.0 if shown else 0.0) - self._show[p])
        if shown:
            self.claimed[p] += 1
        else:
            self.expired[p] += 1
