"""Peer arms: the gateways people deploy instead of Sluice, modelled from their own source
with their defaults (each module's docstring cites the files and versions it follows).

* `gie`: the Gateway API Inference Extension / llm-d endpoint picker, default admission;
* `gie-flow`: the same with its flow control layer;
* `litellm`: LiteLLM proxy, `max_parallel_requests` per deployment at the sweet spot;
* `envoy`: Envoy's adaptive concurrency filter (gradient controller).

Their clients retry as those gateways' users' clients do: the `openai` Python SDK
(`OPENAI_SDK_RETRY`, read from openai/openai-python @e43b422, v3.3.1,
`src/openai/_base_client.py` `_calculate_retry_timeout` / `_should_retry` and
`src/openai/_constants.py`): 2 retries (3 attempts); 408, 409, 429, 5xx, timeouts and
connection errors are retried; a Retry-After (`retry-after-ms`, else `retry-after`) of
0 < x <= 120 s is waited exactly (no jitter), one above 120 s is not retried at all;
without one, min(0.5 s x 2^n, 8 s) x (1 - 0.25 U), n the retries so far.
"""

from __future__ import annotations

from functools import partial
from typing import Any

from sluice.bench.harness import ArmSpec
from sluice.bench.peers.envoy import EnvoyGateway
from sluice.bench.peers.gie import REFRESH_METRICS_INTERVAL_S, GieGateway
from sluice.bench.peers.litellm import LiteLLMGateway
from sluice.bench.scenario import Retry

PEER_ARMS = ("gie", "gie-flow", "litellm", "envoy")

OPENAI_SDK_RETRY = Retry(
    max_attempts=3,  # DEFAULT_MAX_RETRIES = 2
    follow_retry_after=True,
    on_timeout=True,
    spread=0.0,  # a Retry-After is waited exactly
    backoff=0.5,  # INITIAL_RETRY_DELAY
    backoff_max=8.0,  # MAX_RETRY_DELAY
    backoff_jitter=-0.25,  # jitter = 1 - 0.25 * random()
    max_retry_after=120.0,  # MAX_RETRY_AFTER_DELAY
)


def peer_factory(name: str, *, cap: int, seed: int = 0) -> Any:
    """`factory(clock, backends)` building the peer gateway `name`; `cap` is LiteLLM's
    `max_parallel_requests` per deployment."""
    if name == "gie":
        return partial(GieGateway, flow_control=False)
    if name == "gie-flow":
        return partial(GieGateway, flow_control=True)
    if name == "litellm":
        return partial(LiteLLMGateway, cap=cap)
    if name == "envoy":
        return partial(EnvoyGateway, seed=seed)
    raise ValueError(f"unknown peer arm {name!r}; peers: {', '.join(PEER_ARMS)}")


def peer_arm(name: str, *, cap: int, seed: int = 0) -> ArmSpec:
    return ArmSpec(
        name,
        gateway=peer_factory(name, cap=cap, seed=seed),
        gateway_argv=("--arm", name, "--cap", str(cap), "--seed", str(seed)),
        client_retry=OPENAI_SDK_RETRY,
        scrape_interval_s=REFRESH_METRICS_INTERVAL_S if name.startswith("gie") else None,
    )
