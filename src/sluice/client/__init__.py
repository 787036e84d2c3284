"""Sluice client SDK: httpx transports that retry refused LLM requests without causing a
retry storm. Stands alone: depends on httpx and the standard library only.

    import httpx, openai
    from sluice.client import RetryTransport

    client = openai.OpenAI(
        base_url="http://127.0.0.1:8080/v1", api_key="sk-...",
        http_client=httpx.Client(transport=RetryTransport()), max_retries=0,
    )
"""

from sluice.client.budget import RetryBudget
from sluice.client.deadline import DEADLINE_HEADERS, request_time_budget
from sluice.client.policy import DEFAULT_RETRY_STATUSES, RETRY_AFTER_STATUSES, RetryPolicy
from sluice.client.retry_after import parse_retry_after
from sluice.client.transport import (
    BOOKING_HEADER,
    RETRY_HEADER,
    AsyncRetryTransport,
    RetryStats,
    RetryTransport,
)

__all__ = [
    "BOOKING_HEADER",
    "DEADLINE_HEADERS",
    "DEFAULT_RETRY_STATUSES",
    "RETRY_AFTER_STATUSES",
    "RETRY_HEADER",
    "AsyncRetryTransport",
    "RetryBudget",
    "RetryPolicy",
    "RetryStats",
    "RetryTransport",
    "parse_retry_after",
    "request_time_budget",
]
