"""The gateway's HTTP surface: OpenAI-compatible routes in front of the backends.

Per request: authenticate (key -> tenant -> class), read and check the body, ask the core
Controller for admission, wait for a slot, relay to the chosen backend, report first token
and completion back to the core. The decisions are the core's; this module only does I/O."""

from __future__ import annotations

import asyncio
import gc
import itertools
import logging
import os
import secrets
import time
from pathlib import Path
from typing import Any

import aiohttp
import orjson
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST

from sluice.config import Backend, Feature, Policy, policy_secrets
from sluice.core.circuit_breaker import CircuitBreaker
from sluice.core.clock import MonotonicClock
from sluice.core.controller import Controller
from sluice.core.types import Outcome, RejectCode, Rejection, RequestInfo
from sluice.gateway.auth import KeyRing
from sluice.gateway.backend_pool import BackendPool, ModelLookup
from sluice.gateway.dispatch_bridge import DispatchBridge
from sluice.gateway.errors import error_response, error_shape_middleware, reject_response
from sluice.gateway.fallback import static_fallback
from sluice.gateway.features import Features
from sluice.gateway.logs import ACCESS_LOG, REDACTOR, access
from sluice.gateway.policy_watch import PolicyWatcher
from sluice.gateway.relay import Relay, RelayContext, RelayResult
from sluice.gateway.request_body import BadRequest, ParsedRequest, parse_request, upstream_body
from sluice.gateway.returns import BookingTokens, booking_secret
from sluice.gateway.shared_quota import QuotaTicket, SharedQuotaGate
from sluice.gateway.telemetry import Telemetry

log = logging.getLogger("sluice.gateway")

# When a request sets no max_tokens, assume this much output for its cost estimate.
DEFAULT_MAX_TOKENS = 1024
# Attempts per request when a backend fails before anything reached the client.
MAX_ATTEMPTS = 2
# A retry waits for a slot at most this long (the Retry-After of the answer it replaces).
RETRY_WAIT_S = 1.0
ACCESS_FLUSH_S = 0.2
UPSTREAM_KEEPALIVE_S = 4.0
_DEADLINE_HEADERS = ("X-Request-Timeout", "X-Stainless-Timeout", "X-Stainless-Read-Timeout")

GATEWAY_KEY: web.AppKey[Gateway] = web.AppKey("gateway")
QUOTA_TICKET: web.RequestKey[QuotaTicket] = web.RequestKey("quota_ticket")
STATIC_DIR = Path(__file__).parent / "static"


class Gateway:
    def __init__(
        self,
        policy: Policy,
        policy_path: str | None = None,
        backends_override: tuple[Backend, ...] | None = None,
    ) -> None:
        if backends_override:
            policy = policy.model_copy(update={"backends": backends_override})
        self.policy = policy
        self.policy_path = policy_path
        self._backends_override = backends_override
        self.watcher: PolicyWatcher | None = None
        self._flusher: asyncio.Task[None] | None = None
        self.clock = MonotonicClock()
        self.telemetry = Telemetry()
        # Shared quotas: with `redis:` the shell checks Redis and the core's quotas only
        # take over while Redis is unreachable (shared_quota.py).
        self.quota_gate: SharedQuotaGate | None = None
        if policy.redis is not None:
            self.quota_gate = SharedQuotaGate(
                policy.redis.url,
                policy.tenants,
                self.clock,
                on_mode=self.telemetry.set_quota_mode,
                on_error=self.telemetry.quota_error,
            )
        self.controller = Controller(
            policy,
            self.clock,
            quotas=self.quota_gate.controller_quotas if self.quota_gate else None,
            # booking ids unique to this process: another replica's token names its own
            return_slots={"id_prefix": f"{os.getpid():x}{secrets.token_hex(3)}-"},
        )
        self.tokens = BookingTokens(booking_secret(policy.retry_after.secret_env), self.clock.now)
        self.keyring = KeyRing(policy)
        REDACTOR.set_secrets(policy_secrets(policy))
        self.telemetry.watch_state(self.state)
        self.bridge = DispatchBridge(self.controller, self.clock)
        self.features = Features(
            policy, self.clock, self.telemetry.breaker_changed, self.telemetry.breaker_removed
        )
        self._ids = itertools.count(1)
        self._id_prefix = f"{os.getpid():x}-{int(time.time()) & 0xFFFFFF:x}"
        self.session: aiohttp.ClientSession | None = None
        self.pool: BackendPool | None = None
        self.relay: Relay | None = None
        self.draining = False

    # --- lifecycle -----------------------------------------------------------------------

    async def start(self, _app: web.Application | None = None) -> None:
        # Idle upstream connections are closed after 4 s: before the backend's own keep-alive
        # timeout (vLLM's uvicorn: 5 s) can close one under a request being sent on it,
        # which would look like a backend that went away.
        connector = aiohttp.TCPConnector(
            limit=0, keepalive_timeout=UPSTREAM_KEEPALIVE_S, ttl_dns_cache=300
        )
        # The relay bounds each call with the request's own deadline; the session adds
        # only a connect timeout for new connections (no per-request timer of its own).
        self.session = aiohttp.ClientSession(
            connector=connector,
            # Every tenant's request shares this session: a cookie a backend (or a sticky
            # load balancer before it) sets must not be replayed on the next tenant's.
            cookie_jar=aiohttp.DummyCookieJar(),
            auto_decompress=False,
            skip_auto_headers=("User-Agent",),
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=5.0),
        )
        self.pool = BackendPool(
            list(self.policy.backends),
            self.controller,
            self.session,
            self.clock,
            self.policy.scraper,
            on_change=self.bridge.pump,
            on_capacity=lambda fraction: self.features.set_healthy_fraction(fraction),
            on_breaker=self.telemetry.breaker_changed,
        )
        self.relay = Relay(self.session, self.telemetry)
        await self.pool.start()
        if self.quota_gate is not None:
            await self.quota_gate.start()
        self.telemetry.start()
        self._flusher = asyncio.create_task(self._flush_access_log(), name="access-log")
        if self.policy_path is not None:
            self.watcher = PolicyWatcher(
                self.policy_path,
                self.apply_policy,
                self.telemetry.policy_reloaded,
                current=lambda: self.policy,
            )
            self.watcher.start()
        # Everything loaded so far lives as long as the process: keep it out of the
        # collector's full passes, which otherwise walk it again and again under load.
        gc.collect()
        gc.freeze()

    def apply_policy(self, policy: Policy) -> None:
        """Hot reload: new queues, tenants, limits, features and backends take effect at
        once; queued and in-flight requests carry on."""
        if self._backends_override:
            policy = policy.model_copy(update={"backends": self._backends_override})
        keyring = KeyRing(policy)  # what can fail comes before anything changes
        REDACTOR.set_secrets(policy_secrets(policy))
        self.policy = policy
        self.controller.apply_policy(policy)
        self.keyring = keyring
        self.features.apply(policy)  # breakers keep their state
        if self.pool is not None:
            self.pool.set_backends(list(policy.backends))
            self.pool.set_scraper(policy.scraper)
            self.features.set_healthy_fraction(self.pool.healthy_fraction())
        self.bridge.pump()

    async def _flush_access_log(self) -> None:
        while True:
            await asyncio.sleep(ACCESS_FLUSH_S)
            ACCESS_LOG.flush()

    async def stop(self, _app: web.Application | None = None) -> None:
        if self._flusher is not None:
            self._flusher.cancel()
        ACCESS_LOG.flush()
        self.telemetry.stop()
        if self.watcher is not None:
            await self.watcher.stop()
        self.bridge.close()
        if self.quota_gate is not None:
            await self.quota_gate.stop()
        if self.pool is not None:
            await self.pool.stop()
        if self.session is not None:
            await self.session.close()

    def state(self) -> dict[str, Any]:
        return self.controller.snapshot()

    # --- routes --------------------------------------------------------------------------

    def routes(self) -> list[web.RouteDef]:
        return [
            web.post("/v1/chat/completions", self.chat_completions),
            web.post("/v1/completions", self.completions),
            web.get("/v1/models", self.models),
            web.get("/metrics", self.metrics),
            web.get("/health", self.health),
            web.get("/healthz", self.healthz),
            web.get("/readyz", self.readyz),
            web.get("/dashboard", self.dashboard),
            web.get("/dashboard/state", self.dashboard_state),
            web.post("/admin/reload", self.admin_reload),
            web.get("/admin/state", self.admin_state),
        ]

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._complete(request, chat=True)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._complete(request, chat=False)

    async def models(self, request: web.Request) -> web.Response:
        if self._tenant(request) is None:
            return _unauthorized()
        assert self.pool is not None
        data = [
            {"id": m, "object": "model", "created": 0, "owned_by": "sluice"}
            for m in sorted(self.pool.known_models())
        ]
        return web.Response(
            body=orjson.dumps({"object": "list", "data": data}), content_type="application/json"
        )

    async def metrics(self, _request: web.Request) -> web.Response:
        return web.Response(
            body=self.telemetry.render(), headers={"Content-Type": CONTENT_TYPE_LATEST}
        )

    async def health(self, _request: web.Request) -> web.Response:
        """As the engines' own /health (vLLM, SGLang, TGI): 200 with an empty body while
        the gateway can serve (a healthy backend, not shutting down), else 503; load
        tools (guidellm) check it before a run."""
        assert self.pool is not None
        if self.draining or not any(h.healthy for h in self.pool.backends.values()):
            return error_response(
                503, "No healthy backend, or shutting down.", "unavailable", {"Retry-After": "1"}
            )
        return web.Response(status=200)

    async def healthz(self, _request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def readyz(self, _request: web.Request) -> web.Response:
        assert self.pool is not None
        healthy = [h.name for h in self.pool.backends.values() if h.healthy]
        ready = bool(healthy) and not self.draining
        body = {"ready": ready, "healthy_backends": healthy, "draining": self.draining}
        return web.json_response(body, status=200 if ready else 503)

    async def dashboard(self, _request: web.Request) -> web.FileResponse:
        return web.FileResponse(
            STATIC_DIR / "dashboard.html", headers={"Cache-Control": "no-cache"}
        )

    async def dashboard_state(self, request: web.Request) -> web.Response:
        """What the dashboard draws: the controller's snapshot plus cumulative counters
        (the page turns them into rates from one poll to the next). Without the admin key
        it names no tenant and no backend unless `expose.dashboard` is `full`."""
        snapshot = self.controller.snapshot()
        full = self.policy.expose.dashboard == "full"
        if not full:
            key = KeyRing.bearer(request.headers.get("Authorization"))
            full = key is not None and self.keyring.is_admin(key)
        body = {
            "t": self.clock.now(),
            "controller": snapshot if full else anonymous_snapshot(snapshot),
            "counters": self.telemetry.counters(),
        }
        return web.Response(
            body=orjson.dumps(body),
            content_type="application/json",
            headers={"Cache-Control": "no-store"},
        )

    def _admin(self, request: web.Request) -> web.Response | None:
        key = KeyRing.bearer(request.headers.get("Authorization"))
        if key is None or not self.keyring.is_admin(key):
            return error_response(
                401, "An admin key is required (Authorization: Bearer).", "invalid_admin_key"
            )
        return None

    async def admin_reload(self, request: web.Request) -> web.Response:
        if (denied := self._admin(request)) is not None:
            return denied
        if self.watcher is None:
            return error_response(
                409,
                "The gateway runs on its built-in policy; there is "
                "no file to reload (start it with --config).",
                "no_policy_file",
            )
        applied, errors = self.watcher.reload(force=True)
        status = 200 if applied else 422
        return web.json_response(
            {"reloaded": applied, "errors": errors, "path": str(self.watcher.path)}, status=status
        )

    async def admin_state(self, request: web.Request) -> web.Response:
        if (denied := self._admin(request)) is not None:
            return denied
        assert self.pool is not None
        backends = {
            h.name: {
                "url": h.url,
                "healthy": h.healthy,
                "models": sorted(h.models),
                "metrics_fresh": h.metrics_ok,
                "breaker": h.breaker.state.value,
                # the adapter reading its metrics (None: not recognised yet), and the
                # policy's `engine:`; which signals it has: controller.backends[name]
                "engine": h.engine.adapter.name if h.engine.adapter is not None else None,
                "engine_pinned": h.engine.pinned,
            }
            for h in self.pool.backends.values()
        }
        features = {name: b.state.value for name, b in self.features.breakers.items()}
        body = {
            "controller": self.controller.snapshot(),
            "backends": backends,
            "feature_breakers": features,
            "policy_path": self.policy_path,
            "draining": self.draining,
        }
        return web.Response(body=orjson.dumps(body), content_type="application/json")

    # --- the request path ----------------------------------------------------------------

    def _tenant(self, request: web.Request) -> Any:
        key = KeyRing.bearer(request.headers.get("Authorization"))
        return self.keyring.tenant_for(key) if key else None

    async def _complete(self, request: web.Request, chat: bool) -> web.StreamResponse:
        """One access record per request, whatever happens to it."""
        started = self.clock.now()
        fields: dict[str, Any] = {"path": request.path}
        response: web.StreamResponse | None = None
        try:
            response = await self._serve(request, chat, started, fields)
            return response
        finally:
            # 499: the client went away before the answer was complete (nginx's usage).
            fields["status"] = response.status if response is not None else 499
            fields["duration_ms"] = round((self.clock.now() - started) * 1000, 1)
            access(fields)
            if self.quota_gate is not None and (ticket := request.get(QUOTA_TICKET)):
                ticket.close()  # gives back to the shared quota what was not used

    async def _serve(
        self, request: web.Request, chat: bool, started: float, fields: dict[str, Any]
    ) -> web.StreamResponse:
        tenant = self._tenant(request)
        if tenant is None:
            return _unauthorized()
        fields["tenant"] = tenant.name
        priority = tenant.priority
        asked = request.headers.get("X-Priority")
        if asked is not None:
            if asked.strip() not in ("0", "1", "2"):
                return error_response(
                    400,
                    "X-Priority must be 0, 1 or 2",
                    "invalid_priority",
                    {"X-Sluice-Priority": str(priority)},
                )
            if int(asked) < tenant.priority:
                return error_response(
                    403,
                    f"this key may ask for priority {tenant.priority} or lower (a higher "
                    "number), not " + asked.strip(),
                    "priority_not_allowed",
                    {"X-Sluice-Priority": str(priority)},
                )
            priority = int(asked)
        headers = {"X-Sluice-Priority": str(priority)}
        fields["priority"] = priority
        if self.draining:
            return error_response(
                503,
                "The gateway is shutting down; retry on another replica.",
                "shutting_down",
                {**headers, "Retry-After": "1"},
            )

        try:
            if request.content.is_eof():
                raw = await request.read()  # all here already: no timer needed
            else:
                async with asyncio.timeout(self.policy.server.read_timeout):
                    raw = await request.read()
        except web.HTTPRequestEntityTooLarge:
            return error_response(
                413,
                f"the body is larger than {self.policy.server.max_body_bytes} bytes",
                "body_too_large",
                headers,
            )
        except TimeoutError:
            return error_response(
                408, "the request body was not received in time", "request_timeout", headers
            )
        try:
            parsed = parse_request(raw, chat)
            first_byte_s, total_s = _client_timeouts(request)
        except BadRequest as exc:
            return error_response(400, str(exc), "invalid_request", headers)

        assert self.pool is not None and self.relay is not None
        lookup = self.pool.lookup(parsed.model)
        if lookup is not ModelLookup.SERVED:
            if lookup is ModelLookup.NOT_YET_KNOWN:  # a backend that is down may serve it
                return self._rejected(priority, RejectCode.NO_BACKEND, 2.0, headers, None)
            return error_response(
                404, f"The model `{parsed.model}` does not exist.", "model_not_found", headers
            )

        feature = self.features.resolve(
            request.headers.get("X-Sluice-Feature"), tenant, parsed.model
        )
        feature_name = feature.name if feature else None
        breaker = self.features.breaker(feature)
        if breaker is not None and not breaker.allow():
            fields.update(outcome="fallback", feature=feature_name)
            return await self._fallback(request, parsed, feature, chat, headers, started)

        retry = _retry_attempt(request)
        if retry:
            self.telemetry.retries.labels(str(priority), retry[1]).inc()
        # The core drops a queued request its client will no longer wait for; the relay
        # stops an upstream call at the client's overall deadline.
        wait_deadline = started + first_byte_s if first_byte_s is not None else None
        deadline = started + total_s if total_s is not None else None
        body = upstream_body(parsed, raw)
        base_id = f"{self._id_prefix}-{next(self._ids)}"
        headers["X-Request-Id"] = base_id
        fields.update(
            request_id=base_id, model=parsed.model, stream=parsed.stream, feature=feature_name
        )
        queued_total = 0.0
        ticket = None
        if self.quota_gate is not None and self.quota_gate.limits(tenant.name):
            # charged as the core charges the local quotas (one rule: Controller.cost_of)
            cost = self.controller.cost_of(
                RequestInfo(
                    request_id=base_id,
                    tenant=tenant.name,
                    priority=priority,
                    model=parsed.model,
                    prompt_tokens=parsed.prompt_tokens_est,
                    max_tokens=parsed.max_tokens or DEFAULT_MAX_TOKENS,
                    sequences=parsed.sequences,
                )
            )
            ticket = await self.quota_gate.acquire(tenant.name, cost)
            if not ticket.ok:
                fields["outcome"] = RejectCode.TENANT_QUOTA.value
                return self._rejected(
                    priority, RejectCode.TENANT_QUOTA, ticket.retry_after_s, headers, breaker
                )
            request[QUOTA_TICKET] = ticket  # closed by _complete on every way out
        # A request that failed before anything reached its client is tried once more on
        # another backend; after the first byte it is never replayed.
        failed: RelayResult | None = None  # the answer a retry replaces
        booking, booked_slot = self.tokens.return_claim(request.headers, tenant.name, priority)
        for attempt in range(MAX_ATTEMPTS):
            request_id = base_id if attempt == 0 else f"{base_id}-r{attempt}"
            patience = wait_deadline
            if failed is not None:
                # The retry is the gateway's own idea: it may not wait for a slot past the
                # client's deadline nor longer than the refusal's Retry-After; if it finds
                # none by then, the client gets the first answer.
                patience = self.clock.now() + RETRY_WAIT_S
                if wait_deadline is not None:
                    patience = min(patience, wait_deadline)
            info = RequestInfo(
                request_id=request_id,
                tenant=tenant.name,
                priority=priority,
                model=parsed.model,
                prompt_tokens=parsed.prompt_tokens_est,
                max_tokens=parsed.max_tokens or DEFAULT_MAX_TOKENS,
                sequences=parsed.sequences,
                weight=tenant.weight,
                client_deadline=patience,
                feature=feature_name,
                retry_attempt=retry[0] if retry else 0,
                first_token_visible=parsed.stream,
                booking=booking if failed is None else None,
                booked_slot=booked_slot,
                give_up_at=deadline,
            )
            admission = self.bridge.arrive(info)
            if not admission.queued:
                assert admission.code is not None
                if failed is not None:
                    return self._retry_gave_up(failed, priority, started, fields, headers)
                fields["outcome"] = admission.code.value
                headers.update(self.tokens.refusal_headers(admission, priority, tenant.name))
                return self._rejected(
                    priority, admission.code, admission.retry_after_s, headers, breaker, deadline
                )
            decision = admission.assignment or await self.bridge.wait(request_id)
            queued_total += decision.queued_s
            headers["X-Sluice-Queue-Ms"] = str(round(queued_total * 1000))
            fields["queue_ms"] = round(queued_total * 1000, 1)
            if isinstance(decision, Rejection):
                self.telemetry.observe_queue_wait(priority, decision.queued_s)
                if failed is not None:
                    return self._retry_gave_up(failed, priority, started, fields, headers)
                fields["outcome"] = decision.code.value
                headers.update(self.tokens.refusal_headers(decision, priority, tenant.name))
                return self._rejected(
                    priority, decision.code, decision.retry_after_s, headers, breaker, deadline
                )
            self.telemetry.observe_queue_wait(priority, decision.queued_s)
            if self.policy.expose.backend_names:
                headers["X-Sluice-Backend"] = decision.backend
            fields.update(backend=decision.backend, attempt=attempt + 1)
            fields["outcome"] = "cancelled"  # until the relay says otherwise
            if ticket is not None:
                ticket.ran = True
            result = await self._forward(
                request,
                request_id,
                priority,
                decision.backend,
                chat,
                parsed,
                body,
                headers,
                started,
                deadline,
            )
            if ticket is not None:
                ticket.finished(result.outcome, result.prompt_tokens, result.completion_tokens)
            if breaker is not None:
                if result.outcome in (Outcome.ERROR, Outcome.TIMEOUT, Outcome.OVERLOADED):
                    breaker.record_failure()
                elif result.outcome is Outcome.OK:
                    breaker.record_success()
            # str() of a StrEnum is its value, without enum's Python-level `.value`
            outcome = str(result.outcome)
            fields["outcome"] = outcome
            if result.completion_tokens is not None:
                fields["completion_tokens"] = result.completion_tokens
            if result.retryable:
                if breaker is not None:
                    fields["outcome"] = "fallback"
                    # Non-core: answer from the fallback now and keep what capacity is
                    # left for core traffic.
                    return await self._fallback(request, parsed, feature, chat, headers, started)
                if attempt + 1 < MAX_ATTEMPTS and (deadline is None or self.clock.now() < deadline):
                    self.telemetry.outcome(priority, "retried_on_other_backend")
                    failed = result
                    continue
            self.telemetry.outcome(priority, outcome)
            self.telemetry.observe_latency(priority, self.clock.now() - started)
            return result.response
        raise AssertionError("unreachable: the last attempt returns")

    async def _forward(
        self,
        request: web.Request,
        request_id: str,
        priority: int,
        backend_name: str,
        chat: bool,
        parsed: ParsedRequest,
        body: bytes,
        headers: dict[str, str],
        started: float,
        deadline: float | None,
    ) -> RelayResult:
        assert self.pool is not None and self.relay is not None
        backend = self.pool.handle(backend_name)
        ctx = RelayContext(
            request=request,
            request_id=request_id,
            priority=priority,
            backend=backend,
            path="/v1/chat/completions" if chat else "/v1/completions",
            body=body,
            stream=parsed.stream,
            strip_usage=parsed.stream and not parsed.include_usage,
            headers=headers,
            started=started,
            deadline=deadline,
            default_timeout=self.policy.server.upstream_timeout,
            error_details=self.policy.expose.error_details,
        )
        try:
            # only a stream's first token is seen (relayed whole, an answer has none)
            first_token = self._first_token(ctx) if parsed.stream else _no_first_token
            result = await self.relay.forward(ctx, on_first_token=first_token)
        except BaseException:
            # The client went away (the handler is cancelled) or something unexpected:
            # the slot comes back either way.
            self.controller.cancel(request_id)
            self.telemetry.outcome(priority, Outcome.CANCELLED.value)
            self.bridge.pump()
            raise
        self.controller.on_finish(
            request_id, result.outcome, result.prompt_tokens, result.completion_tokens
        )
        self.pool.record(backend, result.outcome, lost=result.backend_lost)
        self.bridge.pump()
        return result

    def _retry_gave_up(
        self,
        failed: RelayResult,
        priority: int,
        started: float,
        fields: dict[str, Any],
        headers: dict[str, str],
    ) -> web.StreamResponse:
        """A retry found no slot in time: the client gets the first attempt's answer."""
        fields["outcome"] = failed.outcome.value
        if "X-Sluice-Queue-Ms" in headers:
            failed.response.headers["X-Sluice-Queue-Ms"] = headers["X-Sluice-Queue-Ms"]
        self.telemetry.outcome(priority, failed.outcome.value)
        self.telemetry.observe_latency(priority, self.clock.now() - started)
        return failed.response

    def _rejected(
        self,
        priority: int,
        code: RejectCode,
        retry_after_s: float,
        headers: dict[str, str],
        breaker: CircuitBreaker | None,
        deadline: float | None = None,
    ) -> web.Response:
        if breaker is not None and code is not RejectCode.TENANT_QUOTA:
            breaker.record_shed()
        self.telemetry.rejections.labels(str(priority), code.value).inc()
        self.telemetry.outcome(priority, "rejected")
        if code is not RejectCode.CANNOT_SERVE_IN_TIME:
            self.telemetry.retry_after.labels(str(priority)).observe(retry_after_s)
        queue = self.policy.queue(priority).name
        within_s = None if deadline is None else deadline - self.clock.now()
        return reject_response(code, retry_after_s, queue, headers, within_s)

    async def _fallback(
        self,
        request: web.Request,
        parsed: ParsedRequest,
        feature: Feature | None,
        chat: bool,
        headers: dict[str, str],
        started: float,
    ) -> web.StreamResponse:
        assert feature is not None and feature.fallback is not None
        priority = int(headers["X-Sluice-Priority"])
        self.telemetry.fallbacks.labels(feature.name).inc()
        self.telemetry.outcome(priority, "fallback")
        if feature.fallback.static is not None:
            return await static_fallback(request, parsed, feature.fallback.static, chat, headers)
        assert self.pool is not None and self.relay is not None and feature.fallback.backend
        handle = self.pool.handle(feature.fallback.backend)
        body = dict(parsed.body)
        if handle.models:
            body["model"] = sorted(handle.models)[0]
        small = ParsedRequest(
            body=body,
            model=body["model"],
            stream=parsed.stream,
            include_usage=parsed.include_usage,
            max_tokens=parsed.max_tokens,
            prompt_tokens_est=parsed.prompt_tokens_est,
            sequences=parsed.sequences,
        )
        ctx = RelayContext(
            request=request,
            request_id=f"fallback-{next(self._ids)}",
            priority=priority,
            backend=handle,
            path="/v1/chat/completions" if chat else "/v1/completions",
            body=upstream_body(small, orjson.dumps(body)),
            stream=parsed.stream,
            strip_usage=parsed.stream and not parsed.include_usage,
            headers={**headers, "X-Sluice-Fallback": "model"},
            started=started,
            deadline=None,
            default_timeout=self.policy.server.upstream_timeout,
            error_details=self.policy.expose.error_details,
        )
        result = await self.relay.forward(ctx, on_first_token=_no_first_token)
        return result.response

    def _first_token(self, ctx: RelayContext) -> Any:
        def on_first_token() -> None:
            self.controller.on_first_token(ctx.request_id)
            self.telemetry.observe_ttft(ctx.priority, self.clock.now() - ctx.started)

        return on_first_token


def _no_first_token() -> None:
    pass


def anonymous_snapshot(snapshot: dict[str, Any]) -> dict[str, Any]:
    """The controller's snapshot for a client without the admin key: no tenant names
    (their queue depths become a count of tenants queued), backends as "backend 1".."n"
    without their models."""
    classes = {}
    for name, c in snapshot["classes"].items():
        c = dict(c)
        c["tenants_queued"] = {"tenants": len(c.get("tenants_queued") or {})}
        classes[name] = c
    backends = {}
    for i, b in enumerate(snapshot["backends"].values(), 1):
        backends[f"backend {i}"] = {k: v for k, v in b.items() if k not in ("models", "limiter")}
    return {**snapshot, "classes": classes, "backends": backends}


def _unauthorized() -> web.Response:
    return error_response(
        401, "Missing or unknown API key: send Authorization: Bearer <key>.", "invalid_api_key"
    )


def _client_timeouts(request: web.Request) -> tuple[float | None, float | None]:
    """The client's own deadlines in seconds: (for the first byte, for the whole call).
    X-Request-Timeout and the openai SDK's X-Stainless-Timeout bound the whole call;
    X-Stainless-Read-Timeout bounds each read, so only the wait for the first byte (the
    queue wait). The smallest applicable one wins."""
    first: float | None = None
    total: float | None = None
    headers = request.headers
    for name in _DEADLINE_HEADERS:
        value = headers.get(name)
        if value is None:
            continue
        try:
            seconds = float(value)
        except ValueError:
            raise BadRequest(f"{name} must be a number of seconds") from None
        if not 0 < seconds < float("inf"):
            raise BadRequest(f"{name} must be a positive number of seconds")
        if first is None or seconds < first:
            first = seconds
        if name != "X-Stainless-Read-Timeout" and (total is None or seconds < total):
            total = seconds
    return first, total


def _retry_attempt(request: web.Request) -> tuple[int, str] | None:
    """Which retry this is, and which client made it: Sluice's SDK sends X-Sluice-Retry,
    the openai SDK x-stainless-retry-count."""
    for header, client in (
        ("X-Sluice-Retry", "sluice-sdk"),
        ("X-Stainless-Retry-Count", "openai-sdk"),
    ):
        value = request.headers.get(header)
        if value is not None and value.isdigit() and int(value) > 0:
            return min(int(value), 1000), client
    return None


def create_app(
    policy: Policy,
    policy_path: str | None = None,
    backends_override: tuple[Backend, ...] | None = None,
) -> web.Application:
    gateway = Gateway(policy, policy_path, backends_override)
    # every error in OpenAI's shape, the router's 404 and 405 included (errors.py)
    app = web.Application(
        client_max_size=policy.server.max_body_bytes, middlewares=[error_shape_middleware]
    )
    app[GATEWAY_KEY] = gateway
    app.add_routes(gateway.routes())
    app.on_startup.append(gateway.start)
    app.on_cleanup.append(gateway.stop)
    return app
