"""Hot reload of the policy, the way Kubernetes updates a ConfigMap volume (an atomic swap
of the `..data` symlink): new queue sizes take effect within 2 s under load with no
request lost; an invalid file is refused and the old policy keeps serving."""

from __future__ import annotations

import asyncio
import os
import time
from collections import Counter
from pathlib import Path

import httpx
import pytest
from conftest import SimFactory
from gateway_proc import start_gateway

pytestmark = pytest.mark.integration

POLICY = """
queues:
  - {{priority: 0, name: realtime-interactive, maxQueueSize: 200, timeout: 8s, dropPolicy: tail}}
  - {{priority: 1, name: agent-workflow, maxQueueSize: {p1_size}, timeout: 15s, dropPolicy: tail}}
  - {{priority: 2, name: batch-extraction, maxQueueSize: 1000, timeout: 60s,
     dropPolicy: fast-reject}}
tenants:
  - {{name: agents, apiKeys: [sk-demo-p1], priority: 1}}
admin: {{apiKeys: [sk-demo-admin]}}
limiter: {{algorithm: fixed, fixedLimit: 4}}
dispatcher: {{reserved: {{p0: 0.0}}}}
"""


class ConfigMapVolume:
    """A folder laid out like a mounted ConfigMap: policy.yaml -> ..data/policy.yaml."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.version = 0

    def write(self, text: str) -> Path:
        self.version += 1
        target = self.root / f"..v{self.version}"
        target.mkdir()
        (target / "policy.yaml").write_text(text)
        tmp = self.root / "..data_tmp"
        os.symlink(target.name, tmp)
        os.replace(tmp, self.root / "..data")  # the atomic swap
        link = self.root / "policy.yaml"
        if not link.is_symlink():
            os.symlink("..data/policy.yaml", link)
        return link


async def _burst(url: str, n: int) -> Counter[str]:
    async with httpx.AsyncClient(timeout=30, limits=httpx.Limits(max_connections=n)) as c:

        async def one() -> str:
            r = await c.post(
                url + "/v1/chat/completions",
                headers={"Authorization": "Bearer sk-demo-p1"},
                json={
                    "model": "sluice-sim",
                    "max_tokens": 30,
                    "ignore_eos": True,
                    "messages": [{"role": "user", "content": "hi"}],
                },
            )
            if r.status_code == 200:
                return "ok"
            return f"{r.status_code}:{r.json()['error']['code']}"

        return Counter(await asyncio.gather(*(one() for _ in range(n))))


async def test_queue_size_change_applies_under_load(
    sim_factory: SimFactory, tmp_path: Path
) -> None:
    sim = sim_factory("--profile", "tiny")
    volume = ConfigMapVolume(tmp_path)
    path = volume.write(POLICY.format(p1_size=2))
    gw = start_gateway([sim.url], None, "--config", str(path))
    try:
        before = await _burst(gw.url, 40)
        assert before["429:queue_full"] > 0, before

        # Reload while a burst is in flight: nothing it holds may be lost.
        burst = asyncio.create_task(_burst(gw.url, 40))
        await asyncio.sleep(0.05)
        volume.write(POLICY.format(p1_size=500))
        changed_at = time.monotonic()
        during = await burst
        assert set(during) <= {"ok", "429:queue_full"}, during

        # Within 2 s the new size is in force: a burst is queued whole.
        while True:
            after = await _burst(gw.url, 40)
            if after == Counter({"ok": 40}):
                break
            assert time.monotonic() - changed_at < 2.0, after
        took = time.monotonic() - changed_at
        print(f"\nnew queue size in force {took:.2f} s after the swap")
        m = gw.metrics()
        assert m['sluice_policy_reloads_total{result="ok"}'] >= 1
    finally:
        gw.stop()


async def test_invalid_policy_is_refused_and_old_one_serves(
    sim_factory: SimFactory, tmp_path: Path
) -> None:
    sim = sim_factory("--profile", "tiny")
    volume = ConfigMapVolume(tmp_path)
    path = volume.write(POLICY.format(p1_size=500))
    gw = start_gateway([sim.url], None, "--config", str(path))
    try:
        volume.write(POLICY.format(p1_size=500).replace("dropPolicy: tail", "dropPolicy: x"))
        deadline = time.monotonic() + 5
        while gw.metrics().get('sluice_policy_reloads_total{result="refused"}', 0) < 1:
            assert time.monotonic() < deadline, "the invalid file was not noticed"
            await asyncio.sleep(0.05)
        assert gw.metrics()["sluice_policy_last_reload_ok"] == 0
        assert await _burst(gw.url, 20) == Counter({"ok": 20})

        async with httpx.AsyncClient() as c:
            denied = await c.post(gw.url + "/admin/reload")
            assert denied.status_code == 401
            r = await c.post(
                gw.url + "/admin/reload", headers={"Authorization": "Bearer sk-demo-admin"}
            )
            assert r.status_code == 422
            assert any("dropPolicy" in e for e in r.json()["errors"])
            state = await c.get(
                gw.url + "/admin/state", headers={"Authorization": "Bearer sk-demo-admin"}
            )
            assert state.status_code == 200
            assert state.json()["controller"]["classes"]["P1"]["name"] == "agent-workflow"
        assert any("refused" in line for line in gw.output)
    finally:
        gw.stop()
