"""The policy: a Kubernetes ConfigMap (deploy/k8s/configmap.yaml), or its bare
`policy.yaml`, with Sluice's own sections.

Validation is strict (unknown keys are errors) so that a typo in a ConfigMap is caught by
`sluice check-config` instead of silently running with a default. Field names follow the
ConfigMap's camelCase style; Python code uses the snake_case attribute names.
"""

from __future__ import annotations

import hashlib
import os
import re
from pathlib import Path
from typing import Annotated, Any, Literal
from urllib.parse import unquote, urlsplit

import yaml
from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationError,
    model_validator,
)
from pydantic.alias_generators import to_camel

from sluice.core import settings as core

# the core's own, which the policy names too
from sluice.core.settings import CLASS_NAMES as CLASS_NAMES
from sluice.core.settings import DropPolicy as DropPolicy

_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h)?\s*$")
_UNIT_SECONDS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, None: 1.0}


def parse_duration(value: Any) -> float:
    """'8s', '500ms', '1m', '2h' or a bare number of seconds -> seconds (float)."""
    if isinstance(value, bool):
        raise ValueError("expected a duration such as 8s, 500ms or 1m")
    if isinstance(value, int | float):
        seconds = float(value)
    elif isinstance(value, str) and (m := _DURATION.match(value)):
        seconds = float(m.group(1)) * _UNIT_SECONDS[m.group(2)]
    else:
        raise ValueError(f"expected a duration such as 8s, 500ms or 1m, got {value!r}")
    if seconds < 0:
        raise ValueError("a duration cannot be negative")
    return seconds


Duration = Annotated[float, BeforeValidator(parse_duration)]


class _Model(BaseModel):
    model_config = ConfigDict(
        alias_generator=to_camel, populate_by_name=True, extra="forbid", frozen=True
    )


def parse_objective(value: Any) -> float:
    """A latency objective's duration: like `parse_duration`, and more than zero."""
    if isinstance(value, str) and value.strip().startswith("-"):
        parse_duration(value.strip()[1:])  # malformed beyond its sign: say that instead
        raise ValueError(f"an objective must be more than zero, got {value!r}")
    seconds = parse_duration(value)
    if seconds <= 0:
        raise ValueError(f"an objective must be more than zero, got {value!r}")
    return seconds


ObjectiveDuration = Annotated[float, BeforeValidator(parse_objective)]


class Objective(_Model):
    """A class's latency objective (docs/limiter.md, "`slo`"): what one of its requests
    must achieve to count as served well. `ttft`: time to the first token; `tpot`: time
    per output token after it (the request's mean); `doneWithin`: time to the last token.
    Times count from the request's arrival at the gateway (its queue wait included).
    The bench judges its runs by these, and the `slo` limiter steers toward them."""

    ttft: ObjectiveDuration | None = None
    tpot: ObjectiveDuration | None = None
    done_within: ObjectiveDuration | None = None

    @model_validator(mode="after")
    def _something(self) -> Objective:
        if self.ttft is None and self.tpot is None and self.done_within is None:
            raise ValueError("an objective needs at least one of ttft, tpot, doneWithin")
        return self

    def core_settings(self) -> core.Objective:
        return core.Objective(self.ttft, self.tpot, self.done_within)


# Each class's objective when its queue states none: the bench's SLOs
# (docs/bench.md; P0 interactive, P1 agents that may wait 10-15 s, P2 batch within a minute).
DEFAULT_OBJECTIVES: dict[int, Objective] = {
    0: Objective(ttft=1.0, tpot=0.1),
    1: Objective(ttft=15.0),
    2: Objective(done_within=60.0),
}


class QueuePolicy(_Model):
    priority: int = Field(ge=0, le=2)
    name: str = Field(min_length=1)
    max_queue_size: int = Field(ge=0)
    timeout: Duration = Field(gt=0)
    drop_policy: DropPolicy
    # The class's latency objective; left out: DEFAULT_OBJECTIVES of its priority.
    slo: Objective = Field(default=None, validate_default=False)  # type: ignore[assignment]

    @model_validator(mode="before")
    @classmethod
    def _default_slo(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("slo") is None:
            prio = data.get("priority")
            if isinstance(prio, int) and not isinstance(prio, bool) and prio in DEFAULT_OBJECTIVES:
                data = {**data, "slo": DEFAULT_OBJECTIVES[prio]}
        return data

    def core_settings(self) -> core.QueueSettings:
        return core.QueueSettings(
            self.priority,
            self.name,
            self.max_queue_size,
            self.timeout,
            self.drop_policy,
            self.slo.core_settings(),
        )


DEFAULT_QUEUES: tuple[QueuePolicy, ...] = (
    QueuePolicy(
        priority=0,
        name="realtime-interactive",
        max_queue_size=200,
        timeout=8.0,
        drop_policy=DropPolicy.TAIL,
    ),
    QueuePolicy(
        priority=1,
        name="agent-workflow",
        max_queue_size=500,
        timeout=15.0,
        drop_policy=DropPolicy.EARLY_DROP_ON_PRESSURE,
    ),
    QueuePolicy(
        priority=2,
        name="batch-extraction",
        max_queue_size=1000,
        timeout=60.0,
        drop_policy=DropPolicy.FAST_REJECT,
    ),
)


def _check_sha256(keys: list[str]) -> list[str]:
    for k in keys:
        if not re.fullmatch(r"[0-9a-fA-F]{64}", k):
            raise ValueError("apiKeySha256 entries must be 64 hex digits")
    return [k.lower() for k in keys]


Sha256List = Annotated[list[str], AfterValidator(_check_sha256)]


class Tenant(_Model):
    name: str = Field(min_length=1)
    api_keys: list[str] = Field(default_factory=list)
    api_key_sha256: Sha256List = Field(default_factory=list)
    priority: int = Field(default=1, ge=0, le=2)
    weight: float = Field(default=1.0, gt=0)
    tokens_per_minute: int = Field(default=0, ge=0)
    requests_per_minute: int = Field(default=0, ge=0)
    max_concurrency: int = Field(default=0, ge=0)

    def key_digests(self) -> list[str]:
        """All accepted keys as sha256 hex digests (plaintext keys are hashed here)."""
        plain = [hashlib.sha256(k.encode()).hexdigest() for k in self.api_keys]
        return plain + list(self.api_key_sha256)

    def core_settings(self) -> core.TenantLimits:
        """Its quotas, without its keys."""
        return core.TenantLimits(
            self.name, self.tokens_per_minute, self.requests_per_minute, self.max_concurrency
        )


# The engines Sluice has a metrics adapter for (sluice.gateway.engines), and `auto`.
Engine = Literal["auto", "vllm", "sglang", "trtllm", "llamacpp", "tgi", "none"]


class Backend(_Model):
    name: str = Field(min_length=1)
    url: str = Field(pattern=r"^https?://[^\s/]+(/.*)?$")
    # Models served; empty = learn them from the backend's GET /v1/models.
    models: list[str] = Field(default_factory=list)
    weight: float = Field(default=1.0, gt=0)
    # The environment variable holding the key the backend requires (vLLM's --api-key):
    # sent as `Authorization: Bearer ...` on its /v1 routes. A name, never the key itself,
    # so that the policy file holds no secret.
    api_key_env: str | None = Field(default=None, pattern=r"^[A-Za-z_][A-Za-z0-9_]*$")
    # Which engine serves it, so which adapter reads its metrics (docs/engines.md); `auto`
    # detects it from what the backend answers, `none` reads no metrics (latency only).
    engine: Engine = "auto"

    def auth_headers(self) -> dict[str, str]:
        """What the gateway sends the backend to be let in (empty without a key)."""
        key = os.environ.get(self.api_key_env, "") if self.api_key_env else ""
        return {"Authorization": f"Bearer {key}"} if key else {}


class Admin(_Model):
    api_keys: list[str] = Field(default_factory=list)
    api_key_sha256: Sha256List = Field(default_factory=list)

    def key_digests(self) -> list[str]:
        plain = [hashlib.sha256(k.encode()).hexdigest() for k in self.api_keys]
        return plain + list(self.api_key_sha256)


class Fallback(_Model):
    static: str | None = None
    backend: str | None = None

    @model_validator(mode="after")
    def _exactly_one(self) -> Fallback:
        if (self.static is None) == (self.backend is None):
            raise ValueError("a fallback is either {static: TEXT} or {backend: NAME}")
        return self


class Feature(_Model):
    name: str = Field(min_length=1)
    core: bool = True
    fallback: Fallback | None = None
    # Requests also match a feature by model or tenant when they send no X-Sluice-Feature.
    models: list[str] = Field(default_factory=list)
    tenants: list[str] = Field(default_factory=list)


class LimiterPolicy(_Model):
    """Adaptive concurrency per backend (see docs/limiter.md for the algorithms)."""

    # `slo` (the default): steered by the classes' objectives (queues[].slo); `sluice`:
    # the same rules with a fixed TPOT target instead (the default before issue 19).
    algorithm: Literal["sluice", "slo", "vegas-seed", "gradient", "fixed"] = "slo"
    min_limit: int = Field(default=1, ge=1)
    max_limit: int = Field(default=256, ge=1)
    initial_limit: int = Field(default=8, ge=1)
    # For `fixed`: the cap. For the others: ignored.
    fixed_limit: int = Field(default=32, ge=1)

    @model_validator(mode="after")
    def _ordered(self) -> LimiterPolicy:
        if not self.min_limit <= self.initial_limit <= self.max_limit:
            raise ValueError("need minLimit <= initialLimit <= maxLimit")
        return self

    def core_settings(self) -> core.LimiterSettings:
        return core.LimiterSettings(
            self.algorithm, self.min_limit, self.max_limit, self.initial_limit, self.fixed_limit
        )


class Reserved(_Model):
    p0: float = Field(default=0.2, ge=0, lt=1)


class DispatcherPolicy(_Model):
    # Share of each backend's limit that only P0 may use.
    reserved: Reserved = Reserved()
    # A P1 request waiting longer than this is served as if it were P0 (anti-starvation).
    aging_after: Duration = 10.0
    # A queued request too large for any backend's KV budget unless that backend is empty
    # holds back the requests behind it (its class, and lower classes on its model's
    # backends) while a backend drains for it, for at most this long; then it waits
    # without holding anyone back (docs/overload.md).
    hold_for_large: Duration = 2.0


class PressurePolicy(_Model):
    # fast-reject queues refuse new requests at or above this pressure (0..1).
    fast_reject_above: float = Field(default=0.8, ge=0, le=1)
    # early-drop-on-pressure queues start predicting waits at or above this pressure.
    shed_above: float = Field(default=0.5, ge=0, le=1)
    # The longest Retry-After sent (sustained overload answers with it).
    max_retry_after: Duration = Field(default=60.0, ge=1, le=60)


class RetryAfterPolicy(_Model):
    """How a refusal's Retry-After is chosen (docs/overload.md, "Retry-After").

    `booking` (default): the refusal books a return slot in its class's forecast capacity;
    the client that comes back in it with the booking the 429 gave it is admitted ahead of
    fresh arrivals of its class. `drain`: the drain-time estimate Sluice used before
    (no booking). `fixed`: always `fixedSeconds` (no booking; for comparisons)."""

    rule: Literal["booking", "drain", "fixed"] = "booking"
    fixed_seconds: Duration = Field(default=60.0, ge=0.1, le=60)
    # The environment variable holding a secret shared by the gateway replicas, which sign
    # booking tokens with it so that a return is recognised by whichever replica it lands
    # on. A name, never the secret itself. Unset: each process signs with its own random
    # key (a return is recognised by the replica that refused it).
    secret_env: str | None = Field(default=None, pattern=r"^[A-Za-z_][A-Za-z0-9_]*$")


class ScraperPolicy(_Model):
    interval: Duration = Field(default=0.25, gt=0)
    # Metrics older than this are stale: control falls back to latency only.
    stale_after: Duration = Field(default=2.0, gt=0)


class ServerPolicy(_Model):
    max_body_bytes: int = Field(default=4 * 1024 * 1024, ge=1024)
    # A client must send its whole request within this time.
    read_timeout: Duration = Field(default=30.0, gt=0)
    # A new connection must send a complete request head (line and headers) within this.
    header_timeout: Duration = Field(default=10.0, gt=0)
    # A kept-alive connection must send its next request head within this of the previous
    # answer; one idle this long is closed.
    idle_timeout: Duration = Field(default=60.0, gt=0)
    # Upstream call cap when the client sets no deadline.
    upstream_timeout: Duration = Field(default=600.0, gt=0)
    # SIGTERM: stop accepting, let open streams finish for at most this long.
    shutdown_grace: Duration = Field(default=30.0, ge=0)
    # Client connections one gateway process holds open at once; past it a new connection
    # is answered 503 too_many_connections (Retry-After: 1) and closed (docs/operations.md).
    max_connections: int = Field(default=4096, ge=1)


class BreakerPolicy(_Model):
    """Circuit breakers of non-core features (docs/degradation.md)."""

    window: Duration = Field(default=10.0, gt=0)
    error_rate: float = Field(default=0.5, gt=0, le=1)
    min_requests: int = Field(default=10, ge=1)
    # Open when the feature's requests have been shed for overload this long without a break.
    shed_for: Duration = Field(default=5.0, gt=0)
    open_for: Duration = Field(default=5.0, gt=0)
    # Non-core features answer with their fallback while fewer than this share of the
    # backends is in service: lost capacity is kept for core traffic.
    degrade_below_healthy: float = Field(default=0.75, ge=0, le=1)


class RedisPolicy(_Model):
    url: str


class FleetPolicy(_Model):
    """The gateway processes in front of these backends, when the operator knows them."""

    # How many gateway replicas (pods, hosts: each one `sluice serve`, whatever its
    # --workers) send to these backends. Each process then claims 1 / (gateways x
    # workers) of every backend's KV room from its first request, instead of starting at
    # 1/16 and learning its part from the scrapes (docs/limiter.md, "Shared backends").
    # With `redis:`, Redis's count of the live processes replaces it. None: learned.
    gateways: int | None = Field(default=None, ge=1)


class ExposePolicy(_Model):
    """What a client without the admin key may learn of the gateway's insides."""

    # X-Sluice-Backend on every answer: the name of the backend that served it.
    backend_names: bool = False
    # 502/504 texts and mid-stream error events: the backend's name and the transport
    # error (host:port, the HTTP client's own words). Off: the kind of failure only.
    error_details: bool = False
    # /dashboard/state without the admin key: `summary` (classes, and backends as
    # "backend 1".."n", no tenant names) or `full` (what the admin key sees).
    dashboard: Literal["summary", "full"] = "summary"


class Policy(_Model):
    queues: tuple[QueuePolicy, ...] = DEFAULT_QUEUES
    tenants: tuple[Tenant, ...] = ()
    backends: tuple[Backend, ...] = ()
    admin: Admin = Admin()
    features: tuple[Feature, ...] = ()
    limiter: LimiterPolicy = LimiterPolicy()
    dispatcher: DispatcherPolicy = DispatcherPolicy()
    pressure: PressurePolicy = PressurePolicy()
    retry_after: RetryAfterPolicy = RetryAfterPolicy()
    scraper: ScraperPolicy = ScraperPolicy()
    server: ServerPolicy = ServerPolicy()
    breakers: BreakerPolicy = BreakerPolicy()
    redis: RedisPolicy | None = None
    fleet: FleetPolicy = FleetPolicy()
    expose: ExposePolicy = ExposePolicy()
    # A policy under which no client (`tenants`) or no admin (`admin`) can get in is
    # refused (at start, by check-config, on reload) unless it is listed here.
    allow_lockout: tuple[Literal["tenants", "admin"], ...] = ()

    @model_validator(mode="after")
    def _consistent(self) -> Policy:
        prios = sorted(q.priority for q in self.queues)
        if prios != [0, 1, 2]:
            raise ValueError("queues must define priorities 0, 1 and 2 exactly once each")
        _unique("tenants", [t.name for t in self.tenants])
        _unique("backends", [b.name for b in self.backends])
        _unique("features", [f.name for f in self.features])
        digests = [d for t in self.tenants for d in t.key_digests()]
        if len(digests) != len(set(digests)):
            raise ValueError("an API key is given to more than one tenant")
        backend_names = {b.name for b in self.backends}
        for f in self.features:
            if f.fallback and f.fallback.backend and f.fallback.backend not in backend_names:
                raise ValueError(
                    f"feature {f.name!r}: fallback backend {f.fallback.backend!r} is not "
                    "among the backends"
                )
        return self

    def queue(self, priority: int) -> QueuePolicy:
        return next(q for q in self.queues if q.priority == priority)

    def objectives(self) -> dict[int, Objective]:
        """Each class's latency objective, by priority."""
        return {q.priority: q.slo for q in self.queues}

    def core_settings(self) -> core.CoreSettings:
        """What the core reads of this policy, as its own values (core/settings.py):
        made once per load, by whoever hands the policy to the Controller."""
        d, p, r = self.dispatcher, self.pressure, self.retry_after
        return core.CoreSettings(
            queues=tuple(self.queue(prio).core_settings() for prio in sorted(CLASS_NAMES)),
            tenants=tuple(t.core_settings() for t in self.tenants),
            limiter=self.limiter.core_settings(),
            dispatcher=core.DispatcherSettings(d.reserved.p0, d.aging_after, d.hold_for_large),
            pressure=core.PressureSettings(p.fast_reject_above, p.shed_above, p.max_retry_after),
            retry_after=core.RetryAfterSettings(r.rule, r.fixed_seconds),
        )


def _unique(what: str, names: list[str]) -> None:
    seen: set[str] = set()
    for n in names:
        if n in seen:
            raise ValueError(f"{what}: name {n!r} appears twice")
        seen.add(n)


class ConfigError(Exception):
    """A policy that cannot be used; `errors` lists 'field.path: reason' lines."""

    def __init__(self, source: str, errors: list[str]) -> None:
        super().__init__(f"{source}: " + "; ".join(errors))
        self.source = source
        self.errors = errors


def _policy_mapping(doc: Any, source: str) -> dict[str, Any]:
    """Accept a whole Kubernetes ConfigMap (data.policy.yaml) or the bare policy."""
    if doc is None:
        return {}
    if not isinstance(doc, dict):
        raise ConfigError(source, ["(top level): expected a mapping"])
    if doc.get("kind") == "ConfigMap":
        data = doc.get("data") or {}
        text = data.get("policy.yaml")
        if not isinstance(text, str):
            raise ConfigError(source, ["data.policy.yaml: missing in the ConfigMap"])
        try:
            inner = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            raise ConfigError(source, [f"data.policy.yaml: not valid YAML ({exc})"]) from exc
        return _policy_mapping(inner, source)
    return doc


def _format_errors(exc: ValidationError) -> list[str]:
    lines = []
    for err in exc.errors():
        path = ".".join(str(p) for p in err["loc"]) or "(top level)"
        msg = err["msg"].removeprefix("Value error, ")
        lines.append(f"{path}: {msg}")
    return lines


def parse_policy(text: str, source: str = "<policy>") -> Policy:
    try:
        doc = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(source, [f"(file): not valid YAML ({exc})"]) from exc
    mapping = _policy_mapping(doc, source)
    try:
        return Policy.model_validate(mapping)
    except ValidationError as exc:
        raise ConfigError(source, _format_errors(exc)) from exc


def missing_environment(policy: Policy) -> list[str]:
    """What a policy needs from the process's environment and does not find there, as
    'field.path: reason' lines. `sluice serve` refuses to start (and a reload is refused)
    on any; `sluice check-config` only warns, as it may run where the secrets are not."""
    return [
        f"backends.{i}.apiKeyEnv: the environment variable {b.api_key_env} "
        "(the backend's API key) is not set or empty"
        for i, b in enumerate(policy.backends)
        if b.api_key_env and not os.environ.get(b.api_key_env)
    ]


def lockout_errors(policy: Policy, current: Policy | None = None) -> list[str]:
    """Why the policy would lock everybody out, as 'field.path: reason' lines: no tenant
    with a key (every client answered 401), or, replacing `current` that had admin keys,
    no admin key (/admin/* answered 401 until a restart). `allowLockout` lists what the
    policy means to lock out."""
    errors = []
    if "tenants" not in policy.allow_lockout and not any(
        t.api_keys or t.api_key_sha256 for t in policy.tenants
    ):
        errors.append(
            "tenants: no tenant has an API key, so every client would be answered 401; "
            "add tenants, or write `allowLockout: [tenants]` if that is meant"
        )
    had_admin = current is not None and bool(current.admin.key_digests())
    if had_admin and "admin" not in policy.allow_lockout and not policy.admin.key_digests():
        errors.append(
            "admin: the policy in force has admin keys and this one none, so /admin/* "
            "would be answered 401 until a restart; keep a key, or write "
            "`allowLockout: [admin]` if that is meant"
        )
    return errors


def policy_secrets(policy: Policy) -> list[str]:
    """Every secret the policy names or points to: plaintext tenant and admin keys, the
    backends' keys (from the environment), the Redis URL's password. For the log's
    redaction (gateway/logs.py), never for display."""
    out = [k for t in policy.tenants for k in t.api_keys] + list(policy.admin.api_keys)
    for b in policy.backends:
        if b.api_key_env and (value := os.environ.get(b.api_key_env)):
            out.append(value)
    if policy.redis is not None:
        try:
            password = urlsplit(policy.redis.url).password
        except ValueError:
            password = None
        if password:
            out += [password, unquote(password)]
    return out


def load_policy(path: str | Path) -> Policy:
    """Read and validate a policy file. Every way it can fail, whatever the cause, is a
    ConfigError with a readable reason: never another exception."""
    p = Path(path)
    try:
        raw = p.read_bytes()
    except OSError as exc:
        raise ConfigError(str(p), [f"(file): cannot read ({exc.strerror})"]) from exc
    if not raw.strip():
        # an editor or `kubectl cp` caught between truncating the file and writing it
        raise ConfigError(str(p), ["(file): the file is empty"])
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        reason = f"not UTF-8 text (byte 0x{raw[exc.start]:02x} at offset {exc.start})"
        raise ConfigError(str(p), [f"(file): {reason}"]) from None
    try:
        return parse_policy(text, str(p))
    except ConfigError:
        raise
    except Exception as exc:  # a YAML or validation surprise (deep nesting, ...)
        reason = f"cannot be read as a policy ({type(exc).__name__}: {exc})"
        raise ConfigError(str(p), [f"(file): {reason[:500]}"]) from None
