"""The settings the core reads: its own small frozen values, made from the validated
policy at the edge (`Policy.core_settings()` in config.py), once per load.

The core never sees the policy file's models: no API key, backend URL or server timeout
reaches it, only what its decisions use. Defaults live in the policy (config.py), not
here: a value of the core's is always the policy's, converted.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Literal

CLASS_NAMES = {0: "P0", 1: "P1", 2: "P2"}


class DropPolicy(StrEnum):
    """A class queue's drop policy (core/drop_policy.py has the rules)."""

    TAIL = "tail"
    EARLY_DROP_ON_PRESSURE = "early-drop-on-pressure"
    FAST_REJECT = "fast-reject"


@dataclass(frozen=True, slots=True)
class Objective:
    """A class's latency objective, in seconds (docs/limiter.md, "`slo`"); None: not
    stated. `ttft`: to the first token; `tpot`: per output token after it (the request's
    mean); `done_within`: to the last token. Counted from the arrival at the gateway."""

    ttft: float | None = None
    tpot: float | None = None
    done_within: float | None = None


@dataclass(frozen=True, slots=True)
class QueueSettings:
    """One class queue: its size, its wait, its drop policy and its objective."""

    priority: int
    name: str
    max_queue_size: int
    timeout: float
    drop_policy: DropPolicy
    objective: Objective


@dataclass(frozen=True, slots=True)
class TenantLimits:
    """A tenant's quotas (0: no limit); no keys, no class: the core's quotas read these."""

    name: str
    tokens_per_minute: int = 0
    requests_per_minute: int = 0
    max_concurrency: int = 0


@dataclass(frozen=True, slots=True)
class LimiterSettings:
    """Which limiter each backend runs and its bounds (docs/limiter.md)."""

    algorithm: Literal["sluice", "slo", "vegas-seed", "gradient", "fixed"]
    min_limit: int
    max_limit: int
    initial_limit: int
    fixed_limit: int  # `fixed`'s cap


@dataclass(frozen=True, slots=True)
class DispatcherSettings:
    reserved_p0: float  # share of each backend's limit only P0 may use
    aging_after: float  # a P1 request waiting longer is served as P0
    hold_for_large: float  # the longest a too-large request holds others back


@dataclass(frozen=True, slots=True)
class PressureSettings:
    fast_reject_above: float
    shed_above: float
    max_retry_after: float  # the longest Retry-After sent


@dataclass(frozen=True, slots=True)
class RetryAfterSettings:
    rule: Literal["booking", "drain", "fixed"]
    fixed_seconds: float  # `fixed`'s answer


@dataclass(frozen=True, slots=True)
class CoreSettings:
    """Everything of the policy the Controller reads; `queues` in priority order."""

    queues: tuple[QueueSettings, ...]
    tenants: tuple[TenantLimits, ...]
    limiter: LimiterSettings
    dispatcher: DispatcherSettings
    pressure: PressureSettings
    retry_after: RetryAfterSettings

    def queue(self, priority: int) -> QueueSettings:
        return self.queues[priority]

    def objectives(self) -> dict[int, Objective]:
        """Each class's latency objective, by priority."""
        return {q.priority: q.objective for q in self.queues}
