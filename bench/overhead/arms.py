"""The benchmark's arms: how to start each proxy in front of the fake upstream.

Every arm runs in its own process group on a free 127.0.0.1 port. `start_arm` returns a
running `Arm` (its root pid is what the runner reads CPU time from) or raises `ArmSkipped`
with a reason the runner prints.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
VENV_BIN = (
    REPO / ".venv" / "bin" if (REPO / ".venv" / "bin").is_dir() else Path(sys.executable).parent
)
MODEL = "bench-model"
API_KEY = "sk-demo-p0"  # a P0 tenant key in examples/policy.yaml and in our fallback config

# Arm name -> label in tables. "passthrough" in --arms means the chosen stack (see run.py).
LABELS: dict[str, str] = {
    "direct": "direct (no proxy)",
    "aiohttp": "bare aiohttp.web",
    "uvicorn": "bare ASGI on uvicorn",
    "granian": "bare ASGI on granian",
    "nginx": "nginx",
    "sluice": "sluice",
    # another build of sluice (--baseline-bin), e.g. main's tree before a change, side by
    # side with this one in the same run
    "sluice-before": "sluice (before)",
}


class ArmSkipped(Exception):
    """The arm cannot run here; the message says why."""


@dataclass
class Arm:
    name: str
    url: str
    proc: subprocess.Popen[bytes] | None = None
    workdir: Path | None = None
    log: Path | None = None
    notes: list[str] = field(default_factory=list)
    mode: str | None = None  # set when the arm serves one mode only (sluice)

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def stop(self, grace: float = 5.0) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        # Our own process group (start_new_session): the root and the workers it forked.
        os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(grace)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _spawn(cmd: list[str], log: Path, cwd: Path | None = None, env: dict[str, str] | None = None):
    out = log.open("wb")
    return subprocess.Popen(
        cmd,
        cwd=cwd,
        env={**os.environ, **(env or {})},
        stdout=out,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        start_new_session=True,
    )


def _tail(path: Path | None, lines: int = 8) -> str:
    if path is None or not path.exists():
        return ""
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


def wait_ready(arm: Arm, deadline_s: float = 30.0) -> None:
    """Poll with a real completion request until the arm answers 200 (or give up)."""
    body = b'{"model": "%s", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}'
    req_body = body % MODEL.encode()
    headers = {"Content-Type": "application/json", "Authorization": f"Bearer {API_KEY}"}
    deadline = time.monotonic() + deadline_s
    last = "no answer"
    while time.monotonic() < deadline:
        if arm.proc is not None and arm.proc.poll() is not None:
            raise ArmSkipped(f"{arm.name} exited with {arm.proc.returncode}:\n{_tail(arm.log)}")
        req = urllib.request.Request(
            arm.url + "/v1/chat/completions", data=req_body, headers=headers
        )
        try:
            with urllib.request.urlopen(req, timeout=2) as resp:
                if resp.status == 200:
                    return
                last = f"HTTP {resp.status}"
        except urllib.error.HTTPError as exc:
            last = f"HTTP {exc.code}: {exc.read()[:200]!r}"
        except OSError as exc:
            last = str(exc)
        time.sleep(0.1)  # polling a port that is not open yet: nothing to await
    arm.stop()
    raise ArmSkipped(f"{arm.name} not ready within {deadline_s:.0f}s ({last})\n{_tail(arm.log)}")


def start_upstream(tmp: Path) -> Arm:
    port = free_port()
    log = tmp / "upstream.log"
    cmd = [sys.executable, str(HERE / "upstream.py"), "--port", str(port)]
    arm = Arm("upstream", f"http://127.0.0.1:{port}", _spawn(cmd, log), tmp, log)
    wait_ready(arm)
    return arm


NGINX_CONF = """\
{user}
worker_processes {workers};
daemon off;
master_process on;
pid {tmp}/nginx.pid;
error_log {tmp}/nginx-error.log warn;
events {{ worker_connections 4096; }}
http {{
    access_log off;
    client_body_temp_path {tmp}/body;
    proxy_temp_path {tmp}/proxy;
    fastcgi_temp_path {tmp}/fastcgi;
    uwsgi_temp_path {tmp}/uwsgi;
    scgi_temp_path {tmp}/scgi;
    client_body_buffer_size 1m;
    client_max_body_size 16m;
    keepalive_requests 1000000;
    upstream backend {{
        server {upstream};
        keepalive 128;
        keepalive_requests 1000000;
    }}
    server {{
        listen 127.0.0.1:{port};
        location / {{
            proxy_pass http://backend;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_buffering off;
            proxy_read_timeout 300s;
        }}
    }}
}}
"""


def _start_nginx(tmp: Path, upstream: str, port: int, workers: int) -> Arm:
    nginx = shutil.which("nginx") or (
        "/usr/sbin/nginx" if Path("/usr/sbin/nginx").exists() else None
    )
    if nginx is None:
        raise ArmSkipped("nginx is not installed (apt-get install -y nginx)")
    conf = tmp / "nginx.conf"
    conf.write_text(
        NGINX_CONF.format(
            user="user root;" if os.geteuid() == 0 else "",
            workers=workers,
            tmp=tmp,
            upstream=upstream.removeprefix("http://"),
            port=port,
        )
    )
    log = tmp / "nginx.log"
    proc = _spawn([nginx, "-c", str(conf), "-p", str(tmp), "-e", str(tmp / "nginx-error.log")], log)
    return Arm(
        "nginx",
        f"http://127.0.0.1:{port}",
        proc,
        tmp,
        log,
        [f"{workers} worker process(es), proxy_buffering off, upstream keepalive"],
    )


def sluice_serve_available(exe: Path) -> str | None:
    """None when `sluice serve` takes --port/--backend/--config, else why not."""
    if not exe.exists():
        return f"{exe} not found (run `make install`)"
    try:
        out = subprocess.run([str(exe), "serve", "--help"], capture_output=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"`sluice serve --help` failed: {exc}"
    text = out.stdout.decode(errors="replace") + out.stderr.decode(errors="replace")
    missing = [opt for opt in ("--port", "--backend", "--config") if opt not in text]
    if out.returncode != 0 or missing:
        return f"`sluice serve` is not available yet (missing {', '.join(missing) or 'verb'})"
    return None


FALLBACK_POLICY = """\
# Written by bench/overhead: one P0 tenant, the default queues.
queues:
  - {priority: 0, name: realtime-interactive, maxQueueSize: 200, timeout: 8s, dropPolicy: tail}
  - {priority: 1, name: agent-workflow, maxQueueSize: 500, timeout: 15s,
     dropPolicy: early-drop-on-pressure}
  - {priority: 2, name: batch-extraction, maxQueueSize: 1000, timeout: 60s,
     dropPolicy: fast-reject}
tenants:
  - {name: bench, apiKeys: [sk-demo-p0], priority: 0, weight: 1}
"""


def sluice_config(tmp: Path, override: Path | None, concurrency: int) -> tuple[Path, str]:
    """The policy for the sluice arm, and a note on what it changed.

    By default examples/policy.yaml with every feature on, but with the adaptive limiter
    starting at least at 2x the load's concurrency: the fake upstream has no capacity
    limit, so this arm measures the gateway's overhead, not its limiter's ramp-up (the
    limiter still runs and may move). An explicit --sluice-config is used as it is.
    """
    if override is not None:
        return override, f"config {override} as given"
    example = REPO / "examples" / "policy.yaml"
    policy: dict[str, Any] = (
        yaml.safe_load(example.read_text()) if example.exists() else yaml.safe_load(FALLBACK_POLICY)
    )
    source = "examples/policy.yaml" if example.exists() else "a minimal built-in policy"
    limiter = policy.get("limiter")
    note = f"{source}"
    if isinstance(limiter, dict):
        start = max(int(limiter.get("initialLimit", 1)), 2 * concurrency)
        limiter["initialLimit"] = start
        limiter["maxLimit"] = max(int(limiter.get("maxLimit", start)), start)
        note += f", limiter.initialLimit={start}"
    path = tmp / "policy.yaml"
    path.write_text(yaml.safe_dump(policy, sort_keys=False))
    return path, note


def start_arm(
    name: str,
    tmp: Path,
    upstream: str,
    *,
    nginx_workers: int = 1,
    sluice_cfg: Path | None = None,
    sluice_bin: Path = VENV_BIN / "sluice",
    baseline_bin: Path | None = None,
    concurrency: int = 16,
    prefix: list[str] | None = None,
    ready_s: float = 30.0,
) -> Arm:
    """Start one arm and wait until it answers. `prefix` runs the Python arms (aiohttp,
    sluice) under another program (instructions.py: valgrind)."""
    wrap = list(prefix or [])
    tmp = tmp / name
    tmp.mkdir(parents=True, exist_ok=True)
    if name == "direct":
        return Arm("direct", upstream)
    port = free_port()
    log = tmp / f"{name}.log"
    if name == "aiohttp":
        cmd = [
            sys.executable,
            str(HERE / "passthrough_aiohttp.py"),
            "--port",
            str(port),
            "--upstream",
            upstream,
        ]
        arm = Arm(name, f"http://127.0.0.1:{port}", _spawn(wrap + cmd, log), tmp, log)
    elif name == "uvicorn":
        cmd = [
            str(VENV_BIN / "uvicorn"),
            "--http",
            "httptools",
            "--loop",
            "uvloop",
            "--no-access-log",
            "--log-level",
            "warning",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "passthrough_asgi:app",
        ]
        proc = _spawn(cmd, log, cwd=HERE, env={"BENCH_UPSTREAM": upstream})
        arm = Arm(name, f"http://127.0.0.1:{port}", proc, tmp, log)
    elif name == "granian":
        cmd = [
            str(VENV_BIN / "granian"),
            "--interface",
            "asgi",
            "--loop",
            "uvloop",
            "--workers",
            "1",
            "--http",
            "1",
            "--no-access-log",
            "--log-level",
            "warning",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "passthrough_asgi:app",
        ]
        proc = _spawn(cmd, log, cwd=HERE, env={"BENCH_UPSTREAM": upstream, "PYTHONPATH": str(HERE)})
        arm = Arm(name, f"http://127.0.0.1:{port}", proc, tmp, log)
    elif name == "nginx":
        arm = _start_nginx(tmp, upstream, port, nginx_workers)
    elif name in ("sluice", "sluice-before"):
        if name == "sluice-before":
            if baseline_bin is None:
                raise ArmSkipped("sluice-before needs --baseline-bin (another sluice build)")
            sluice_bin = baseline_bin
        why = sluice_serve_available(sluice_bin)
        if why:
            raise ArmSkipped(why)
        cfg, note = sluice_config(tmp, sluice_cfg, concurrency)
        cmd = [
            str(sluice_bin),
            "serve",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--backend",
            upstream,
            "--config",
            str(cfg),
        ]
        arm = Arm(name, f"http://127.0.0.1:{port}", _spawn(wrap + cmd, log), tmp, log, [note])
    else:
        raise ArmSkipped(f"unknown arm {name!r} (known: {', '.join(LABELS)})")
    wait_ready(arm, ready_s)
    return arm
