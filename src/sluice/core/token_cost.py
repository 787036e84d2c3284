"""Token-aware cost: a request's estimated KV footprint in tokens.

    footprint = ceil(prompt + sequences * output)
    prompt    = the shell's estimate from the text * ratio[model], where ratio is an EWMA
                of usage.prompt_tokens / estimate reported by the backends (1 until known)
    output    = min(max_tokens, mean[tenant, model]) where mean is an EWMA of the
                completion tokens of that tenant's finished requests on that model; until
                one is known, first_output_fraction * max_tokens (per sequence: a
                request with n = 4 runs four; usage reports their sum, learned per one)

The footprint is what the fair queues charge (deficit round robin on tokens) and what the
KV budget of a backend counts.

The model also keeps, per model, an EWMA of the footprints of the requests being admitted
(`note_admitted`, `admitted_footprint`; alpha 0.1 like the others, so about the last ten
admissions): the mix that will be dispatched next, which the `sluice` limiter reads so
that its limit follows a change of mix as it arrives rather than once the requests
admitted before it have been dispatched.
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
        admitted_alpha: float | None = None,
    ) -> None:
        self.alpha = alpha
        self.first_output_fraction = first_output_fraction
        self.min_ratio = min_ratio
        self.max_ratio = max_ratio
        self._prompt_ratio: dict[str, Ewma] = {}
        self._output_mean: dict[tuple[str, str], Ewma] = {}
        # per admission, like the other EWMAs here unless told otherwise
        self.admitted_alpha = alpha if admitted_alpha is None else admitted_alpha
        self._admitted: dict[str, Ewma] = {}  # per model
        self._admitted_any = Ewma(self.admitted_alpha)  # all models (backends serving any)

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

    def footprint(
        self, tenant: str, model: str, prompt_estimate: int, max_tokens: int, sequences: int = 1
    ) -> int:
        prompt = self.prompt_tokens(model, prompt_estimate)
        output = self.expected_output(tenant, model, max_tokens)
        return footprint_tokens(prompt, max(1, sequences) * output)

    def observe(
        self,
        tenant: str,
        model: str,
        prompt_estimate: int,
        prompt_tokens: int | None,
        completion_tokens: int | None,
        sequences: int = 1,
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
            e.update(completion_tokens / max(1, sequences))

    def note_admitted(self, model: str, footprint: float) -> None:
        """A request of this footprint was admitted (it will be dispatched)."""
        e = self._admitted.get(model)
        if e is None:
            e = self._admitted[model] = Ewma(self.admitted_alpha)
        e.update(footprint)
        self._admitted_any.update(footprint)

    def admitted_footprint(self, models: frozenset[str]) -> float | None:
        """EWMA of the admitted footprints for a backend serving `models` (empty: any
        model): the largest over its models; None before any admission."""
        if not models:
            return self._admitted_any.value
        out: float | None = None
        for model in models:
            e = self._admitted.get(model)
            if e is not None and e.value is not None and (out is None or e.value > out):
                out = e.value
        return out


def footprint_tokens(prompt: float, output: float) -> int:
    """A request's KV footprint in whole tokens (at least 1): its corrected prompt plus its
    expected output, rounded up; a float error of under 1e-6 does not add a token."""
    return max(1, math.ceil(prompt + output - 1e-6))
