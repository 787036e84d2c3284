"""Stage 6: the request's feature (X-Sluice-Feature, else its model's or its tenant's)
and, for a non-core feature, its breaker: while the breaker is open the request is
answered by the feature's fallback (stages/fallback.py) and never queued."""

from __future__ import annotations

from sluice.gateway.features import Features
from sluice.gateway.request_context import RequestContext


class FeatureBreaker:
    def __init__(self, features: Features) -> None:
        self.features = features

    def run(self, ctx: RequestContext) -> bool:
        """Whether the request goes to its fallback now."""
        features = self.features
        feature = features.resolve(
            ctx.request.headers.get("X-Sluice-Feature"), ctx.tenant, ctx.parsed.model
        )
        if feature is None:
            return False
        ctx.feature = feature
        ctx.feature_name = feature.name
        breaker = ctx.breaker = features.breaker(feature)
        if breaker is not None and not breaker.allow():
            ctx.fields.update(outcome="fallback", feature=feature.name)
            return True
        return False
