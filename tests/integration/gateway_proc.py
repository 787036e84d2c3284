"""Start a real `sluice serve` process on 127.0.0.1 for integration tests.

gw = start_gateway(["http://127.0.0.1:8001"], policy_yaml=None)
gw.url; gw.metrics(); gw.stop()
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import httpx
import orjson

from sluice.bench.prom_text import parse_metrics

_READY = re.compile(r"Sluice listening on (http://\S+)")
_SRC = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", "src"))
REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
EXAMPLE_POLICY = os.path.join(REPO, "examples", "policy.yaml")


async def controller_state(
    s: aiohttp.ClientSession, url: str, admin_key: str = "sk-demo-admin"
) -> dict[str, Any]:
    """The controller's part of the gateway's `/admin/state`."""
    async with s.get(url + "/admin/state", headers={"Authorization": f"Bearer {admin_key}"}) as r:
        return orjson.loads(await r.read())["controller"]  # type: ignore[no-any-return]


@dataclass
class GatewayProcess:
    proc: subprocess.Popen[str]
    url: str
    output: list[str] = field(default_factory=list)

    def metrics(self) -> dict[str, float]:
        return parse_metrics(httpx.get(self.url + "/metrics", timeout=5).text)

    def access_records(self) -> dict[str, dict[str, Any]]:
        """The access records written so far (JSON log lines), by request id."""
        found = {}
        for line in list(self.output):
            if line.startswith('{"ts":') and '"sluice.access"' in line:
                record = orjson.loads(line)
                found[record.get("request_id")] = record
        return found

    def stop(self, timeout: float = 10.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        return self.proc.wait()


def start_gateway(
    backends: list[str],
    policy_yaml: str | None = None,
    *extra: str,
    timeout: float = 30.0,
    wait_ready: bool = True,
) -> GatewayProcess:
    """`sluice serve --port 0 --backend URL...` with the example policy, or with the given
    policy text; waits until /readyz says a backend is healthy."""
    config = EXAMPLE_POLICY
    if policy_yaml is not None:
        fd, config = tempfile.mkstemp(suffix=".yaml", prefix="sluice-policy-")
        with os.fdopen(fd, "w") as f:
            f.write(policy_yaml)
    env = dict(os.environ, PYTHONPATH=_SRC, PYTHONUNBUFFERED="1")
    cmd = [sys.executable, "-m", "sluice.cli", "serve", "--port", "0", "--config", config]
    for b in backends:
        cmd += ["--backend", b]
    proc = subprocess.Popen(
        [*cmd, *extra], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
    )
    output: list[str] = []
    ready = threading.Event()

    def pump() -> None:
        assert proc.stdout is not None
        for line in iter(proc.stdout.readline, ""):
            output.append(line.rstrip("\n"))
            if _READY.search(line):
                ready.set()

    threading.Thread(target=pump, daemon=True).start()
    deadline = time.monotonic() + timeout
    while not ready.wait(0.02):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            proc.wait()
            raise RuntimeError("sluice serve did not start:\n" + "\n".join(output))
    match = next(m for line in output if (m := _READY.search(line)))
    gw = GatewayProcess(proc=proc, url=match.group(1), output=output)
    while wait_ready:
        try:
            if httpx.get(gw.url + "/readyz", timeout=1).status_code == 200:
                break
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            gw.stop()
            raise RuntimeError("sluice serve never became ready:\n" + "\n".join(output))
        time.sleep(0.02)
    return gw
