"""`envoy`: Envoy's adaptive concurrency filter (gradient controller) in front of the
backends, one limit for the whole cluster, round robin to its hosts.

Read from envoyproxy/envoy (the stored versions cited):
* `source/extensions/filters/http/adaptive_concurrency/controller/gradient_controller.cc`
  @c35f67f: every `concurrency_update_interval` the latencies sampled in the window are
  summarised at `sample_aggregate_percentile` (sampleRTT) and
  `gradient = clamp((minRTT + minRTT * buffer) / sampleRTT, 0.5, 2.0)`,
  `limit = clamp(limit * gradient + sqrt(limit * gradient), min_concurrency, max)`
  (truncated to an integer); a window with no sample leaves the limit alone. minRTT is
  measured by pinning the limit to `min_concurrency` until `request_count` samples of
  requests sent after the window opened have arrived; their percentile is the new minRTT
  and the limit goes back to what it was. The next measurement starts `interval` later
  plus a jitter of up to `jitter` of it, or at once after the limit has been set to the
  minimum on 5 windows in a row. The limit starts at `min_concurrency`, in a measurement.
  A request is forwarded while outstanding < limit, else refused (`forwardingDecision`).
* `adaptive_concurrency_filter.cc` @074708e: the refusal is an immediate local reply,
  503, with no Retry-After; a request's latency runs from its headers to the end of the
  response (`encodeComplete`: the last token of a stream); a request that ends without
  completing its response (client gone, upstream reset) gives no sample.
* `api/envoy/extensions/filters/http/adaptive_concurrency/v3/adaptive_concurrency.proto`
  @149521d: defaults p50, `min_concurrency` 3, `buffer` 25 %, `request_count` 50,
  `jitter` 15 %, `max_concurrency_limit` 1000, status 503; `concurrency_update_interval`
  and `interval` have no default (required). We use those of the filter's documentation
  example (docs/root/configuration/http/http_filters/adaptive_concurrency_filter.rst
  @149521d): 100 ms and 60 s. `min_concurrency_limit` is left unset, so the minRTT
  measurement pins the limit (the historical behaviour).
"""

from __future__ import annotations

import math
import random

from sluice.bench.peers.base import PeerAdmission, PeerCode, PeerGateway
from sluice.core.clock import Clock
from sluice.core.types import Assignment, Outcome, RequestInfo

UPDATE_INTERVAL_S = 0.1
MIN_RTT_INTERVAL_S = 60.0


def _percentile(values: list[float], q: float) -> float:
    """Linear interpolation between closest ranks (as a histogram's approximate quantile)."""
    s = sorted(values)
    if len(s) == 1:
        return s[0]
    pos = q * (len(s) - 1)
    lo = math.floor(pos)
    hi = min(len(s) - 1, lo + 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


class EnvoyGateway(PeerGateway):
    name = "envoy"

    def __init__(
        self,
        clock: Clock,
        backends: list[str],
        *,
        update_interval_s: float = UPDATE_INTERVAL_S,
        min_rtt_interval_s: float = MIN_RTT_INTERVAL_S,
        percentile: float = 0.5,
        min_concurrency: int = 3,
        buffer: float = 0.25,
        request_count: int = 50,
        jitter: float = 0.15,
        max_limit: int = 1000,
        seed: int = 0,
    ) -> None:
        super().__init__(clock, backends)
        self.update_interval_s = update_interval_s
        self.min_rtt_interval_s = min_rtt_interval_s
        self.percentile = percentile
        self.min_concurrency = min_concurrency
        self.buffer = buffer
        self.request_count = request_count
        self.jitter = jitter
        self.max_limit = max_limit
        self._rng = random.Random(f"envoy/{seed}")
        self.concurrency_limit = min_concurrency
        self.min_rtt: float | None = None
        self.outstanding = 0
        self._samples: list[float] = []
        self._sent_at: dict[str, float] = {}
        self._deferred = 0
        self._in_min_rtt = False
        self._epoch = -math.inf
        self._consecutive_min = 0
        self._next_update: float | None = None
        self._next_min_rtt: float | None = None
        self._rr = 0
        self.limit_history: list[tuple[float, int]] = []
        self._enter_min_rtt(clock.now())
        self._next_update = clock.now() + update_interval_s

    # -- the controller --------------------------------------------------------------------

    def limit(self, backend: str) -> float:
        return self.concurrency_limit / max(1, len(self.backends))

    def _set_limit(self, new: int, now: float) -> None:
        old = self.concurrency_limit
        self.concurrency_limit = new
        self.limit_history.append((now, new))
        if not self._in_min_rtt and old == self.min_concurrency and new == self.min_concurrency:
            self._consecutive_min += 1
        else:
            self._consecutive_min = 0
        if self._consecutive_min >= 5:
            self._next_min_rtt = now  # measure minRTT again at once

    def _enter_min_rtt(self, now: float) -> None:
        if self._in_min_rtt:
            return
        self._in_min_rtt = True
        self._deferred = self.concurrency_limit
        self._set_limit(self.min_concurrency, now)
        self._samples = []
        self._epoch = now
        self._next_min_rtt = None

    def _update_min_rtt(self, now: float) -> None:
        if not self._in_min_rtt or len(self._samples) < self.request_count:
            return
        self.min_rtt = _percentile(self._samples, self.percentile)
        self._samples = []
        self._in_min_rtt = False
        self._set_limit(self._deferred, now)
        self._deferred = 0
        jitter_s = self._rng.random() * self.jitter * self.min_rtt_interval_s
        self._next_min_rtt = now + self.min_rtt_interval_s + jitter_s
        self._next_update = now + self.update_interval_s

    def _reset_sample_window(self, now: float) -> None:
        if not self._samples or self.min_rtt is None:
            return
        sample_rtt = _percentile(self._samples, self.percentile)
        self._samples = []
        if sample_rtt <= 0:
            return
        buffered = self.min_rtt + self.min_rtt * self.buffer
        gradient = max(0.5, min(2.0, buffered / sample_rtt))
        limit = self.concurrency_limit * gradient
        new = int(limit + math.sqrt(limit))
        self._set_limit(max(self.min_concurrency, min(self.max_limit, new)), now)

    def _timers(self, now: float) -> None:
        while True:
            due = [t for t in (self._next_update, self._next_min_rtt) if t is not None]
            if not due or min(due) > now:
                return
            if (
                self._next_min_rtt is not None
                and self._next_min_rtt <= now
                and (self._next_update is None or self._next_min_rtt <= self._next_update)
            ):
                self._enter_min_rtt(self._next_min_rtt)
                continue
            assert self._next_update is not None
            at = self._next_update
            if self._in_min_rtt:
                # the sample timer gives up during a minRTT measurement; it is armed again
                # when the measurement ends
                self._next_update = None
                continue
            self._reset_sample_window(at)
            self._next_update = at + self.update_interval_s

    # -- the harness's calls -----------------------------------------------------------------

    def _next_wakeup(self) -> float | None:
        due = [t for t in (self._next_update, self._next_min_rtt) if t is not None]
        return min(due) if due else None

    def _dispatch(self) -> list[Assignment]:
        self._timers(self._clock.now())
        return super()._dispatch()

    def arrive(self, info: RequestInfo) -> PeerAdmission:
        now = self._clock.now()
        self._timers(now)
        up = self._up()
        if not up or self.outstanding >= self.concurrency_limit:
            return PeerAdmission(False, PeerCode.ENVOY_LIMIT, None)
        self.outstanding += 1
        b = up[self._rr % len(up)]
        self._rr += 1
        self._sent_at[info.request_id] = now
        self._send(info.request_id, b)
        return PeerAdmission(True)

    def cancel(self, request_id: str) -> None:
        self._end(request_id, sample=False)
        super().cancel(request_id)

    def on_finish(
        self,
        request_id: str,
        outcome: Outcome,
        prompt_tokens: int | None = None,
        completion_tokens: int | None = None,
    ) -> None:
        self._end(request_id, sample=outcome == Outcome.OK)
        super().on_finish(request_id, outcome, prompt_tokens, completion_tokens)

    def _end(self, request_id: str, *, sample: bool) -> None:
        sent = self._sent_at.pop(request_id, None)
        if sent is None:
            return
        now = self._clock.now()
        self._timers(now)
        self.outstanding -= 1
        if not sample or sent < self._epoch:
            return  # no sample; or sent before the minRTT window opened
        self._samples.append(now - sent)
        self._update_min_rtt(now)
