"""Stage 10: what an attempt's result means beyond the core: the shared-quota ticket's
usage, the feature breaker's success or failure, and the access record's outcome."""

from __future__ import annotations

from sluice.core.types import Outcome
from sluice.gateway.relay import RelayResult
from sluice.gateway.request_context import RequestContext

_BREAKER_FAILURES = (Outcome.ERROR, Outcome.TIMEOUT, Outcome.OVERLOADED)


def account(ctx: RequestContext, result: RelayResult) -> str:
    """The outcome's name (metrics, access record)."""
    outcome = result.outcome
    ticket = ctx.ticket
    if ticket is not None:
        ticket.finished(outcome, result.prompt_tokens, result.completion_tokens)
    breaker = ctx.breaker
    if breaker is not None:
        if outcome in _BREAKER_FAILURES:
            breaker.record_failure()
        elif outcome is Outcome.OK:
            breaker.record_success()
    fields = ctx.fields
    # str() of a StrEnum is its value, without enum's Python-level `.value`
    name = fields["outcome"] = str(outcome)
    if result.completion_tokens is not None:
        fields["completion_tokens"] = result.completion_tokens
    return name
