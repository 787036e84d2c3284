"""The backends as the gateway sees them: their URLs, the models they serve, whether they
answer their health check, and their /metrics (scraped and handed to the controller).

All network I/O for backend state lives here; decisions stay in the core.

Out of service means dead, not busy. A backend is taken out when its /health fails (a
refused or reset connection, an error status), when a request's connection to it is
refused or cut, or when its breaker opens on error answers (5xx). A backend that refuses
requests because it is full (vLLM's 503, or its 200 with an SSE error event) is alive:
the refusal is a drop signal for its limiter (the controller's job), nothing here. A
/health check that times out counts only while the backend shows no other sign of life: an
overloaded vLLM answers /health and /metrics late while it keeps answering requests. A
failed /metrics scrape only leaves the controller without metrics (latency-only control).

Each backend's metrics are read by its engine's adapter (`sluice.gateway.engines`): the
one its policy entry pins (`engine:`), or the one detected from what it answers (its
/metrics, else the `owned_by` of its /v1/models, else TGI's /info), looked for again every
DETECT_RETRY_S while none is found."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum

import aiohttp
import orjson

from sluice.config import Backend, ScraperPolicy
from sluice.core.circuit_breaker import BreakerSettings, BreakerState, CircuitBreaker
from sluice.core.clock import Clock, MonotonicClock
from sluice.core.controller import Controller
from sluice.core.types import SIGNALS, BackendMetrics, Outcome
from sluice.gateway.engines import (
    EngineAdapter,
    adapter,
    detect_from_info,
    detect_from_metrics,
    detect_from_models,
)

log = logging.getLogger("sluice.backends")

HEALTH_INTERVAL_S = 1.0
HEALTH_TIMEOUT_S = 2.0
# Failures in a row before a backend is taken out of service.
UNHEALTHY_AFTER = 2
# A backend that answered anything this recently (a request, a refusal, a /metrics scrape)
# is busy, not dead: a /health check that times out meanwhile does not count against it.
ALIVE_WINDOW_S = 10.0
MODELS_REFRESH_S = 30.0
# A backend whose engine was not recognised is looked at again this often.
DETECT_RETRY_S = 10.0
# An optional route answered with one of these is not served by this engine (llama.cpp's
# /metrics without --metrics answers 501): it is not asked again.
_NOT_SERVED = frozenset({404, 405, 501})
# A backend whose requests fail this often is taken out until it passes a health check.
BACKEND_BREAKER = BreakerSettings(
    window_s=10.0, error_rate=0.5, min_requests=5, open_for_s=2.0, probes=1
)


class ModelLookup(Enum):
    """Whether a model is served, as far as the gateway can know."""

    SERVED = "served"  # a backend (healthy or not) lists it
    NOT_YET_KNOWN = "not_yet_known"  # no backend lists it, but one's models are unknown
    ABSENT = "absent"  # every backend's models are known, and none lists it


class Probe(Enum):
    OK = "ok"
    FAILED = "failed"  # refused, reset, or an error status: counts against the backend
    SLOW = "slow"  # timed out: counts only if the backend shows no other sign of life


_AUTH_WARNED: dict[str, float] = {}
_AUTH_WARN_EVERY_S = 60.0


def warn_credentials_refused(backend: str, status: int) -> None:
    """Log a backend's refusals of the gateway's key at most once a minute per backend
    (they come with every request)."""
    now = time.monotonic()
    if now - _AUTH_WARNED.get(backend, -math.inf) >= _AUTH_WARN_EVERY_S:
        _AUTH_WARNED[backend] = now
        log.error(
            "backend %s refuses the gateway's credentials (HTTP %d): check its apiKeyEnv",
            backend,
            status,
        )


# What the relay sends with every completion request (plus the backend's key).
POST_HEADERS = {"Content-Type": "application/json", "Accept": "application/json"}


@dataclass
class BackendHandle:
    spec: Backend
    models: set[str] = field(default_factory=set)
    # what its /v1/models says of each (LoRA adapters included, with their `parent`)
    cards: dict[str, dict[str, object]] = field(default_factory=dict)
    models_known: bool = False  # listed in the policy, or learned from the backend
    healthy: bool = False
    failures: int = 0
    metrics_ok: bool = False
    # Clock time of the backend's last HTTP answer of any kind, refusals included.
    last_answer: float = -math.inf
    slow_probes: int = 0  # /health checks in a row that timed out while it was answering
    engine: EngineReading = field(default_factory=lambda: EngineReading())
    breaker: CircuitBreaker = field(
        default_factory=lambda: CircuitBreaker("backend", MonotonicClock(), BACKEND_BREAKER)
    )
    # Headers for its /v1 routes: the backend's own key, if it has one (set_backends).
    auth_headers: dict[str, str] = field(default_factory=dict)
    post_headers: dict[str, str] = field(default_factory=lambda: dict(POST_HEADERS))
    # its URL without a trailing slash, kept with the spec (read on every request)
    url: str = ""

    def __post_init__(self) -> None:
        self.url = self.spec.url.rstrip("/")

    @classmethod
    def create(cls, spec: Backend, on_breaker: Callable[[str, str], None]) -> BackendHandle:
        def changed(name: str, state: BreakerState) -> None:
            level = logging.WARNING if state is BreakerState.OPEN else logging.INFO
            log.log(level, "circuit breaker %s is now %s", name, state.value)
            on_breaker(name, state.value)

        breaker = CircuitBreaker(
            f"backend:{spec.name}", MonotonicClock(), BACKEND_BREAKER, on_change=changed
        )
        return cls(spec, breaker=breaker)

    @property
    def name(self) -> str:
        return self.spec.name


@dataclass
class EngineReading:
    """How a backend's metrics are read: its engine's adapter (None until detected) and
    what the adapter's routes answered that is kept between scrapes."""

    adapter: EngineAdapter | None = None
    pinned: str = "auto"
    static: dict[str, str] = field(default_factory=dict)  # `once` routes that answered
    skip: set[str] = field(default_factory=set)  # optional routes the engine does not serve
    detect_after: float = -math.inf

    def pin(self, engine: str) -> None:
        if engine == self.pinned and (engine == "auto" or self.adapter is not None):
            return
        self.pinned = engine
        self.adapter = None if engine == "auto" else adapter(engine)
        self.static.clear()
        self.skip.clear()
        self.detect_after = -math.inf


class BackendPool:
    def __init__(
        self,
        backends: list[Backend],
        controller: Controller,
        session: aiohttp.ClientSession,
        clock: Clock,
        scraper: ScraperPolicy,
        on_change: Callable[[], None],
        on_capacity: Callable[[float], None] = lambda _fraction: None,
        on_breaker: Callable[[str, str], None] = lambda _name, _state: None,
    ) -> None:
        self._controller = controller
        self._session = session
        self._clock = clock
        self._scraper = scraper
        self._on_change = on_change
        self._on_capacity = on_capacity
        self._on_breaker = on_breaker
        self._started = False
        self._tasks: list[asyncio.Task[None]] = []
        self.backends: dict[str, BackendHandle] = {}
        self._turn = 0
        self.set_backends(backends)

    def set_backends(self, backends: list[Backend]) -> None:
        old = self.backends
        self.backends = {
            b.name: old.get(b.name) or BackendHandle.create(b, self._on_breaker) for b in backends
        }
        for b in backends:
            h = self.backends[b.name]
            h.spec = b
            h.url = b.url.rstrip("/")
            h.auth_headers = b.auth_headers()
            h.post_headers = {**POST_HEADERS, **h.auth_headers}
            h.engine.pin(b.engine)
            if b.models:
                h.models = set(b.models)
                h.models_known = True
        self._controller.set_backends(list(self.backends))
        for h in self.backends.values():
            self._controller.set_backend_models(h.name, sorted(h.models))
            self._controller.set_backend_health(h.name, h.healthy)

    def set_scraper(self, scraper: ScraperPolicy) -> None:
        self._scraper = scraper

    # --- queries -------------------------------------------------------------------------

    def serves(self, model: str) -> bool:
        """Whether any backend (healthy or not) serves the model."""
        return any(model in h.models for h in self.backends.values())

    def lookup(self, model: str) -> ModelLookup:
        """A model no backend lists is absent (a 404) only if every backend's models are
        known; while one has not told them yet (it was down when the gateway started,
        and lists none in the policy), the model may be its: a 503 with Retry-After, as
        for a known model whose backends are all down (the SDKs retry that, not a 404)."""
        unknown = False
        for h in self.backends.values():
            if model in h.models:
                return ModelLookup.SERVED
            if not h.models_known:
                unknown = True
        return ModelLookup.NOT_YET_KNOWN if unknown else ModelLookup.ABSENT

    def handle(self, name: str) -> BackendHandle:
        return self.backends[name]

    def pick(self, model: str) -> BackendHandle | None:
        """For a request outside the queues (tokenize, count_tokens): a healthy backend
        serving the model ("": any), in turn."""
        fits = [h for h in self.backends.values() if h.healthy and (not model or model in h.models)]
        if not fits:
            return None
        self._turn = (self._turn + 1) % len(fits)
        return fits[self._turn]

    # --- background loops ----------------------------------------------------------------

    async def start(self) -> None:
        """Probe every backend once (so the gateway starts ready when they are), then keep
        probing and scraping in the background."""
        await asyncio.gather(*(self._probe(h) for h in self.backends.values()))
        self._started = True
        self._on_capacity(self.healthy_fraction())
        self._tasks.append(asyncio.create_task(self._health_loop(), name="health"))
        self._tasks.append(asyncio.create_task(self._scrape_loop(), name="scrape"))

    async def stop(self) -> None:
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await t
        self._tasks.clear()

    async def _health_loop(self) -> None:
        ticks = 0
        while True:
            await asyncio.sleep(HEALTH_INTERVAL_S)
            ticks += 1
            refresh_models = ticks % int(MODELS_REFRESH_S / HEALTH_INTERVAL_S) == 0
            await asyncio.gather(
                *(self._probe(h, refresh_models) for h in list(self.backends.values()))
            )

    async def _probe(self, h: BackendHandle, refresh_models: bool = False) -> None:
        probe = await self._check_health(h)
        if probe is Probe.SLOW:
            if self.alive(h):
                if h.slow_probes == 0:
                    log.warning(
                        "health check of backend %s timed out, but it answered within "
                        "%.0f s: busy, kept in service",
                        h.name,
                        ALIVE_WINDOW_S,
                    )
                h.slow_probes += 1
                return  # no evidence either way
            probe = Probe.FAILED
        h.slow_probes = 0
        ok = probe is Probe.OK
        wanted = ok and (not h.models or refresh_models) and not h.spec.models
        if wanted and not await self.refresh_models(h) and not h.models:
            ok = False  # serves nothing we can route to yet
        self.report(h, ok)

    async def refresh_models(self, h: BackendHandle) -> bool:
        """Read the backend's /v1/models again (at start, every MODELS_REFRESH_S, after a
        LoRA adapter is loaded or unloaded); False if it did not answer."""
        cards = await self._fetch_models(h)
        if cards is None:
            return False
        h.models_known = True
        h.cards = cards
        models = set(cards)
        if models != h.models:
            h.models = models
            self._controller.set_backend_models(h.name, sorted(models))
        return True

    def alive(self, h: BackendHandle) -> bool:
        """Whether the backend answered anything within ALIVE_WINDOW_S."""
        return self._clock.now() - h.last_answer <= ALIVE_WINDOW_S

    def record(self, h: BackendHandle, outcome: Outcome, lost: bool) -> None:
        """Evidence from a finished request. A refused or cut connection, or a
        health check that fails twice takes the backend out of service at once; error
        answers (5xx) count in its breaker, which takes it out when they are too many (a
        timeout is not counted: the client's deadline may simply be short). A refusal
        (overloaded) is no failure: the backend answered, it is alive. It comes back by
        passing its health checks."""
        if not lost and outcome is not Outcome.TIMEOUT:
            h.last_answer = self._clock.now()
        if lost:
            h.breaker.record_failure()
            h.failures = UNHEALTHY_AFTER
            self._mark(h, healthy=False)
        elif outcome is Outcome.ERROR:
            h.breaker.record_failure()
            if h.breaker.is_open():
                self._mark(h, healthy=False)
        elif outcome is Outcome.OK:
            h.breaker.record_success()

    def _mark(self, h: BackendHandle, healthy: bool) -> None:
        if h.healthy == healthy:
            return
        h.healthy = healthy
        if healthy:
            log.info("backend %s is healthy", h.name)
        else:
            log.warning("backend %s is out of service", h.name)
        self._controller.set_backend_health(h.name, healthy)
        if self._started:
            self._on_capacity(self.healthy_fraction())
        self._on_change()

    def healthy_fraction(self) -> float:
        if not self.backends:
            return 0.0
        return sum(h.healthy for h in self.backends.values()) / len(self.backends)

    def report(self, h: BackendHandle, ok: bool) -> None:
        """Health evidence from a probe (or from a failed request: `ok=False`)."""
        if ok:
            h.failures = 0
            if not h.healthy and not h.breaker.is_open():
                h.breaker.reset()
                self._mark(h, healthy=True)
            return
        h.failures += 1
        if h.failures >= UNHEALTHY_AFTER:
            self._mark(h, healthy=False)

    async def _check_health(self, h: BackendHandle) -> Probe:
        try:
            async with self._session.get(
                f"{h.url}/health", timeout=aiohttp.ClientTimeout(total=HEALTH_TIMEOUT_S)
            ) as r:
                await r.read()
                ok = r.status == 200
        except TimeoutError:  # before aiohttp.ClientError: ServerTimeoutError is both
            return Probe.SLOW
        except (aiohttp.ClientError, OSError):
            return Probe.FAILED  # refused, reset, cut
        h.last_answer = self._clock.now()
        return Probe.OK if ok else Probe.FAILED  # vLLM answers 503 when its engine died

    async def _fetch_models(self, h: BackendHandle) -> dict[str, dict[str, object]] | None:
        try:
            async with self._session.get(
                f"{h.url}/v1/models",
                headers=h.auth_headers,
                timeout=aiohttp.ClientTimeout(total=2.0),
            ) as r:
                if r.status in (401, 403):
                    warn_credentials_refused(h.name, r.status)
                if r.status != 200:
                    return None
                body = orjson.loads(await r.read())
            return {m["id"]: m for m in body.get("data", []) if isinstance(m.get("id"), str)}
        except (
            aiohttp.ClientError,
            TimeoutError,
            OSError,
            orjson.JSONDecodeError,
            AttributeError,
            KeyError,
            TypeError,
        ):
            return None

    async def _scrape_loop(self) -> None:
        while True:
            await asyncio.gather(*(self._scrape(h) for h in list(self.backends.values())))
            self._on_change()
            await asyncio.sleep(self._scraper.interval)

    async def _get(self, h: BackendHandle, path: str) -> tuple[int, str]:
        async with self._session.get(
            f"{h.url}{path}",
            # the backend's key on its /v1 routes only, as for requests
            headers=h.auth_headers if path.startswith("/v1/") else None,
            timeout=aiohttp.ClientTimeout(total=self._scraper.interval * 4),
        ) as r:
            return r.status, (await r.read()).decode("utf-8", "replace")

    async def _detect(self, h: BackendHandle) -> tuple[str | None, dict[str, str]]:
        """The backend's engine from what it answers, and the pages read on the way."""
        status, text = await self._get(h, "/metrics")
        pages = {"/metrics": text} if status == 200 else {}
        name = detect_from_metrics(status, text)
        for path, detect in (("/v1/models", detect_from_models), ("/info", detect_from_info)):
            if name is not None:
                break
            status, text = await self._get(h, path)
            if status == 200:
                with contextlib.suppress(orjson.JSONDecodeError):
                    name = detect(orjson.loads(text))
        return name, pages

    async def _read_engine(self, h: BackendHandle) -> BackendMetrics | None:
        """One reading of the backend's metrics by its engine's adapter; None while its
        engine is not known. Raises what a failed scrape raises."""
        reading = h.engine
        now = self._clock.now()
        pages: dict[str, str] = {}
        if reading.adapter is None:
            if now < reading.detect_after:
                return None
            name, pages = await self._detect(h)
            if name is None:
                if reading.detect_after == -math.inf:
                    log.warning(
                        "backend %s: engine not recognised from its /metrics or /v1/models "
                        "(pin it with `engine:`); latency-only control",
                        h.name,
                    )
                reading.detect_after = now + DETECT_RETRY_S
                return adapter("none").read({}, now)
            reading.adapter = adapter(name)
            log.info("backend %s: engine %s", h.name, name)
        a = reading.adapter
        wanted = [
            r
            for r in a.routes
            if r.path not in reading.skip and r.path not in pages and r.path not in reading.static
        ]
        answers = await asyncio.gather(*(self._get(h, r.path) for r in wanted))
        for route, (status, text) in zip(wanted, answers, strict=True):
            if status == 200:
                pages[route.path] = text
                if route.once:
                    reading.static[route.path] = text
            elif route.required:
                raise aiohttp.ClientError(f"{route.path}: HTTP {status}")
            elif status in _NOT_SERVED and not route.once:
                reading.skip.add(route.path)
        return a.read({**reading.static, **pages}, now)

    async def _scrape(self, h: BackendHandle) -> None:
        try:
            metrics = await self._read_engine(h)
        except (aiohttp.ClientError, TimeoutError, OSError, ValueError) as exc:
            if h.metrics_ok:
                log.warning(
                    "metrics of backend %s unavailable (%s): latency-only control", h.name, exc
                )
            h.metrics_ok = False
            self._controller.metrics_stale(h.name)
            return
        if metrics is None:
            return
        h.last_answer = self._clock.now()
        if metrics.engine == "none":
            # what the state shows (engine none, no signal), then latency-only control
            self._controller.on_metrics(h.name, metrics)
            self._controller.metrics_stale(h.name)
            h.metrics_ok = False
            return
        if not h.metrics_ok:
            missing = [
                s for s in SIGNALS if metrics.signals is not None and s not in metrics.signals
            ]
            log.info(
                "metrics of backend %s available (engine %s%s)",
                h.name,
                metrics.engine,
                f"; missing {', '.join(missing)}: {h.engine.adapter.start_hint}"
                if missing and h.engine.adapter is not None
                else "",
            )
        h.metrics_ok = True
        self._controller.on_metrics(h.name, metrics)
