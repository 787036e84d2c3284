"""Features (docs/degradation.md): which feature a request belongs to, and the breaker that
decides when a non-core feature answers with its fallback instead of queueing."""

from __future__ import annotations

import logging
from collections.abc import Callable

from sluice.config import Feature, Policy, Tenant
from sluice.core.circuit_breaker import BreakerSettings, BreakerState, CircuitBreaker
from sluice.core.clock import Clock

log = logging.getLogger("sluice.features")


class Features:
    """The policy's features and their breakers. A reload (`apply`) keeps the breaker of
    every non-core feature that is still there, in whatever state it is (open, half-open,
    held open for lost capacity), with the new settings: a breaker that a reload closed
    would send a failing feature's traffic back at the backends, and `sluice_breaker_open`
    would not know."""

    def __init__(
        self,
        policy: Policy,
        clock: Clock,
        on_change: Callable[[str, str], None] | None = None,
        on_removed: Callable[[str], None] | None = None,
    ) -> None:
        self._clock = clock
        self._on_change = on_change
        self._on_removed = on_removed
        self.breakers: dict[str, CircuitBreaker] = {}
        self.apply(policy)

    def apply(self, policy: Policy) -> None:
        b = policy.breakers
        settings = BreakerSettings(
            window_s=b.window,
            error_rate=b.error_rate,
            min_requests=b.min_requests,
            shed_for_s=b.shed_for,
            open_for_s=b.open_for,
        )
        on_change = self._on_change

        def changed(name: str, state: BreakerState) -> None:
            _log_change(name, state)
            if on_change is not None:
                on_change(name, state.value)

        breakers: dict[str, CircuitBreaker] = {}
        for f in policy.features:
            if f.core or f.fallback is None:
                continue
            breaker = self.breakers.get(f.name)
            if breaker is None:
                breaker = CircuitBreaker(f"feature:{f.name}", self._clock, settings, changed)
            else:
                breaker.settings = settings
            breakers[f.name] = breaker
        gone = [b for name, b in self.breakers.items() if name not in breakers]
        self._degrade_below = b.degrade_below_healthy
        self._by_name = {f.name: f for f in policy.features}
        self._by_model = {m: f for f in policy.features for m in f.models}
        self._by_tenant = {t: f for f in policy.features for t in f.tenants}
        self.breakers = breakers
        for breaker in gone:
            if self._on_removed is not None:
                self._on_removed(breaker.name)

    def resolve(self, header: str | None, tenant: Tenant, model: str) -> Feature | None:
        """X-Sluice-Feature wins; else a feature that names the model, else the tenant. An
        unknown feature name is served as core traffic (a typo must not shed requests)."""
        if header:
            return self._by_name.get(header.strip())
        return self._by_model.get(model) or self._by_tenant.get(tenant.name)

    def set_healthy_fraction(self, fraction: float) -> None:
        """Hold non-core features on their fallback while too much capacity is lost."""
        degraded = fraction < self._degrade_below
        for breaker in self.breakers.values():
            breaker.hold_open(degraded)

    def breaker(self, feature: Feature | None) -> CircuitBreaker | None:
        return self.breakers.get(feature.name) if feature is not None else None


def _log_change(name: str, state: BreakerState) -> None:
    level = logging.WARNING if state is BreakerState.OPEN else logging.INFO
    log.log(level, "circuit breaker %s is now %s", name, state.value)
