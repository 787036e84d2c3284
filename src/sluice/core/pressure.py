"""Pressure: one number in [0, 1] saying how overloaded the gateway is.

    pressure = 0.5 * U + 0.5 * max(D, Q, B)

  U  limit use: requests in flight / sum of the limits of the healthy backends (1 when
     there is no healthy backend), capped at 1. Full use alone gives 0.5: saturated but
     keeping up.
  D  queue delay: the largest, over the classes, of the oldest queued request's sojourn
     divided by its class timeout, capped at 1.
  Q  backlog: requests queued / sum of the limits, capped at 1 (one full round of the
     backends waiting gives 1).
  B  backend congestion: the mean, over backends with fresh metrics, of
     max(1 if waiting > 0 else 0, (kv_usage - KV_CONGESTED_FROM) / (KV_CONGESTED_AT -
     KV_CONGESTED_FROM) clamped to [0, 1]); 0 when no backend has fresh metrics. (The
     limiter's own KV thresholds, its cut and growth guards, are separate rules:
     core/limiters/latency_feedback.py `kv_high`/`kv_low`.)

So 0 = idle, 0.5 = every slot in use and nothing waiting, 1 = every slot in use and a full
round of the backends queued (or a timeout's worth of waiting, or every backend congested).
The defaults: early-drop queues start predicting waits at 0.5 (shedAbove), fast-reject
queues refuse at 0.8 (fastRejectAbove).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)  # made on every arrival: not frozen (5x cheaper)
class PressureInputs:
    inflight: int
    limit_total: int  # sum of the limits of the healthy backends
    queued: int
    max_sojourn_ratio: float  # max over classes of head sojourn / class timeout
    backend_congestion: float  # mean of `backend_congestion` over fresh backends


# KV usage at which a backend starts to count as congested, and where it counts fully.
KV_CONGESTED_FROM = 0.85
KV_CONGESTED_AT = 0.95


def backend_congestion(kv_usage: float | None, waiting: float | None) -> float:
    """One backend's congestion in [0, 1] from its last scrape."""
    c = 1.0 if waiting is not None and waiting > 0 else 0.0
    if kv_usage is not None:
        ramp = (kv_usage - KV_CONGESTED_FROM) / (KV_CONGESTED_AT - KV_CONGESTED_FROM)
        c = max(c, min(1.0, max(0.0, ramp)))
    return c


def compute_pressure(p: PressureInputs) -> float:
    if p.limit_total <= 0:
        use = 1.0
        backlog = 1.0 if p.queued else 0.0
    else:
        use = min(1.0, p.inflight / p.limit_total)
        backlog = min(1.0, p.queued / p.limit_total)
    delay = min(1.0, max(0.0, p.max_sojourn_ratio))
    congestion = min(1.0, max(0.0, p.backend_congestion))
    return 0.5 * use + 0.5 * max(delay, backlog, congestion)
