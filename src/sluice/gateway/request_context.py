"""One request's state as it goes through the request path (gateway/request_path.py).

Every stage reads what the stages before it found and adds its own: the tenant, the
class, the body and its cost, the feature and its breaker, the quota ticket, the backend
of the current attempt. The access record (`fields`) is filled on the way and written
once at the end, whatever happened. Nothing here decides anything: it is the bag the
stages share, so that no stage needs ten arguments and none re-reads what another wrote
(a header, say) to learn it again."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from aiohttp import web

    from sluice.config import Feature, Tenant
    from sluice.core.circuit_breaker import CircuitBreaker
    from sluice.gateway.backend_pool import BackendHandle
    from sluice.gateway.relay import RelayResult
    from sluice.gateway.request_body import ParsedRequest
    from sluice.gateway.routes import RouteSpec
    from sluice.gateway.shared_quota import QuotaTicket


class RequestContext:
    """Made per request: what every request has is set in __init__, the rest are
    class-level defaults until the stage that owns them sets them (no __slots__: a request
    refused early pays for none of them). The three declared without a default exist once
    their stage has run; the stages after it read them without a check."""

    tenant: Tenant  # authenticate
    parsed: ParsedRequest  # parse_body
    backend: BackendHandle  # admission: the current attempt's backend
    priority = 0  # classify: the class the request runs in
    metric_key: tuple[int, str]  # classify: (priority, route), what its metrics are labelled by
    raw = b""  # read_body: the body as the client sent it
    stream = False  # parse_body: the answer is a stream
    strip_usage = False  # the gateway asked a stream for usage; the client did not
    body = b""  # parse_body: what goes upstream
    wait_deadline: float | None = None  # the client waits no longer for a first byte
    deadline: float | None = None  # the client waits no longer for the answer
    retry_attempt = 0  # a client's retry: which one (X-Sluice-Retry, x-stainless-retry-count)
    pinned_backend: str | None = None  # a continuation goes where its response is stored
    feature: Feature | None = None  # feature_breaker
    feature_name: str | None = None
    breaker: CircuitBreaker | None = None  # the feature's, if it is not core
    ticket: QuotaTicket | None = None  # quota_ticket: the shared-quota charge
    base_id = ""  # the gateway's request id (X-Request-Id)
    request_id = ""  # the current attempt's (base_id, then base_id-r1)
    attempt = 0  # admission: which attempt runs (0 = the first)
    early_head = False  # admission: the stream's head may go before its first event
    queued_s = 0.0  # time queued over every attempt
    failed: RelayResult | None = None  # the answer a retry would replace
    booking: str | None = None  # admission.begin: the return slot this request claims
    booked_slot: float | None = None  # and when that slot is due (the core's clock)

    def __init__(self, request: web.Request, route: RouteSpec, started: float) -> None:
        self.request = request
        self.route = route
        self.started = started  # time.monotonic() at arrival (the core's clock)
        # the access record, written once on the way out (stages/access_record.py)
        self.fields: dict[str, Any] = {"path": request.path, "route": route.name}
        # the answer's own headers (X-Sluice-Priority, -Queue-Ms, -Backend, X-Request-Id)
        self.headers: dict[str, str] = {}
