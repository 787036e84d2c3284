"""Abort on every streaming route: clients of the Responses and Messages streams close
after their first token's event (the Responses stream's opening events come before the
engine has scheduled the request, so they do not say it is running); the backend aborts
each request (its KV blocks freed) within 100 ms of its client's close, as on chat
(test_gateway_proxy.py)."""

from __future__ import annotations

import pytest
from abort_timing import abort_delays
from conftest import SimFactory
from gateway_proc import start_gateway

pytestmark = pytest.mark.integration

MODEL = "sluice-sim"
POLICY_BIG_LIMIT = """
tenants:
  - {name: chat-app, apiKeys: [sk-demo-p0], priority: 0}
limiter: {algorithm: fixed, fixedLimit: 200, maxLimit: 256}
"""
ROUTES = {
    "responses": (
        "/v1/responses",
        {"model": MODEL, "input": "Tell me about rivers.", "max_output_tokens": 2000},
        {"Authorization": "Bearer sk-demo-p0"},
        '"type":"response.output_text.delta"',
    ),
    "messages": (
        "/v1/messages",
        {
            "model": MODEL,
            "max_tokens": 2000,
            "messages": [{"role": "user", "content": "Tell me about rivers."}],
        },
        {"x-api-key": "sk-demo-p0", "anthropic-version": "2023-06-01"},
        '"type":"content_block_delta"',
    ),
}


@pytest.mark.parametrize("route", sorted(ROUTES))
async def test_abort_reaches_the_backend_within_100ms(sim_factory: SimFactory, route: str) -> None:
    sim = sim_factory(
        "--profile", "tiny", "--kv-blocks", "4096", "--max-num-seqs", "128", "--speed", "1"
    )
    gw = start_gateway([sim.url], POLICY_BIG_LIMIT)
    path, body, headers, first_token = ROUTES[route]
    body = {**body, "stream": True, "ignore_eos": True}
    try:
        delays = await abort_delays(
            sim,
            gw,
            path,
            body,
            headers,
            lambda line: line.startswith("data: {") and first_token in line,
        )
    finally:
        gw.stop()
    assert delays[-1] <= 0.100, f"an abort came {delays[-1] * 1000:.0f} ms after its close"
