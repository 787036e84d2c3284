"""`gie` and `gie-flow`: the Gateway API Inference Extension's endpoint picker (EPP), as
llm-d ships it, in front of the backends.

Read from llm-d/llm-d-inference-scheduler @520af47 (`gaie-1.5-sync`, the EPP now lives
there; kubernetes-sigs/gateway-api-inference-extension v1.5.0 has the same detector):
* `pkg/epp/framework/plugins/flowcontrol/saturationdetector/utilization/{config,detector}.go`:
  the default saturation detector. Per endpoint
  `score = max(waiting / queueDepthThreshold, kvUsage / kvCacheUtilThreshold)`, an endpoint
  whose metrics are older than `metricsStalenessThreshold` (or missing) scoring 1.0; the
  pool's saturation is the mean score. Defaults 5, 0.8, 200 ms. (So one endpoint is
  saturated when waiting >= 5 or KV usage >= 0.8.)
* `pkg/epp/requestcontrol/admission.go`: without flow control
  (`LegacyAdmissionController`, the default: flow control is a feature gate), a
  sheddable request (priority < 0, `pkg/epp/util/request/sheddable.go`) is refused when
  saturation >= 1.0 (`ResourceExhausted`: 429, `pkg/common/error/error.go`; no
  Retry-After); every other request is admitted, with no limit of its own.
* `pkg/epp/flowcontrol/controller/internal/processor.go`: with flow control every request
  is queued in its priority band; a dispatch cycle runs on each arrival and on a 1 ms
  ticker and sends at most one request: the bands from the highest priority, and at the
  first band whose usage limit the saturation reaches (the static usage-limit policy: 1.0,
  `framework/plugins/flowcontrol/usagelimits`) the cycle stops (head-of-line blocking: no
  lower band goes either). Within a band FCFS (`DefaultOrderingPolicyRef` fcfs,
  `DefaultFairnessPolicyRef` global-strict: the oldest head across the band's flows,
  `pkg/epp/flowcontrol/registry/config.go`). `FlowControlAdmissionController` no longer
  sheds on arrival. A queued request leaves at its TTL (`DefaultRequestTTL`; 0 by default:
  the client's own deadline) as `EvictedTTL`: 503.
* `pkg/epp/config/loader/defaults.go`: the default scheduling profile scores endpoints
  with queue-scorer (weight 2: `(maxQ - q) / (maxQ - minQ)`, 1 when all equal),
  kv-cache-utilization-scorer (weight 2: `1 - kvUsage`) and prefix-cache-scorer (weight 3;
  the bench's prompts share no prefix, so it adds the same to every endpoint) and takes
  the highest score (max-score-picker, ties at random).
* `pkg/epp/server/options.go`: metrics are refreshed every 50 ms.

Priorities: P0 -> 1, P1 -> 0, P2 -> -1 (sheddable), as a platform team would give its
interactive, agent and batch objectives.
"""

from __future__ import annotations

import math
from collections import deque

from sluice.bench.peers.base import PeerAdmission, PeerCode, PeerGateway, PeerRejection
from sluice.bench.workload import unit_hash
from sluice.core.clock import Clock
from sluice.core.types import Assignment, RequestInfo

QUEUE_DEPTH_THRESHOLD = 5
KV_CACHE_UTIL_THRESHOLD = 0.8
METRICS_STALENESS_S = 0.2
REFRESH_METRICS_INTERVAL_S = 0.05
DISPATCH_TICK_S = 0.001
QUEUE_SCORER_WEIGHT = 2.0
KV_SCORER_WEIGHT = 2.0
GIE_PRIORITY = {0: 1, 1: 0, 2: -1}  # Sluice class -> InferenceObjective priority


class GieGateway(PeerGateway):
    """`flow_control=False`: the default EPP (legacy admission); True: its flow control."""

    scrape_interval_s = REFRESH_METRICS_INTERVAL_S

    def __init__(
        self,
        clock: Clock,
        backends: list[str],
        *,
        flow_control: bool = False,
        ttl_s: float | None = None,
        queue_depth_threshold: int = QUEUE_DEPTH_THRESHOLD,
        kv_threshold: float = KV_CACHE_UTIL_THRESHOLD,
        staleness_s: float = METRICS_STALENESS_S,
    ) -> None:
        super().__init__(clock, backends)
        self.name = "gie-flow" if flow_control else "gie"
        self.flow_control = flow_control
        self.ttl_s = ttl_s
        self.queue_depth_threshold = queue_depth_threshold
        self.kv_threshold = kv_threshold
        self.staleness_s = staleness_s
        # flow control: one FCFS queue per band, highest priority first
        self._bands: dict[int, deque[tuple[str, float, int]]] = {
            p: deque() for p in sorted(set(GIE_PRIORITY.values()), reverse=True)
        }
        self._class_of: dict[str, int] = {}
        self._credits = 0  # dispatch cycles owed to arrivals
        self._last_tick = -math.inf
        self._n = 0

    # -- the saturation detector ---------------------------------------------------------

    def _score(self, b: str, now: float) -> float:
        m = self.metrics[b]
        if m is None or now - m.at > self.staleness_s:
            return 1.0
        q = (m.waiting or 0.0) / self.queue_depth_threshold
        kv = (m.kv_usage or 0.0) / self.kv_threshold
        return max(q, kv)

    def saturation(self) -> float:
        up = self._up()
        if not up:
            return 1.0
        now = self._clock.now()
        return sum(self._score(b, now) for b in up) / len(up)

    # -- the scheduler -------------------------------------------------------------------

    def _pick(self, request_id: str) -> str | None:
        up = self._up()
        if not up:
            return None
        waiting = {b: (m.waiting or 0.0) if (m := self.metrics[b]) else 0.0 for b in up}
        lo, hi = min(waiting.values()), max(waiting.values())

        def score(b: str) -> float:
            q = 1.0 if hi == lo else (hi - waiting[b]) / (hi - lo)
            m = self.metrics[b]
            kv = 1.0 - ((m.kv_usage or 0.0) if m else 0.0)
            return QUEUE_SCORER_WEIGHT * q + KV_SCORER_WEIGHT * kv

        best = max(score(b) for b in up)
        tied = [b for b in up if score(b) >= best - 1e-12]
        self._n += 1
        return tied[int(unit_hash(11, self._n) * len(tied))]

    # -- the harness's calls -------------------------------------------------------------

    def queued(self) -> list[int]:
        out = [0, 0, 0]
        for band in self._bands.values():
            for rid, _, _ in band:
                out[self._class_of[rid]] += 1
        return out

    def arrive(self, info: RequestInfo) -> PeerAdmission:
        prio = GIE_PRIORITY[info.priority]
        if not self.flow_control:
            if prio < 0 and self.saturation() >= 1.0:
                return PeerAdmission(False, PeerCode.GIE_SHED, None)
            b = self._pick(info.request_id)
            if b is None:
                return PeerAdmission(False, PeerCode.GIE_SHED, None)
            self._send(info.request_id, b)
            return PeerAdmission(True)
        now = self._clock.now()
        self._class_of[info.request_id] = info.priority
        self._bands[prio].append((info.request_id, now, info.priority))
        self._credits += 1  # "process immediately when an item arrives"
        return PeerAdmission(True)

    def _dispatch(self) -> list[Assignment]:
        if self.flow_control:
            self._cycles(self._clock.now())
        return super()._dispatch()

    def _cycles(self, now: float) -> None:
        # one cycle per arrival since the last call, and one for the ticker when a tick
        # has passed (the harness wakes this up at each tick while there is work)
        cycles = self._credits
        self._credits = 0
        if now >= self._last_tick + DISPATCH_TICK_S:
            self._last_tick = now
            cycles += 1
        for _ in range(cycles):
            if not self._cycle(now):
                break

    def _cycle(self, now: float) -> bool:
        """One dispatch cycle: at most one request out (processor.go `dispatchCycle`)."""
        saturation = self.saturation()
        for band in self._bands.values():
            if saturation >= 1.0:
                return False  # head-of-line blocking across bands
            if not band:
                continue
            b = self._pick(band[0][0])
            if b is None:
                return False  # no healthy endpoint: it stays queued
            rid, queued_at, _ = band.popleft()
            self._class_of.pop(rid, None)
            self._send(rid, b, now - queued_at)
            return True
        return False

    def _next_wakeup(self) -> float | None:
        if not self.flow_control:
            return None
        nxt: float | None = None
        if any(self._bands.values()) and self.saturation() < 1.0:
            nxt = max(self._clock.now(), self._last_tick + DISPATCH_TICK_S)
        if self.ttl_s is not None:
            heads = [band[0][1] + self.ttl_s for band in self._bands.values() if band]
            if heads:
                t = min(heads)
                nxt = t if nxt is None else min(nxt, t)
        return nxt

    def _expire(self) -> list[PeerRejection]:
        if self.ttl_s is None:
            return []
        now = self._clock.now()
        out: list[PeerRejection] = []
        for band in self._bands.values():
            while band and band[0][1] + self.ttl_s <= now:
                rid, _, _ = band.popleft()
                self._class_of.pop(rid, None)
                out.append(PeerRejection(rid, PeerCode.GIE_TTL))
        return out

    def cancel(self, request_id: str) -> None:
        if self._class_of.pop(request_id, None) is not None:
            for band in self._bands.values():
                for i, item in enumerate(band):
                    if item[0] == request_id:
                        del band[i]
                        break
        super().cancel(request_id)
