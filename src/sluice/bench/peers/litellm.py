"""`litellm`: LiteLLM proxy in front of the backends, `max_parallel_requests` on each
deployment set to the sweet spot (what its users do to protect a self-hosted model).

Read from BerriAI/litellm (the stored versions cited):
* `litellm/router_utils/client_initalization_utils.py` @076d1da:
  `set_max_parallel_requests_client` turns a deployment's `max_parallel_requests` (or its
  rpm/tpm) into a per-deployment cap;
* `litellm/proxy/hooks/parallel_request_limiter_v3.py` @00353f5: over a
  `max_parallel_requests` limit the proxy answers at once with a 429
  (`ParallelRequestLimitError`) and `retry-after: str(self.window_size)`, the window being
  `LITELLM_RATE_LIMIT_WINDOW_SIZE`, 60 s by default; nothing is queued; the counter is
  decremented when the call succeeds or fails (`async_log_success_event`,
  `async_log_failure_event`);
* `litellm/router.py` @f292d1a: the default `routing_strategy` is `simple-shuffle`
  (a random deployment among those that can take the call).

Modelled: each backend takes at most `cap` requests at once; a request goes to a random
backend (a stable hash of its id, so the run is deterministic) among the healthy ones
with a free slot; when none has one, 429 with Retry-After 60. The body's `priority` field
is ignored: LiteLLM's scheduler (`litellm/scheduler.py`) only holds requests while every
deployment is cooling down, which never happens here. Not modelled: the router's own
`asyncio.Semaphore` around each deployment call, which makes callers wait instead (the
proxy's 429 comes first), and the v3 limiter's 60 s window resetting its counter (a
window reset lets a few more requests in than the cap).
"""

from __future__ import annotations

from sluice.bench.peers.base import PeerAdmission, PeerCode, PeerGateway
from sluice.bench.workload import unit_hash
from sluice.core.clock import Clock
from sluice.core.types import RequestInfo

RETRY_AFTER_S = 60.0  # LITELLM_RATE_LIMIT_WINDOW_SIZE's default


class LiteLLMGateway(PeerGateway):
    name = "litellm"

    def __init__(self, clock: Clock, backends: list[str], *, cap: int) -> None:
        super().__init__(clock, backends)
        if cap < 1:
            raise ValueError("max_parallel_requests must be at least 1")
        self.cap = cap
        self._n = 0

    def limit(self, backend: str) -> float:
        return float(self.cap)

    def arrive(self, info: RequestInfo) -> PeerAdmission:
        free = [b for b in self._up() if self.inflight[b] < self.cap]
        if not free:
            return PeerAdmission(False, PeerCode.LITELLM_PARALLEL, RETRY_AFTER_S)
        self._n += 1
        pick = free[int(unit_hash(7, self._n) * len(free))]
        self._send(info.request_id, pick)
        return PeerAdmission(True)
