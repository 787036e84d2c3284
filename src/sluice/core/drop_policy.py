"""The three drop policies of a class queue, as pure rules (docs/overload.md).

Every policy:
  * a full queue refuses the newcomer: `queue_full` (a queue with maxQueueSize 0 has no
    waiting room: it admits a request only when it can be dispatched at once);
  * a queued request is dropped when it has waited `timeout`, or when its client deadline
    has passed: `queue_timeout`. No request is dispatched after that point.

`tail`: nothing more.

`early-drop-on-pressure`: as `tail`, and
  * at arrival, when pressure >= pressure.shedAbove, a newcomer whose predicted wait
    (the class queue's drain time, see `retry_after`) exceeds its patience -- the smaller
    of the class timeout and the time left to its client deadline -- is refused at once:
    `shed_on_pressure`;
  * in the queue, a request is dropped as soon as its client will not wait for it: when
    now + expected TTFT reaches the end of its patience (its first token could not come
    in time): `queue_timeout`. This is the deadline rule above moved earlier by the
    expected time to first token (the "slack"), acting on the head of the queue by sojourn
    time, CoDel-like, instead of serving a request whose client has given up.

`fast-reject`: as `tail`, and at arrival, when pressure >= pressure.fastRejectAbove, the
newcomer is refused at once: `fast_reject`. Below the threshold it queues.
"""

from __future__ import annotations

from sluice.core.settings import DropPolicy, PressureSettings, QueueSettings
from sluice.core.types import RejectCode


def admission_code(
    policy: QueueSettings,
    thresholds: PressureSettings,
    *,
    queued: int,
    can_dispatch_now: bool,
    pressure: float,
    predicted_wait_s: float,
    patience_s: float,
) -> RejectCode | None:
    """Why a newcomer is refused, or None when it may queue."""
    if queued >= policy.max_queue_size and not (queued == 0 and can_dispatch_now):
        return RejectCode.QUEUE_FULL
    if policy.drop_policy is DropPolicy.FAST_REJECT:
        if pressure >= thresholds.fast_reject_above:
            return RejectCode.FAST_REJECT
    elif (
        policy.drop_policy is DropPolicy.EARLY_DROP_ON_PRESSURE
        and pressure >= thresholds.shed_above
        and predicted_wait_s > patience_s
    ):
        return RejectCode.SHED_ON_PRESSURE
    return None


def head_slack(policy: QueueSettings, expected_ttft_s: float) -> float:
    """How much earlier than its deadline a queued request is dropped."""
    if policy.drop_policy is DropPolicy.EARLY_DROP_ON_PRESSURE:
        return expected_ttft_s
    return 0.0
