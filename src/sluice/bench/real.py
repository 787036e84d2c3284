"""A benchmark against real processes on 127.0.0.1: N `sluice sim` simulators, a
`sluice serve` gateway per gateway arm (its policy in a temporary YAML file), and an
open-loop aiohttp load generator in this process that replays the same seeded workload
as virtual time, shrunk by the scenario's `real` section.

Each arm gets fresh simulators. Every client request is a streaming `/v1/completions`
with a prompt of token ids (exactly `prompt_tokens` long), `max_tokens` = its output
length and `ignore_eos`, so the simulator generates exactly the workload's output. The
client behaves as in virtual time: deadline (X-Request-Timeout, then it disconnects),
cancel after N tokens (it disconnects), retries after 429 at Retry-After (retry-after-ms)
with or without jitter, back-off after a failed connection.

The machine's CPU busy fraction is sampled from /proc/stat every second during each arm's
load (not the processes' start-up); a run where it reached 90 % is flagged as saturated
(its figures do not count). Each arm also records the CPU its simulators, gateway and load
generator used, what other work used meanwhile, and how late arrivals were sent."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import yaml

from sluice.bench.arms import arm_spec
from sluice.bench.cuts import add_cuts_sample, cuts_so_far
from sluice.bench.harness import (
    CANCELLED,
    FAILED,
    OK,
    REJECTED,
    TIMEOUT,
    UNFINISHED,
    WAITING_RETRY,
    ArmRun,
    ArmSpec,
    ReqState,
    plan_retry,
)
from sluice.bench.metrics import arm_results
from sluice.bench.procfs import CpuSampler, cpu_summary, process_cpu_s
from sluice.bench.prom_text import first, series
from sluice.bench.returns import note_refusal
from sluice.bench.runner import arrivals_per_s, make_plan
from sluice.bench.scenario import CLASSES, Scenario
from sluice.bench.workload import ClientRequest
from sluice.client.retry_after import parse_window
from sluice.client.transport import BOOKING_HEADER
from sluice.config import Policy
from sluice.core.snapshot import ControllerSnapshot

SAMPLE_INTERVAL_S = 0.5
START_TIMEOUT_S = 20.0
LEAD_S = 0.5  # between "everything is up" and the first arrival
RETURN_MARGIN_S = 15.0  # the drain covers the longest return (Retry-After and jitter) and this

Progress = Callable[[str, float], None]


def longest_return_wait(workload: list[ClientRequest], retry_after_s: float, arm: ArmSpec) -> float:
    """The longest a client told `retry_after_s` waits before it comes back (`retry_delay`):
    the Retry-After times 1 + its jitter's spread, or plus its return window (at most 1 s)
    when it was given one. 0 when no client follows such an answer."""
    longest = 0.0
    for req in workload:
        r = req.retry if arm.client_retry is None else arm.client_retry
        if r.max_attempts < 2 or not r.follow_retry_after:
            continue
        if r.max_retry_after is not None and retry_after_s > r.max_retry_after:
            continue
        window = 1.0 if r.spread > 0 else 0.0
        longest = max(longest, retry_after_s * (1.0 + r.spread), retry_after_s + window)
    return longest


_PORT_LINE = re.compile(r"http://127\.0\.0\.1:(\d+)")
_PROFILE_FLAGS = {
    "num_gpu_blocks": "--kv-blocks",
    "block_size": "--block-size",
    "max_num_seqs": "--max-num-seqs",
    "max_num_batched_tokens": "--max-num-batched-tokens",
    "max_model_len": "--max-model-len",
}


# -- processes --------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Proc:
    """A child process whose output a thread keeps reading (a full pipe would block it);
    the last lines are kept for error messages."""

    def __init__(self, name: str, argv: list[str]) -> None:
        self.name = name
        self.argv = argv
        self.lines: collections.deque[str] = collections.deque(maxlen=200)
        self._cond = threading.Condition()
        self.popen = subprocess.Popen(
            argv,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            text=True,
        )
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.popen.stdout is not None
        for line in self.popen.stdout:
            with self._cond:
                self.lines.append(line.rstrip("\n"))
                self._cond.notify_all()
        with self._cond:
            self._cond.notify_all()

    def output(self) -> str:
        return "\n".join(self.lines)[-800:]

    def wait_for_line(self, pattern: re.Pattern[str], timeout: float) -> re.Match[str]:
        """Wait until a line of its output matches (the simulator prints its port)."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                for line in self.lines:
                    m = pattern.search(line)
                    if m:
                        return m
                if self.popen.poll() is not None and not self._reader.is_alive():
                    raise RuntimeError(f"{self.name} exited: {self.output()}")
                left = deadline - time.monotonic()
                if left <= 0:
                    raise RuntimeError(
                        f"{self.name} did not start in {timeout:.0f} s: {self.output()}"
                    )
                self._cond.wait(min(left, 0.5))

    def stop(self) -> None:
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait(timeout=5)
        self._reader.join(timeout=5)


def _sluice(*args: str) -> list[str]:
    return [sys.executable, "-m", "sluice.cli", *args]


def start_sims(scenario: Scenario) -> tuple[list[Proc], list[str]]:
    spec = scenario.spec.backends
    flags: list[str] = []
    for key, value in spec.overrides.items():
        name = "".join("_" + c.lower() if c.isupper() else c for c in key)
        if name in _PROFILE_FLAGS:
            flags += [_PROFILE_FLAGS[name], str(int(value))]
    procs: list[Proc] = []
    urls: list[str] = []
    try:
        for i in range(spec.count):
            p = Proc(
                f"sim-{i}",
                _sluice(
                    "sim",
                    "--profile",
                    spec.profile,
                    "--speed",
                    str(spec.speed),
                    "--port",
                    "0",
                    "--seed",
                    str(i),
                    *flags,
                ),
            )
            procs.append(p)
        for p in procs:
            m = p.wait_for_line(_PORT_LINE, START_TIMEOUT_S)
            urls.append(f"http://127.0.0.1:{m.group(1)}")
    except BaseException:
        for p in procs:
            p.stop()
        raise
    return procs, urls


ADMIN_KEY = "sk-bench-admin"  # the bench reads each limiter's state from /admin/state


def policy_yaml(policy: Policy, urls: list[str]) -> str:
    doc = policy.model_dump(mode="json", by_alias=True, exclude_none=True)
    doc["backends"] = [{"name": f"b{i}", "url": u} for i, u in enumerate(urls)]
    doc.setdefault("admin", {}).setdefault("apiKeys", []).append(ADMIN_KEY)
    return yaml.safe_dump(doc, sort_keys=False)


async def controller_state(
    session: aiohttp.ClientSession, gateway: str
) -> ControllerSnapshot | None:
    """The gateway's controller snapshot (limits, limiters' state), or None."""
    try:
        async with session.get(
            f"{gateway}/admin/state",
            headers={"Authorization": f"Bearer {ADMIN_KEY}"},
            timeout=aiohttp.ClientTimeout(total=2.0),
        ) as r:
            if r.status != 200:
                return None
            doc = orjson.loads(await r.read())
    except (aiohttp.ClientError, TimeoutError, orjson.JSONDecodeError):
        return None
    controller = doc.get("controller")
    return ControllerSnapshot.from_dict(controller) if isinstance(controller, dict) else None


async def wait_ready(session: aiohttp.ClientSession, url: str, within_s: float) -> None:
    deadline = time.monotonic() + within_s
    last = ""
    while time.monotonic() < deadline:
        try:
            async with session.get(url, timeout=aiohttp.ClientTimeout(total=1.0)) as r:
                if r.status == 200:
                    return
                last = f"HTTP {r.status}"
        except (aiohttp.ClientError, TimeoutError) as exc:
            last = str(exc) or type(exc).__name__
        await asyncio.sleep(0.1)
    raise RuntimeError(f"{url} not ready after {within_s:.0f} s ({last})")


# -- metrics ----------------------------------------------------------------------------


async def _get_text(session: aiohttp.ClientSession, url: str) -> str | None:
    try:
        async with session.get(url, timeout=aiohttp.ClientTimeout(total=2.0)) as r:
            if r.status != 200:
                return None
            return await r.text()
    except (aiohttp.ClientError, TimeoutError):
        return None


# -- one arm ----------------------------------------------------------------------------


class _ArmRunner:
    def __init__(
        self,
        scenario: Scenario,
        arm: ArmSpec,
        reqs: list[ReqState],
        sims: list[str],
        gateway: str | None,
        model: str,
        seed: int,
        drain: float,
        pids: dict[str, list[int]],
        progress: Progress | None,
    ) -> None:
        self.scenario = scenario
        self.arm = arm
        self.reqs = reqs
        self.sims = sims
        self.gateway = gateway
        self.model = model
        self.seed = seed
        self.drain = drain
        self.pids = pids
        self.cpu = CpuSampler()
        self.cpu_use: dict[str, Any] = {}
        self.late: list[float] = []  # how late the load generator sent each arrival
        self.progress = progress
        self.n = len(sims)
        self.rr = 0
        self.t0 = 0.0
        self.horizon = scenario.duration + drain
        self.settled = 0  # requests whose outcome is known
        self.rejections: dict[str, dict[str, int]] = {c: {} for c in CLASSES}
        self.rejected_total: dict[str, int] = {}
        self.first_rejection_at: dict[str, float | None] = dict.fromkeys(CLASSES)
        self.inflight = [0] * self.n
        self.received = 0
        self.series: dict[str, Any] = {
            "t": [],
            "limit": [[] for _ in sims],
            "inflight": [[] for _ in sims],
            "running": [[] for _ in sims],
            "kv_usage": [[] for _ in sims],
            "waiting": [[] for _ in sims],
            "queued": {c: [] for c in CLASSES},
            "rejected_cumulative": {},
            "pressure": [],
        }
        self.preempt_last = [0.0] * self.n
        self.preemption_times: list[float] = []
        self.dispatch_log: list[tuple[float, int]] = []
        self.gen_total = [0.0] * self.n
        # engine counters, at the start and as last scraped (see `recomputed_tokens`)
        self.counters0: list[dict[str, float]] = [{} for _ in sims]
        self.counters: list[dict[str, float]] = [{} for _ in sims]
        self.controller_snapshot: ControllerSnapshot | None = None
        # the gateway's last /metrics that answered: a sample whose scrape fails (a
        # starved gateway past the 2 s timeout) repeats it, so every column keeps one
        # value per sample time
        self.gateway_metrics: dict[Any, float] | None = None

    def now(self) -> float:
        return time.monotonic() - self.t0

    async def run(self) -> float:
        connector = aiohttp.TCPConnector(limit=0, force_close=False)
        async with aiohttp.ClientSession(connector=connector) as session:
            self.session = session
            # baseline counters (fresh simulators, but be exact)
            await self._scrape_sims(record=False)
            self.cpu = CpuSampler()  # the load only: not the processes' start-up
            proc0 = self._process_cpu()
            bench0 = time.process_time()
            self.t0 = time.monotonic() + LEAD_S
            loop = asyncio.get_running_loop()
            tasks: list[asyncio.Task[None]] = []

            def start(r: ReqState) -> None:
                tasks.append(asyncio.create_task(self._client(r)))

            starts = [
                loop.call_at(loop.time() + LEAD_S + r.spec.arrival, start, r) for r in self.reqs
            ]
            monitor = asyncio.create_task(self._monitor())
            duration = self.scenario.duration
            horizon = self.horizon
            try:
                while True:
                    await asyncio.sleep(0.25)
                    t = self.now()
                    if self.progress is not None:
                        self.progress(f"real: {self.arm.name}", min(1.0, t / horizon))
                    if t >= duration and self.settled == len(self.reqs):
                        break
                    if t >= horizon:
                        break
            finally:
                for h in starts:
                    h.cancel()
                for task in tasks:
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
                monitor.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await monitor
            self.cpu_use = self._cpu_use(proc0, bench0)
            await self._scrape_sims(record=True)
            if self.gateway is not None and self.arm.policy is not None:
                self.controller_snapshot = await controller_state(session, self.gateway)
            return self.now()

    def recomputed_tokens(self) -> int | None:
        """Tokens the engines computed again after preemptions, from their counters:
        every token an engine step scheduled (`vllm:iteration_tokens_total`'s sum) is a
        prompt token prefilled once (`vllm:prompt_tokens`), a decode step (each generated
        token but a request's first, which its prefill yields: `generation_tokens` minus
        the TTFT histogram's count), or computed again. Like virtual time's figure, an
        upper bound: the prefill of a request aborted before its first token counts too.
        None when an engine does not export these counters."""
        total = 0.0
        for now, then in zip(self.counters, self.counters0, strict=True):
            if not now or not then:
                return None
            d = {k: now[k] - then[k] for k in now}
            total += d["iteration"] - d["prompt"] - (d["generation"] - d["first_tokens"])
        return max(0, round(total))

    def _process_cpu(self) -> dict[str, float]:
        return {
            name: sum(process_cpu_s(pid, reaped_children=True) or 0.0 for pid in pids)
            for name, pids in self.pids.items()
        }

    def _cpu_use(self, proc0: dict[str, float], bench0: float) -> dict[str, Any]:
        """The machine's busy fraction during the load, and the CPU seconds each part of
        the bench spent on it (the load generator is one of them)."""
        wall = max(1e-9, self.now() + LEAD_S)
        used = {k: v - proc0[k] for k, v in self._process_cpu().items()}
        used["bench"] = time.process_time() - bench0
        # what else ran on the machine meanwhile (other work makes a run saturate too)
        used["other"] = max(0.0, self.cpu.busy_s() - sum(used.values()))
        late = sorted(self.late)
        return {
            **self.cpu.summary(),
            "busy_samples": self.cpu.samples,
            "wall_s": round(wall, 2),
            "cpu_s": {k: round(v, 2) for k, v in used.items()},
            "cores_used_mean": {k: round(v / wall, 3) for k, v in used.items()},
            "arrival_late_p50_s": _r(late[len(late) // 2] if late else None),
            "arrival_late_p99_s": _r(late[int(0.99 * (len(late) - 1))] if late else None),
            "arrival_late_max_s": _r(late[-1] if late else None),
        }

    # -- the client -------------------------------------------------------------------

    async def _client(self, r: ReqState) -> None:
        # asyncio runs a timer that is due within its clock's resolution early: a send
        # 0.1 ms before its arrival time is on time, not -0.1 ms late
        self.late.append(max(0.0, self.now() - r.spec.arrival))
        try:
            while True:
                outcome, retry_after = await self._attempt(r)
                if outcome in (OK, CANCELLED):
                    self._finish(r, outcome)
                    return
                delay = plan_retry(
                    r, outcome, retry_after, self.seed, self.now(), self.arm.client_retry
                )
                if delay is not None:
                    r.tokens = 0
                    r.first_token_at = r.last_token_at = None
                    r.state = WAITING_RETRY
                    if self.now() + delay >= self.horizon:
                        # Told to come back after the end of the run: the last answer
                        # stands (as in virtual time), and the run need not wait for it.
                        r.outcome = outcome
                        self.settled += 1
                        return
                    await asyncio.sleep(delay)
                    r.state = 0
                    continue
                self._finish(r, outcome)
                return
        except asyncio.CancelledError:
            if r.end_at is None:
                # told to come back after the end of the run: the last answer stands
                waiting = r.state == WAITING_RETRY and r.retried_at
                r.outcome = r.retried_at[-1][1] if waiting else UNFINISHED  # type: ignore[index]
            raise

    def _finish(self, r: ReqState, outcome: str) -> None:
        r.outcome = outcome
        r.end_at = self.now()
        self.settled += 1

    def _reject(self, r: ReqState, code: str, retry_after: float | None, headers: Any) -> None:
        note_refusal(
            r,
            self.now(),
            code,
            retry_after,
            headers.get(BOOKING_HEADER),
            (parse_window(headers) or 0.0) if headers.get(BOOKING_HEADER) else 0.0,
        )
        cls = r.spec.class_name
        counts = self.rejections[cls]
        counts[code] = counts.get(code, 0) + 1
        self.rejected_total[code] = self.rejected_total.get(code, 0) + 1
        if self.first_rejection_at[cls] is None:
            self.first_rejection_at[cls] = self.now()
        r.rejections.append(code)

    def _target(self, r: ReqState) -> tuple[str, dict[str, str], int]:
        spec = r.spec
        headers = {"Content-Type": "application/json"}
        if spec.deadline is not None:
            headers["X-Request-Timeout"] = f"{spec.deadline:g}"
        if r.attempt:
            headers["X-Sluice-Retry"] = str(r.attempt)
        if r.booking is not None:
            headers[BOOKING_HEADER] = r.booking
            r.booking = None
        if self.gateway is None:
            b = self.rr % self.n
            self.rr += 1
            return self.sims[b], headers, b
        if self.arm.gateway is not None:  # a peer proxy: the class is its priority
            headers["X-Bench-Priority"] = str(spec.priority)
            return self.gateway, headers, -1
        key = "sk-bench-all" if self.arm.single_class else f"sk-bench-{spec.tenant}"
        headers["Authorization"] = f"Bearer {key}"
        return self.gateway, headers, -1

    async def _attempt(self, r: ReqState) -> tuple[str, float | None]:
        spec = r.spec
        base, headers, b = self._target(r)
        r.backend = b
        body = orjson.dumps(
            {
                "model": self.model,
                "prompt": [7] * spec.prompt_tokens,
                "max_tokens": spec.output_tokens,
                "ignore_eos": True,
                "stream": True,
            }
        )
        r.sent_at = self.now()
        if b >= 0:
            self.inflight[b] += 1
        try:
            async with asyncio.timeout(spec.deadline):
                async with self.session.post(
                    f"{base}/v1/completions", data=body, headers=headers
                ) as resp:
                    if resp.status in (429, 503):
                        payload = await resp.read()
                        code = _error_code(payload) or f"http_{resp.status}"
                        retry_after = _retry_after(resp.headers)
                        self._reject(r, code, retry_after, resp.headers)
                        return REJECTED, retry_after
                    if resp.status != 200:
                        await resp.read()
                        return FAILED, None
                    # sent to a backend (the answer's head is back): for the hindsight
                    self.dispatch_log.append((self.now(), spec.priority))
                    if r.ra_retry:
                        r.admitted_after_ra += 1
                    async for line in resp.content:
                        if not line.startswith(b"data: "):
                            continue
                        if b'"text":"' in line:
                            t = self.now()
                            if r.first_token_at is None:
                                r.first_token_at = t
                            r.last_token_at = t
                            r.tokens += 1
                            self.received += 1
                            if spec.cancel_after is not None and r.tokens >= spec.cancel_after:
                                return CANCELLED, None
                        elif b'"error"' in line:
                            r.wasted += r.tokens
                            return FAILED, None
                    if r.tokens >= spec.output_tokens:
                        return OK, None
                    r.wasted += r.tokens
                    return FAILED, None
        except TimeoutError:
            r.wasted += r.tokens
            return TIMEOUT, None
        except (aiohttp.ClientError, ConnectionError):
            r.wasted += r.tokens
            return FAILED, None
        finally:
            if b >= 0:
                self.inflight[b] -= 1

    # -- monitoring -------------------------------------------------------------------

    async def _monitor(self) -> None:
        next_cpu = time.monotonic() + 1.0
        while True:
            await asyncio.sleep(SAMPLE_INTERVAL_S)
            if time.monotonic() >= next_cpu:
                self.cpu.sample()
                next_cpu += 1.0
            await self._sample()

    async def _scrape_sims(self, *, record: bool) -> list[dict[Any, float] | None]:
        texts = await asyncio.gather(*(_get_text(self.session, f"{u}/metrics") for u in self.sims))
        parsed = [None if t is None else series(t) for t in texts]
        for i, m in enumerate(parsed):
            if m is None:
                continue
            pre = first(m, "vllm:num_preemptions_total") or 0.0
            if record and pre > self.preempt_last[i]:
                self.preemption_times += [self.now()] * int(pre - self.preempt_last[i])
            self.preempt_last[i] = pre
            gen = first(m, "vllm:generation_tokens_total")
            if gen is not None:
                self.gen_total[i] = gen
            counters: dict[str, float] = {}
            for key, name in _ENGINE_COUNTERS.items():
                value = first(m, name)
                if value is not None:
                    counters[key] = value
            if len(counters) == len(_ENGINE_COUNTERS):
                self.counters[i] = counters
                if not record:
                    self.counters0[i] = dict(counters)
        return parsed

    async def _sample(self) -> None:
        sims = await self._scrape_sims(record=True)
        gw = None
        if self.gateway is not None:
            text = await _get_text(self.session, f"{self.gateway}/metrics")
            if text is not None:
                self.gateway_metrics = series(text)
            gw = self.gateway_metrics if self.gateway_metrics is not None else {}
        snap = None
        if self.gateway is not None and self.arm.policy is not None:
            snap = await controller_state(self.session, self.gateway)
        # no await from here on: the monitor is cancelled at the run's end, and a sample
        # cut in half would leave the columns of unequal length
        s = self.series
        s["t"].append(round(self.now(), 3))
        if self.gateway is not None and self.arm.policy is not None:
            add_cuts_sample(s, len(s["t"]), cuts_so_far(snap) if snap is not None else {})
        for i, m in enumerate(sims):
            kv = None if m is None else first(m, "vllm:kv_cache_usage_perc")
            waiting = None if m is None else first(m, "vllm:num_requests_waiting")
            running = None if m is None else first(m, "vllm:num_requests_running")
            s["running"][i].append(int(running or 0))
            s["kv_usage"][i].append(round(kv or 0.0, 4))
            s["waiting"][i].append(int(waiting or 0))
            if gw is not None:
                label = (("backend", f"b{i}"),)
                s["limit"][i].append(gw.get(("sluice_backend_limit", label), 0.0))
                s["inflight"][i].append(int(gw.get(("sluice_backend_inflight", label), 0.0)))
            else:
                s["inflight"][i].append(self.inflight[i])
        for p, c in enumerate(CLASSES):
            depth = (
                0.0 if gw is None else gw.get(("sluice_queue_depth", (("priority", str(p)),)), 0.0)
            )
            s["queued"][c].append(int(depth))
        if gw is not None:
            s["pressure"].append(round(gw.get(("sluice_pressure", ()), 0.0), 4))
        n = len(s["t"])
        for code, total in self.rejected_total.items():
            col = s["rejected_cumulative"].setdefault(code, [0] * (n - 1))
            col.append(total)
        for code, col in s["rejected_cumulative"].items():
            if len(col) < n:
                col.append(self.rejected_total.get(code, 0))


_ENGINE_COUNTERS = {
    "iteration": "vllm:iteration_tokens_total_sum",
    "prompt": "vllm:prompt_tokens_total",
    "generation": "vllm:generation_tokens_total",
    "first_tokens": "vllm:time_to_first_token_seconds_count",
}


def _r(x: float | None) -> float | None:
    return None if x is None else round(x, 4)


def _error_code(payload: bytes) -> str | None:
    try:
        doc = orjson.loads(payload)
        code = doc["error"]["code"]
    except (orjson.JSONDecodeError, KeyError, TypeError):
        return None
    return str(code) if code is not None else None


def _retry_after(headers: Any) -> float | None:
    ms = headers.get("retry-after-ms")
    if ms is not None:
        with contextlib.suppress(ValueError):
            return float(ms) / 1000.0
    value = headers.get("Retry-After")
    if value is not None:
        with contextlib.suppress(ValueError):
            return float(value)
    return None


async def _model_name(url: str) -> str:
    async with aiohttp.ClientSession() as session:
        await wait_ready(session, f"{url}/health", START_TIMEOUT_S)
        async with session.get(f"{url}/v1/models") as r:
            doc = await r.json()
            return str(doc["data"][0]["id"])


def _run_one_arm(
    scenario: Scenario,
    arm: ArmSpec,
    workload: list[Any],
    seed: int,
    progress: Progress | None,
    on_gateway: Callable[[str], None] | None = None,
) -> tuple[ArmRun, dict[str, Any]]:
    """One arm on fresh processes: its run, and `cpu` (`_ArmRunner._cpu_use`) and
    `recomputed_measured` (the engines export the counters `recomputed_tokens` needs)."""
    import uvloop

    started = time.perf_counter()
    sims, urls = start_sims(scenario)
    gateway: Proc | None = None
    tmp: Path | None = None
    try:
        model = uvloop.run(_model_name(urls[0]))
        gateway_url = None
        if arm.policy is not None:
            fd, name = tempfile.mkstemp(prefix=f"sluice-bench-{arm.name}-", suffix=".yaml")
            os.close(fd)
            tmp = Path(name)
            tmp.write_text(policy_yaml(arm.policy, urls), encoding="utf-8")
            port = free_port()
            gateway = Proc(
                "gateway",
                _sluice(
                    "serve", "--config", str(tmp), "--port", str(port), "--log-level", "warning"
                ),
            )
            gateway_url = f"http://127.0.0.1:{port}"

            async def ready() -> None:
                async with aiohttp.ClientSession() as s:
                    await wait_ready(s, f"{gateway_url}/readyz", START_TIMEOUT_S)

            try:
                uvloop.run(ready())
            except RuntimeError as exc:
                raise RuntimeError(f"{exc}; gateway output: {gateway.output()}") from None
            if on_gateway is not None:
                on_gateway(gateway_url)
        elif arm.gateway is not None:
            argv = [sys.executable, "-m", "sluice.bench.peers.proxy", *arm.gateway_argv]
            for u in urls:
                argv += ["--backend", u]
            gateway = Proc("peer", [*argv, "--port", "0"])
            m = gateway.wait_for_line(_PORT_LINE, START_TIMEOUT_S)
            gateway_url = f"http://127.0.0.1:{m.group(1)}"
        reqs = [ReqState(spec) for spec in workload]
        drain = scenario.spec.drain  # already shrunk by for_real_mode
        if arm.policy is not None:
            # long enough for a client told the longest Retry-After near the end of the
            # arrivals to come back and be served: a shorter run would count it as never
            # served whatever the rule (the run still ends once every request has)
            longest = longest_return_wait(workload, arm.policy.pressure.max_retry_after, arm)
            drain = max(drain, longest + RETURN_MARGIN_S)
        pids = {"sims": [p.popen.pid for p in sims]}
        if gateway is not None:
            pids["gateway"] = [gateway.popen.pid]
        runner = _ArmRunner(
            scenario, arm, reqs, urls, gateway_url, model, seed, drain, pids, progress
        )
        ended = uvloop.run(runner.run())
    finally:
        if gateway is not None:
            gateway.stop()
        for p in sims:
            p.stop()
        if tmp is not None:
            tmp.unlink(missing_ok=True)
    generated = sum(runner.gen_total)
    recomputed = runner.recomputed_tokens()
    run = ArmRun(
        arm=arm.name,
        scenario=scenario.name,
        requests=reqs,
        backend_names=[f"b{i}" for i in range(len(urls))],
        duration=scenario.duration,
        ended_at=ended,
        preemption_times=runner.preemption_times,
        preempted_tokens=recomputed or 0,
        wasted_after_gone=max(0, int(generated - runner.received)),
        retry_after_retries=sum(r.ra_attempts for r in reqs),
        retry_after_admitted=sum(r.admitted_after_ra for r in reqs),
        rejections=runner.rejections,
        first_rejection_at=runner.first_rejection_at,
        episodes=[],
        series=runner.series,
        wall_s=time.perf_counter() - started,
        events=0,
        controller_snapshot=runner.controller_snapshot,
        dispatch_log=runner.dispatch_log,
        reserved_p0=0.0 if arm.policy is None else arm.policy.dispatcher.reserved.p0,
    )
    return run, {"cpu": runner.cpu_use, "recomputed_measured": recomputed is not None}


def run_real(
    scenario: Scenario,
    arms: list[str],
    *,
    seed: int | None = None,
    progress: Progress | None = None,
    on_gateway: Callable[[str], None] | None = None,
    cap: int | None = None,
) -> dict[str, Any]:
    """Run the arms against real processes; the results.json document (mode "real").
    `on_gateway(url)` is called when an arm's gateway is up (to show its dashboard).
    `cap`: the `static` and `litellm` arms' cap (default: the first phase's sweet spot)."""
    started = time.perf_counter()
    plan = make_plan(scenario.for_real_mode(), seed=seed)
    small, seed, profile = plan.scenario, plan.seed, plan.profile
    n = small.spec.backends.count
    caps, rates, workload = plan.capacities, plan.rates_rps, plan.workload
    limit = small.spec.real.max_rps
    if max(rates) > limit:
        raise RuntimeError(
            f"real mode would offer {max(rates):.0f} requests/s (more than real.maxRps = "
            f"{limit:g}); shrink the scenario's `real` section"
        )
    samples: list[float] = []
    results: dict[str, Any] = {}
    for name in arms:
        static_cap = cap or caps[0].sweet_spot
        spec = arm_spec(name, small, max_limit=profile.max_num_seqs, static_cap=static_cap)
        run, extra = _run_one_arm(small, spec, workload, seed, progress, on_gateway)
        cpu = extra["cpu"]
        samples += cpu.pop("busy_samples")
        res = arm_results(run, small)
        res["cpu"] = cpu
        res["series"] = _series(run)
        res["limit_reaction"] = None  # measured in virtual time only
        if not extra["recomputed_measured"]:
            res["wasted_breakdown"]["recomputed_after_preemption"] = None
        if name in ("static", "litellm"):
            res["cap"] = static_cap
        results[name] = res
    return {
        "scenario": scenario.name,
        "description": scenario.spec.description,
        "mode": "real",
        "seed": seed,
        "cpu": cpu_summary(samples),  # over every arm's load
        "plan": {
            "backends": n,
            "profile": f"{profile.name} x{small.spec.backends.speed:g} speed",
            "requests": len(workload),
            **(
                {"trace": plan.trace, "arrivals": arrivals_per_s(workload, small.duration)}
                if plan.trace is not None
                else {}
            ),
            "phases": [
                {
                    "name": p.name,
                    "start_s": round(p.start, 3),
                    "end_s": round(p.end, 3),
                    "rate_x_capacity": p.rate,
                    "offered_rps": round(rps, 2),
                    "capacity_rps": round(c.rps * n, 2),
                    "sweet_spot_per_backend": c.sweet_spot,
                }
                for p, c, rps in zip(small.phases, caps, rates, strict=True)
            ],
        },
        "slos": {c: s.model_dump(exclude_none=True, by_alias=True) for c, s in small.slos.items()},
        "arms": results,
        "timing": {"total_s": round(time.perf_counter() - started, 2)},
    }


def _series(run: ArmRun) -> dict[str, Any]:
    s = dict(run.series)
    ttft: dict[str, list[tuple[float, float]]] = {c: [] for c in CLASSES}
    for r in run.requests:
        if r.first_token_at is not None and r.outcome in (OK, CANCELLED):
            ttft[r.spec.class_name].append(
                (round(r.first_token_at, 3), round(r.first_token_at - r.spec.arrival, 4))
            )
    s["ttft"] = ttft
    s["backends"] = run.backend_names
    if not any(s["limit"][i] for i in range(len(s["limit"]))):
        s["limit"] = [[] for _ in run.backend_names]
    return s
