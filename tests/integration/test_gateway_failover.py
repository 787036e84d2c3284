"""Backend failure, with real processes: one of two simulated backends is killed mid-run.
Core traffic moves to the survivor, non-core features answer from their fallback, nobody
is left hanging; when the backend is back, traffic returns to it."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

import httpx
import pytest
from conftest import SimFactory
from gateway_proc import start_gateway

pytestmark = pytest.mark.integration

POLICY = """
tenants:
  - {name: chat-app, apiKeys: [sk-demo-p0], priority: 0}
  - {name: agents, apiKeys: [sk-demo-p1], priority: 1}
features:
  - name: summarize
    core: false
    fallback: {static: "Summaries are paused for a moment; please try again shortly."}
expose: {backendNames: true}  # the test reads X-Sluice-Backend
"""


@dataclass
class Result:
    kind: str  # "core" or "noncore"
    sent: float
    done: float
    status: int
    backend: str | None
    fallback: str | None
    error: str | None = None


async def test_kill_one_backend_then_restart(sim_factory: SimFactory) -> None:
    a = sim_factory("--profile", "tiny", "--seed", "1")
    b = sim_factory("--profile", "tiny", "--seed", "2")
    a_port = a.url.rsplit(":", 1)[1]
    gw = start_gateway([a.url, b.url], POLICY)
    results: list[Result] = []
    t_start = time.monotonic()
    stop_at = t_start + 9.0

    async def one(client: httpx.AsyncClient, kind: str) -> None:
        headers = {"Authorization": "Bearer sk-demo-p0"}
        body = {
            "model": "sluice-sim",
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 24,
            "ignore_eos": True,
        }
        if kind == "noncore":
            headers = {"Authorization": "Bearer sk-demo-p1", "X-Sluice-Feature": "summarize"}
        sent = time.monotonic()
        try:
            r = await client.post(gw.url + "/v1/chat/completions", json=body, headers=headers)
            results.append(
                Result(
                    kind,
                    sent,
                    time.monotonic(),
                    r.status_code,
                    r.headers.get("X-Sluice-Backend"),
                    r.headers.get("X-Sluice-Fallback"),
                )
            )
        except httpx.HTTPError as exc:
            results.append(Result(kind, sent, time.monotonic(), 0, None, None, repr(exc)))

    async with httpx.AsyncClient(timeout=10.0, limits=httpx.Limits(max_connections=200)) as client:
        tasks: list[asyncio.Task[None]] = []
        killed_at = restarted_at = 0.0
        while time.monotonic() < stop_at:
            now = time.monotonic() - t_start
            if not killed_at and now >= 2.0:
                a.kill()
                killed_at = time.monotonic()
            if killed_at and not restarted_at and now >= 5.0:
                a = sim_factory("--profile", "tiny", "--seed", "1", "--port", a_port)
                restarted_at = time.monotonic()
            tasks.append(asyncio.create_task(one(client, "core")))
            tasks.append(asyncio.create_task(one(client, "noncore")))
            await asyncio.sleep(0.025)
        await asyncio.gather(*tasks)
    gw.stop()

    # Nobody hangs: every request was answered, well within its 10 s client timeout.
    assert not [r for r in results if r.error], [r.error for r in results if r.error][:3]
    assert max(r.done - r.sent for r in results) < 8.0

    outage = [r for r in results if killed_at + 1.0 <= r.sent < restarted_at]
    core = [r for r in outage if r.kind == "core"]
    noncore = [r for r in outage if r.kind == "noncore"]
    assert core and noncore
    assert all(r.status == 200 and r.backend == "backend-1" for r in core), {
        (r.status, r.backend) for r in core
    }
    assert all(r.status == 200 and r.fallback == "static" for r in noncore), {
        (r.status, r.fallback) for r in noncore
    }
    # From the kill on, core requests all succeed (retried on the survivor when needed).
    after_kill = [r for r in results if r.kind == "core" and r.sent >= killed_at]
    assert all(r.status == 200 for r in after_kill), sorted({r.status for r in after_kill})

    # Traffic returns to the restarted backend within 5 s.
    back = [r.sent for r in results if r.backend == "backend-0" and r.sent > restarted_at]
    assert back, "no request reached the restarted backend"
    returned_after = min(back) - restarted_at
    first_fallback = min(
        r.done for r in results if r.kind == "noncore" and r.fallback and r.sent >= killed_at
    )
    print(
        f"\nfallback {1000 * (first_fallback - killed_at):.0f} ms after the kill; "
        f"traffic back {returned_after:.2f} s after the restart"
    )
    assert returned_after <= 5.0


MODEL_FALLBACK_POLICY = """
tenants:
  - {name: agents, apiKeys: [sk-demo-p1], priority: 1}
backends:
  - {name: main, url: "MAIN"}
  - {name: small, url: "SMALL"}
features:
  - name: summarize
    core: false
    fallback: {backend: small}
"""


def test_non_core_feature_falls_back_to_a_small_model(sim_factory: SimFactory) -> None:
    main = sim_factory("--profile", "tiny", "--model", "big-model")
    small = sim_factory("--profile", "tiny", "--model", "small-model")
    policy = MODEL_FALLBACK_POLICY.replace("MAIN", main.url).replace("SMALL", small.url)
    gw = start_gateway([], policy)
    headers = {"Authorization": "Bearer sk-demo-p1", "X-Sluice-Feature": "summarize"}
    body = {"model": "big-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}
    try:
        ok = httpx.post(gw.url + "/v1/chat/completions", json=body, headers=headers)
        assert ok.status_code == 200 and "X-Sluice-Fallback" not in ok.headers
        assert ok.json()["model"] == "big-model"

        main.kill()
        deadline = time.monotonic() + 5
        while True:
            r = httpx.post(gw.url + "/v1/chat/completions", json=body, headers=headers)
            if r.headers.get("X-Sluice-Fallback") == "model":
                break
            assert time.monotonic() < deadline, (r.status_code, r.text)
        assert r.status_code == 200
        assert r.json()["model"] == "small-model"
        assert r.json()["choices"][0]["message"]["content"]
        # The breaker's state is exported.
        m = gw.metrics()
        assert m['sluice_breaker_open{kind="feature",name="summarize"}'] == 1.0
        assert (
            m['sluice_breaker_transitions_total{kind="feature",name="summarize",state="open"}'] >= 1
        )
    finally:
        gw.stop()
