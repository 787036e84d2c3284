"""Token-aware cost: a request's estimated KV footprint in tokens.

    footprint = ceil(prompt + output)
    prompt    = the shell's estimate from the text * ratio[model], where ratio is an EWMA
                of usage.prompt_tokens / estimate reported by the backends (1 until known)
    output    = min(max_tokens, mean[tenant, model]) where mean is an EWMA of the
                completion tokens of that tenant's finished requests on that model; until
                one is known, first_output_fraction * max_tokens

The footprint is what the fair queues charge (deficit round robin on tokens) and what the
KV budget of a backend counts.
"""

from __future__ import annotations

import math

from sluice.core.ewma import Ewma


class TokenCostModel:
    def __init__(
        self,
        *,
        alpha: float = 0.1,
        first_output_fraction: float = 0.5,
        min_ratio: float = 0.25,
        max_ratio: float = 4.0,
    ) -> None:
        self.alpha = alpha
        self.first_output_fraction = first_output_fraction
        self.min_ratio = min_ratio
        self.max_ratio = max_ratio
        self._prompt_ratio: dict[str, Ewma] = {}
        self._output_mean: dict[tuple[str, str], Ewma] = {}

    def prompt_ratio(self, model: str) -> float:
        e = self._prompt_ratio.get(model)
        return 1.0 if e is None or e.value is None else e.value

    def prompt_tokens(self, model: str, estimate: int) -> float:
        return estimate * self.prompt_ratio(model)

    def expected_output(self, tenant: str, model: str, max_tokens: int) -> float:
        e = self._output_mean.get((tenant, model))
        if e is None or e.value is None:
            return self.first_output_fraction * max_tokens
        return min(float(max_tokens), e.value)

    def footprint(self, tenant: str, model: str, prompt_estimate: int, max_tokens: int) -> int:
        prompt = self.prompt_tokens(model, prompt_estimate)
        return max(1, math.ceil(prompt + self.expected_output(tenant, model, max_tokens)))

    def observe(
        self,
        tenant: str,
        model: str,
        prompt_estimate: int,
        prompt_tokens: int | None,
        completion_tokens: int | None,
    ) -> None:
        """Learn from a finished request's reported usage (None = not reported)."""
        if prompt_tokens is not None and prompt_tokens > 0 and prompt_estimate > 0:
            ratio = min(self.max_ratio, max(self.min_ratio, prompt_tokens / prompt_estimate))
            e = self._prompt_ratio.get(model)
            if e is None:
                e = self._prompt_ratio[model] = Ewma(self.alpha)
            e.update(ratio)
        if completion_tokens is not None and completion_tokens >= 0:
            key = (tenant, model)
            e = self._output_mean.get(key)
            if e is None:
                e = self._output_mean[key] = Ewma(self.alpha)
            e.update(float(completion_tokens))
