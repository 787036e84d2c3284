"""The request path: every proxied route runs these stages, in this order, over one
RequestContext (gateway/request_context.py). What differs per route is data, its
RouteSpec (gateway/routes.py).

     authenticate    key -> tenant                                   401
     classify        tenant's class, X-Priority                      400 / 403
     draining        shutting down                                   503
     read_body       size and time limits                            413 / 408
     parse_body      model, stream, cost (the route's rules),
                     client deadlines, model known                   400 / 404
     ── a route outside the queues (RouteSpec.queued False: tokenize, count_tokens,
        a stored response): admission.begin, bypass.place (or stored_responses.locate),
        bypass.forward, account; then the access record ──
     feature_breaker non-core feature with its breaker open   ->  fallback
     admission.begin the request id; a client's retry counted; the
                     return slot its booking token claims (gateway/returns.py)
     stored_responses.continuation: previous_response_id -> its backend, its tokens
     quota_ticket    shared quota in Redis (when configured)         429 tenant_quota
  ┌> admission       core admission, queue wait (a booking: first
  │                  attempt only)                                   429 / 503
  │  forward         relay to the backend; the core and the pool learn the result
  │  account         ticket usage, feature breaker, outcome
  └─ retry_after_failure: failed before the first byte, once, on another backend
                     (a non-core feature answers from its fallback instead)
     stored_responses.remember: a stored response's backend and tenant
     access_record   on every way out: the access record, the ticket settled

A stage that answers returns the response and the path stops there; the access record
is written whatever happened (the client's hang-up included: status 499). Every answer
the path writes is in the route's error shape (RouteSpec.errors)."""

from __future__ import annotations

from aiohttp import web

from sluice.config import Policy
from sluice.core.clock import Clock
from sluice.core.controller import Controller
from sluice.core.stall_log import StallSource
from sluice.core.types import Outcome
from sluice.gateway.auth import KeyRing
from sluice.gateway.backend_pool import BackendPool
from sluice.gateway.dispatch_bridge import DispatchBridge
from sluice.gateway.features import Features
from sluice.gateway.relay import Relay
from sluice.gateway.request_context import RequestContext
from sluice.gateway.response_store import ResponseStore
from sluice.gateway.returns import BookingTokens
from sluice.gateway.routes import RouteSpec
from sluice.gateway.shared_quota import SharedQuotaGate
from sluice.gateway.stages.access_record import write_access_record
from sluice.gateway.stages.account import account
from sluice.gateway.stages.admission import Admission
from sluice.gateway.stages.authenticate import Authenticate
from sluice.gateway.stages.bypass import Bypass
from sluice.gateway.stages.classify import classify
from sluice.gateway.stages.draining import shutting_down
from sluice.gateway.stages.fallback import Fallback
from sluice.gateway.stages.feature_breaker import FeatureBreaker
from sluice.gateway.stages.forward import Forward
from sluice.gateway.stages.parse_body import ParseBody
from sluice.gateway.stages.quota_ticket import QuotaTicketStage
from sluice.gateway.stages.read_body import ReadBody
from sluice.gateway.stages.refusal import Refusal
from sluice.gateway.stages.stored_responses import StoredResponses
from sluice.gateway.telemetry import Telemetry


class RequestPath:
    """Built with the gateway (its routes' handlers are `serve` itself); the stages that
    talk to the backends are added by `connect` when the gateway starts (the backend pool
    and the relay need the running loop's HTTP session)."""

    def __init__(
        self,
        policy: Policy,
        keyring: KeyRing,
        features: Features,
        controller: Controller,
        bridge: DispatchBridge,
        telemetry: Telemetry,
        clock: Clock,
        quota_gate: SharedQuotaGate | None,
        tokens: BookingTokens,
        stalls: StallSource | None = None,
    ) -> None:
        self.clock = clock
        self.stalls = stalls  # the host's stalls, for each request's access record
        self.telemetry = telemetry
        self.draining = False
        self._controller = controller
        self._bridge = bridge
        self._expose_backend = policy.expose.backend_names
        self._tokens = tokens
        refusal = self._refusal = Refusal(telemetry, policy, tokens, clock)
        self._authenticate = Authenticate(keyring)
        self._read_body = ReadBody(policy.server)
        self._feature_breaker = FeatureBreaker(features)
        self._quota = (
            QuotaTicketStage(quota_gate, controller, refusal) if quota_gate is not None else None
        )
        self.responses = ResponseStore()
        self._admission: Admission | None = None  # the stages `connect` adds
        self._bypass: Bypass | None = None
        # bound once: the stages as the path calls them
        self.authenticate = self._authenticate.run
        self.read_body = self._read_body.run
        self.feature_breaker = self._feature_breaker.run
        self.quota = self._quota.run if self._quota is not None else None

    def connect(self, pool: BackendPool, relay: Relay) -> None:
        """The stages that reach the backends (at the gateway's start)."""
        clock, telemetry, refusal = self.clock, self.telemetry, self._refusal
        self._parse_body = ParseBody(pool, refusal)
        self._fallback = Fallback(telemetry, pool, relay)
        admission = self._admission = Admission(
            self._bridge, pool, telemetry, clock, refusal, self._tokens, self._expose_backend
        )
        self._forward = Forward(relay, self._controller, self._bridge, pool, telemetry, clock)
        self._bypass = Bypass(pool, relay, refusal, self._expose_backend)
        self.stored = StoredResponses(self.responses, pool)
        self.parse_body = self._parse_body.run
        self.fallback = self._fallback.run
        self.begin = admission.begin
        self.admit = admission.run
        self.retry_after_failure = admission.retry_after_failure
        self.forward = self._forward.run

    def apply_policy(self, policy: Policy, keyring: KeyRing, features: Features) -> None:
        """Hot reload: what the stages read from the policy, for the next request."""
        self._refusal.policy = policy
        self._authenticate.keyring = keyring
        self._read_body.server = policy.server
        self._feature_breaker.features = features
        self._expose_backend = policy.expose.backend_names
        if self._admission is not None and self._bypass is not None:  # connected
            self._admission.expose_backend = self._bypass.expose_backend = self._expose_backend

    async def serve(self, route: RouteSpec, request: web.Request) -> web.StreamResponse:
        """A proxied route's handler: `partial(serve, route)` (the route bound first, so
        that aiohttp's call adds only the request)."""
        ctx = RequestContext(request, route, self.clock.now())
        # Every way out returns `response` (None while the request goes on): the access
        # record in `finally` sees the answer, or None if the client went away (499).
        response: web.StreamResponse | None = None
        try:
            response = self.authenticate(ctx) or classify(ctx)
            if response is not None:
                return response
            if self.draining:
                response = shutting_down(ctx)
                return response
            response = await self.read_body(ctx) or self.parse_body(ctx)
            if response is not None:
                return response
            if not route.queued:
                response = await self._outside_the_queues(ctx)
                return response
            if self.feature_breaker(ctx):
                response = await self.fallback(ctx)
                return response
            self.begin(ctx)
            if route.stores_responses:
                self.stored.continuation(ctx)
            if self.quota is not None and (response := await self.quota(ctx)) is not None:
                return response
            while True:
                response = await self.admit(ctx)
                if response is not None:
                    return response
                result = await self.forward(ctx)
                outcome = account(ctx, result)
                if result.retryable:
                    if ctx.breaker is not None:
                        # Non-core: answer from the fallback now and keep what capacity
                        # is left for core traffic.
                        ctx.fields["outcome"] = "fallback"
                        response = await self.fallback(ctx)
                        return response
                    if self.retry_after_failure(ctx, result):
                        continue
                if route.stores_responses and result.outcome is Outcome.OK:
                    self.stored.remember(ctx, result)
                key = ctx.metric_key
                telemetry = self.telemetry
                telemetry.count[key, outcome](1)
                telemetry.observe_latency[key](self.clock.now() - ctx.started)
                response = result.response
                return response
        finally:
            write_access_record(ctx, response, self.clock.now(), self.stalls)

    async def _outside_the_queues(self, ctx: RequestContext) -> web.StreamResponse:
        """A route that costs nothing on the GPU: straight to a backend (stages/bypass.py)."""
        self.begin(ctx)
        # a stored response goes to the backend that holds it, the rest to any that fits
        stored = ctx.route.stores_responses
        assert self._bypass is not None, "serve() connects the request path first"
        answer = self.stored.locate(ctx) if stored else self._bypass.place(ctx)
        if answer is not None:
            return answer
        result = await self._bypass.forward(ctx)
        key = ctx.metric_key
        self.telemetry.count[key, account(ctx, result)](1)
        self.telemetry.observe_latency[key](self.clock.now() - ctx.started)
        return result.response
