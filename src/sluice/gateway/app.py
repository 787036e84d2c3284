"""The gateway's HTTP surface: OpenAI-compatible routes in front of the backends.

This module holds the gateway's parts and their lifecycle (start, hot reload, stop) and
the routes; every proxied route goes through the one request path (request_path.py: a
pipeline of small stages over one RequestContext). The decisions are the core's; the
gateway only does I/O."""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import secrets
from functools import partial
from pathlib import Path
from typing import Any

import aiohttp
import orjson
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST

from sluice.config import Backend, Policy, policy_secrets
from sluice.core.clock import MonotonicClock
from sluice.core.controller import Controller
from sluice.core.snapshot import ControllerSnapshot
from sluice.gateway.auth import KeyRing
from sluice.gateway.backend_pool import BackendPool
from sluice.gateway.dispatch_bridge import DispatchBridge
from sluice.gateway.errors import error_response, error_shape_middleware
from sluice.gateway.features import Features
from sluice.gateway.logs import ACCESS_LOG, REDACTOR
from sluice.gateway.lora_admin import lora_call
from sluice.gateway.model_catalog import model_cards, model_list
from sluice.gateway.policy_watch import PolicyWatcher
from sluice.gateway.relay import Relay
from sluice.gateway.request_path import RequestPath
from sluice.gateway.returns import BookingTokens, booking_secret
from sluice.gateway.routes import PROXIED
from sluice.gateway.shared_quota import SharedQuotaGate
from sluice.gateway.stages.authenticate import unauthorized
from sluice.gateway.stall_watch import StallWatch
from sluice.gateway.telemetry import Telemetry

log = logging.getLogger("sluice.gateway")

ACCESS_FLUSH_S = 0.2
UPSTREAM_KEEPALIVE_S = 4.0
# A new upstream connection's connect timeout. Generous: uvloop runs due timers before it
# polls I/O, so a gateway process that stalls (a busy host: CI VMs stall 4-5 s at times)
# times out a connect that completed during the stall; 5 s failed requests to a loopback
# vLLM that way. A dead backend refuses at once, and its health checks take it out in 2 s.
UPSTREAM_CONNECT_S = 10.0

GATEWAY_KEY: web.AppKey[Gateway] = web.AppKey("gateway")
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
        settings = policy.core_settings()  # what the core reads of it
        if policy.redis is not None:
            self.quota_gate = SharedQuotaGate(
                policy.redis.url,
                settings.tenants,
                self.clock,
                on_mode=self.telemetry.set_quota_mode,
                on_error=self.telemetry.quota_error,
                # the processes sharing the quotas share the backends: the fleet share
                on_processes=lambda n: self.controller.expect_peers(n),
            )
        # unique to this process: another replica's booking token names its own slots,
        # and replicas sharing the backends draw past their claims independently and
        # break ties between backends in their own orders (core/dispatcher.py)
        process = f"{os.getpid():x}{secrets.token_hex(3)}"
        # when the host does not run this process (core/stall_log.py); started with the
        # server (start), so that a Gateway built for a test has no thread
        self.stall_watch = StallWatch(on_stall=self.telemetry.stalls.inc)
        self.controller = Controller(
            settings,
            self.clock,
            stalls=self.stall_watch,
            quotas=self.quota_gate.controller_quotas if self.quota_gate else None,
            return_slots={"id_prefix": f"{process}-"},
            seed=process,
        )
        if self.quota_gate is not None:
            # a process that never saw Redis's count of the processes (it started while
            # Redis was lost) holds the part of the fleet it estimates, not every quota
            self.quota_gate.controller_quotas.fleet_share = self.controller.fleet_share
        self.workers = 1  # the processes of this `sluice serve` (set_workers)
        self._count_fleet()
        self.tokens = BookingTokens(booking_secret(policy.retry_after.secret_env), self.clock.now)
        self.keyring = KeyRing(policy)
        REDACTOR.set_secrets(policy_secrets(policy))
        self.telemetry.watch_state(self.state)
        self.bridge = DispatchBridge(self.controller, self.clock)
        self.features = Features(
            policy, self.clock, self.telemetry.breaker_changed, self.telemetry.breaker_removed
        )
        self.session: aiohttp.ClientSession | None = None
        self.pool: BackendPool | None = None
        self.relay: Relay | None = None
        # every proxied route's handler (start() connects it to the backends)
        self.path = RequestPath(
            policy,
            self.keyring,
            self.features,
            self.controller,
            self.bridge,
            self.telemetry,
            self.clock,
            self.quota_gate,
            self.tokens,
            self.stall_watch,
        )
        self._draining = False

    # --- lifecycle -----------------------------------------------------------------------

    async def start(self, _app: web.Application | None = None) -> None:
        self.stall_watch.start()
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
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=UPSTREAM_CONNECT_S),
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
        self.relay = Relay(
            self.session,
            self.telemetry,
            self.policy.server.upstream_timeout,
            self.policy.expose.error_details,
        )
        self.path.connect(self.pool, self.relay)
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

    def set_workers(self, workers: int) -> None:
        """This replica runs `workers` processes (`sluice serve --workers`)."""
        self.workers = workers
        self._count_fleet()

    def _count_fleet(self) -> None:
        """Tell the core how many gateway processes share the backends when that is
        known: the policy's `fleet.gateways` times this replica's workers, or the workers
        alone; else it learns its part from the scrapes (core/fleet_share.py). Redis's
        count, once it has one, wins (it is live; it comes again at every heartbeat)."""
        if self.quota_gate is not None and self.quota_gate.controller_quotas.processes:
            return
        gateways = self.policy.fleet.gateways
        known = gateways is not None or self.workers > 1
        self.controller.expect_peers((gateways or 1) * self.workers if known else None)

    def apply_policy(self, policy: Policy) -> None:
        """Hot reload: new queues, tenants, limits, features and backends take effect at
        once; queued and in-flight requests carry on."""
        if self._backends_override:
            policy = policy.model_copy(update={"backends": self._backends_override})
        keyring = KeyRing(policy)  # what can fail comes before anything changes
        REDACTOR.set_secrets(policy_secrets(policy))
        self.policy = policy
        self.controller.apply_policy(policy.core_settings())
        self._count_fleet()
        self.keyring = keyring
        self.features.apply(policy)  # breakers keep their state
        if self.pool is not None:
            self.pool.set_backends(list(policy.backends))
            self.pool.set_scraper(policy.scraper)
            self.features.set_healthy_fraction(self.pool.healthy_fraction())
        if self.relay is not None:
            self.relay.default_timeout = policy.server.upstream_timeout
            self.relay.error_details = policy.expose.error_details
        self.path.apply_policy(policy, self.keyring, self.features)
        self.bridge.pump()

    @property
    def draining(self) -> bool:
        """Shutting down: new requests are refused (503), open ones finish."""
        return self._draining

    @draining.setter
    def draining(self, value: bool) -> None:
        self._draining = value
        self.path.draining = value
        if value:  # the queued requests retry on another replica (Controller.hand_over)
            self.controller.hand_over()
            self.bridge.pump()
            if self.quota_gate is not None:  # leaving local: hand back within the grace
                self.quota_gate.draining(self.clock.now() + self.policy.server.shutdown_grace)

    async def _flush_access_log(self) -> None:
        while True:
            await asyncio.sleep(ACCESS_FLUSH_S)
            ACCESS_LOG.flush()

    async def stop(self, _app: web.Application | None = None) -> None:
        if self._flusher is not None:
            self._flusher.cancel()
        ACCESS_LOG.flush()
        self.telemetry.stop()
        self.stall_watch.stop()
        if self.watcher is not None:
            await self.watcher.stop()
        self.bridge.close()
        if self.quota_gate is not None:
            await self.quota_gate.stop()
        if self.pool is not None:
            await self.pool.stop()
        if self.session is not None:
            await self.session.close()

    def state(self) -> ControllerSnapshot:
        return self.controller.snapshot()

    # --- routes --------------------------------------------------------------------------

    def routes(self) -> list[web.RouteDef]:
        # the request path itself is each proxied route's handler, given the route's spec
        proxied = [
            web.route(method, path, partial(self.path.serve, spec))
            for method, path, spec in PROXIED
        ]
        return [
            *proxied,
            web.get("/v1/models", self.models),
            web.get("/v1/models/{model:.+}", self.model),
            web.post("/v1/load_lora_adapter", self.load_lora_adapter),
            web.post("/v1/unload_lora_adapter", self.unload_lora_adapter),
            web.get("/v1/realtime", self.realtime),
            web.get("/metrics", self.metrics),
            web.get("/health", self.health),
            web.get("/healthz", self.healthz),
            web.get("/readyz", self.readyz),
            web.get("/dashboard", self.dashboard),
            web.get("/dashboard/state", self.dashboard_state),
            web.post("/admin/reload", self.admin_reload),
            web.get("/admin/state", self.admin_state),
        ]

    async def models(self, request: web.Request) -> web.Response:
        if self._tenant(request) is None:
            return unauthorized()
        assert self.pool is not None
        return web.Response(
            body=orjson.dumps(model_list(self.pool)), content_type="application/json"
        )

    async def model(self, request: web.Request) -> web.Response:
        if self._tenant(request) is None:
            return unauthorized()
        assert self.pool is not None
        name = request.match_info["model"]
        card = model_cards(self.pool).get(name)
        if card is None:
            return error_response(404, f"The model `{name}` does not exist.", "model_not_found")
        return web.Response(body=orjson.dumps(card), content_type="application/json")

    async def load_lora_adapter(self, request: web.Request) -> web.Response:
        return await self._lora(request, "/v1/load_lora_adapter")

    async def unload_lora_adapter(self, request: web.Request) -> web.Response:
        return await self._lora(request, "/v1/unload_lora_adapter")

    async def _lora(self, request: web.Request, path: str) -> web.Response:
        if (denied := self._admin(request)) is not None:
            return denied
        assert self.pool is not None and self.session is not None
        return await lora_call(request, self.pool, self.session, path)

    async def realtime(self, _request: web.Request) -> web.Response:
        """Refused on purpose (docs/routes.md): a realtime session streams audio for as
        long as it stays open, which the gateway can neither cost nor bound."""
        return error_response(
            501,
            "Sluice does not relay /v1/realtime sessions: a websocket session streams "
            "audio for as long as it stays open, which the gateway can neither cost, "
            "queue nor bound. Use /v1/audio/transcriptions (streamed with stream=true), "
            "or connect to the backend directly.",
            "realtime_not_supported",
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
        snapshot = self.controller.snapshot().as_dict()
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
            "controller": self.controller.snapshot().as_dict(),
            "backends": backends,
            "feature_breakers": features,
            "policy_path": self.policy_path,
            "draining": self.draining,
        }
        return web.Response(body=orjson.dumps(body), content_type="application/json")

    # --- the request path ----------------------------------------------------------------

    def _tenant(self, request: web.Request) -> Any:
        """The tenant of a request outside the request path (the model list): its key
        as `Authorization: Bearer` or, from the anthropic SDK, `x-api-key`."""
        key = KeyRing.bearer(request.headers.get("Authorization"))
        if key is None:
            key = (request.headers.get("x-api-key") or "").strip() or None
        return self.keyring.tenant_for(key) if key else None


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
