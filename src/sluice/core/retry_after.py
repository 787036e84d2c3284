"""The class rates the controller measures, and the `drain` Retry-After rule (the rule
before return slots: `retryAfter.rule: drain`; the default `booking` rule is in
return_slots.py, and reads its rates from here too).

Rates are time-decayed EWMAs (`DecayingRate`, time constant tau_s), per class: mu_c,
requests dispatched per second, and lambda_c, attempts arriving per second (admitted or
refused: the demand that competes for room when room appears).

A refusal in class c says how far its queue must drain before a newcomer is accepted
(the "excess", at least 1 request; `refusal_excess`): queue_full: queued - maxQueueSize +
1; shed_on_pressure and queue_timeout: queued - patience * mu_c; fast_reject: all queued
- the backlog at which pressure falls below fastRejectAbove. Room appears as fast as the
class and the classes above it drain, net of what keeps arriving in them:

    A = c and the classes above it;  net = mu_A - lambda_A
    nothing dispatched at all (sum of all mu < min_rate):  t = timeout_c
    net > 0:                                                 t = excess / net
    net <= 0 (demand above what is served: no room will appear until it falls):
                                                             t = max_s
    t = clamp(t, min_s, max_s)     (defaults 0.1 s and 60 s)

With no competing arrivals this is the class queue's drain time, position over dispatch
rate; a class not served at all (mu_c = 0) drains when the classes above do, which the
sum over A captures. Under overload the answer is long on purpose: a client told to come
back while demand still exceeds capacity would only be refused again.

The predicted wait of an admitted newcomer (for early-drop-on-pressure) is different:
later arrivals of its class do not overtake it, so it is position / mu_c, or, for a class
not being served, (queued above + position) / sum of all mu; inf when nothing moves. It
is used only once the estimator is warm (dispatches observed for at least tau_s), so a
cold gateway does not shed on rates it has not measured.

For return slots the estimator also keeps, per class, the dispatches of returns (requests
that came back in their booked slot), the fresh (not returning) arrivals, and their usual
level (`usual_arrival_rate`).

The shell sends `Retry-After: clamp(ceil(t), 1, 60)` and `retry-after-ms: round(t*1000)`
(gateway/errors.py). Tenant quotas compute their own value from the quota window.

Within the client's deadline (X-Request-Timeout / X-Stainless-Timeout). `Retry-After` is
whole seconds and at least 1 (HTTP delay-seconds), so a refusal can point the
client back within its deadline only when at least `MIN_RETRY_AFTER_S` of it is left and
its delay fits in what is left; otherwise it is answered `cannot_serve_in_time`
(`deadline_code`), and the client is not told to come back.
"""

from __future__ import annotations

import math

from sluice.core.ewma import DecayingRate
from sluice.core.types import RejectCode

# The smallest Retry-After the header can say (whole seconds, at least 1).
MIN_RETRY_AFTER_S = 1.0


def deadline_code(
    code: RejectCode, retry_after_s: float, now: float, deadline: float | None
) -> RejectCode:
    """The code a refusal is answered with: `code`, or `cannot_serve_in_time` when the
    client's deadline (None: it sent none) leaves no room for its Retry-After: less than
    the 1 s the header can say is left, or the delay goes past it."""
    if deadline is None:
        return code
    if no_retry_fits(now, deadline) or retry_after_s > deadline - now:
        return RejectCode.CANNOT_SERVE_IN_TIME
    return code


def no_retry_fits(now: float, deadline: float) -> bool:
    """Less than the 1 s a Retry-After can say is left before the client's deadline: no
    refusal can point it back in time."""
    return deadline - now < MIN_RETRY_AFTER_S


def refusal_excess(
    code: RejectCode | None,
    *,
    queued: int,
    max_queue_size: int,
    patience_s: float,
    class_rate: float,
    queued_total: int,
    limit_total: int,
    fast_reject_above: float,
) -> float:
    """How many requests the queue must lose before a newcomer refused for `code` would be
    accepted (at least 1)."""
    excess: float
    if code is RejectCode.QUEUE_FULL:
        excess = float(queued - max_queue_size + 1)
    elif code is RejectCode.FAST_REJECT:
        # pressure = 0.5 * use + 0.5 * backlog: with every slot in use it falls below the
        # threshold once the backlog is under (2 * threshold - 1) of the limits
        excess = queued_total - max(0.0, 2.0 * fast_reject_above - 1.0) * limit_total
    elif code in (RejectCode.SHED_ON_PRESSURE, RejectCode.QUEUE_TIMEOUT):
        # accepted again once what is ahead drains within its patience
        excess = queued - max(0.0, patience_s) * class_rate
    else:
        excess = float(queued)
    return max(1.0, excess)


class DrainEstimator:
    def __init__(
        self,
        priorities: int = 3,
        *,
        tau_s: float = 2.0,
        min_rate: float = 1.0 / 60.0,
        min_s: float = 0.1,
        max_s: float = 60.0,
        slow_tau_s: float = 30.0,
    ) -> None:
        self._rates = [DecayingRate(tau_s) for _ in range(priorities)]
        self._arrivals = [DecayingRate(tau_s) for _ in range(priorities)]
        # for return slots (return_slots.py): dispatches of returns, fresh (not returning)
        # arrivals, and their usual level
        self._returns = [DecayingRate(tau_s) for _ in range(priorities)]
        self._fresh = [DecayingRate(tau_s) for _ in range(priorities)]
        self._usual: list[float | None] = [None] * priorities
        self._usual_at = [-math.inf] * priorities
        self._first_arrival_at: float | None = None
        self._burst_since: list[float | None] = [None] * priorities
        self.tau_s = tau_s
        self.slow_tau_s = slow_tau_s
        self.min_rate = min_rate
        self.min_s = min_s
        self.max_s = max_s
        self._first_at: float | None = None

    def record_dispatch(self, priority: int, now: float, returning: bool = False) -> None:
        if self._first_at is None:
            self._first_at = now
        self._rates[priority].record(now)
        if returning:
            self._returns[priority].record(now)

    def record_arrival(self, priority: int, now: float, returning: bool = False) -> None:
        self._arrivals[priority].record(now)
        if not returning:
            self._fresh[priority].record(now)
            self._update_usual(priority, now)

    def fresh_arrival_rate(self, priority: int, now: float) -> float:
        """Attempts per second that were not returns in a booked slot."""
        return self._fresh[priority].rate(now)

    def usual_arrival_rate(self, priority: int, now: float) -> float | None:
        """The class's usual fresh demand: a slow average of `fresh_arrival_rate` that
        follows it with a time constant of `slow_tau_s` while it stays within 1.5 x its
        level, and 10 x slower above (a burst does not become the usual); None until the
        rates have been observed for `tau_s`."""
        self._update_usual(priority, now)
        return self._usual[priority]

    def _update_usual(self, priority: int, now: float) -> None:
        dt = now - self._usual_at[priority]
        if dt < 0.5:
            return
        self._usual_at[priority] = now
        fast = self._fresh[priority].rate(now)
        usual = self._usual[priority]
        if usual is None:
            if self._first_arrival_at is None:
                self._first_arrival_at = now
            elif now - self._first_arrival_at >= self.tau_s:
                self._usual[priority] = fast
            return
        burst = fast > 1.5 * usual
        if burst and self._burst_since[priority] is None:
            self._burst_since[priority] = now
        elif fast < 1.2 * usual:
            self._burst_since[priority] = None
        tau = 10.0 * self.slow_tau_s if burst else self.slow_tau_s
        self._usual[priority] = usual + (1.0 - math.exp(-dt / tau)) * (fast - usual)

    def burst_age(self, priority: int, now: float) -> float | None:
        """How long the class's fresh demand has been above 1.5 x its usual level (until it
        falls below 1.2 x); None when it is not."""
        since = self._burst_since[priority]
        return None if since is None else now - since

    def warm(self, now: float) -> bool:
        """Dispatches have been observed for at least tau_s: the rates mean something."""
        return self._first_at is not None and now - self._first_at >= self.tau_s

    def rate(self, priority: int, now: float) -> float:
        return self._rates[priority].rate(now)

    def arrival_rate(self, priority: int, now: float) -> float:
        return self._arrivals[priority].rate(now)

    def return_rate(self, priority: int, now: float) -> float:
        """Dispatches of requests that came back in a booked slot, per second."""
        return self._returns[priority].rate(now)

    def wait_estimate(self, priority: int, now: float, *, ahead: int, queued_above: int) -> float:
        """Predicted wait of an admitted newcomer with `ahead` requests before it in its
        class; inf when nothing is being dispatched at all."""
        rate = self._rates[priority].rate(now)
        if rate >= self.min_rate:
            return ahead / rate
        total = sum(r.rate(now) for r in self._rates)
        if total >= self.min_rate:
            return (queued_above + ahead) / total
        return math.inf

    def retry_after(self, priority: int, now: float, *, excess: float, timeout_s: float) -> float:
        """Retry-After in seconds (the rule in the module docstring)."""
        mu = lam = total = 0.0
        for p, (d, a) in enumerate(zip(self._rates, self._arrivals, strict=True)):
            r = d.rate(now)
            total += r
            if p <= priority:
                mu += r
                lam += a.rate(now)
        if total < self.min_rate:
            t = timeout_s
        elif mu - lam > 0:
            t = excess / (mu - lam)
        else:
            t = self.max_s
        return min(self.max_s, max(self.min_s, t))
