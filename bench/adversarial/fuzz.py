"""The fuzz run (issue 14's must-show): N requests (10,000 by default) mixing valid and
hostile bodies and headers against a live gateway (`sluice serve` in front of a `sluice
sim`, with a password-protected Redis for the tenant quotas), while other tenants'
streams run beside it and are checked whole.

    python bench/adversarial/fuzz.py [--requests 10000] [--concurrency 32] [--seed 1]
                                     [--out DIR]

It reports, and fails (exit 1) on any of: a 5xx that is not documented (502
upstream_error/upstream_auth, 503 no_backend/backend_overloaded/too_many_connections/
shutting_down/unavailable, 504 upstream_timeout), an error body not in OpenAI's shape,
a gateway crash, a request with no answer within 15 s (a hang), a configured key or the
Redis password anywhere in the gateway's captured log, a background stream not intact,
RSS growing more than 64 MiB over the run. Writes DIR/results.json and DIR/fuzz.png
(RSS and requests answered over time).

The generator is this file's own, seeded: bodies with each field replaced by a wrong
type or an extreme value, truncated, deeply nested or oversized JSON, bytes that are not
UTF-8, keys hidden in bodies; header lines with control characters (a key among them),
conflicting lengths (smuggling), lines too long, bad methods, versions and paths."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

_VENV_PY = Path(__file__).resolve().parents[2] / ".venv" / "bin" / "python"
if _VENV_PY.exists() and Path(sys.prefix).resolve() != _VENV_PY.parent.parent.resolve():
    os.execv(str(_VENV_PY), [str(_VENV_PY), *sys.argv])

import httpx  # noqa: E402
import orjson  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from stack import BusySampler, rss_mib, start_gateway, start_redis, start_sim  # noqa: E402

REDIS_PASSWORD = "fuzz-redis-pw-Qv93"
KEYS = {
    "p0": "sk-fuzz-p0-Hc41",
    "p1": "sk-fuzz-p1-Wn27",
    "p2": "sk-fuzz-p2-Ld85",
    "metered": "sk-fuzz-metered-Ua62",
    "steady": "sk-fuzz-steady-Ko19",  # the background streams' tenant: never fuzzed
    "admin": "sk-fuzz-admin-Xe30",
}
POLICY = """
tenants:
  - {{name: p0, apiKeys: [{p0}], priority: 0}}
  - {{name: p1, apiKeys: [{p1}], priority: 1}}
  - {{name: p2, apiKeys: [{p2}], priority: 2}}
  - {{name: metered, apiKeys: [{metered}], priority: 1, tokensPerMinute: 200000,
     requestsPerMinute: 100000}}
  - {{name: steady, apiKeys: [{steady}], priority: 0}}
admin: {{apiKeys: [{admin}]}}
backends: [{{name: sim, url: "{sim}"}}]
redis: {{url: "{redis}"}}
features: [{{name: summarize, core: false, fallback: {{static: "paused"}}}}]
queues:
  - {{priority: 0, name: realtime-interactive, maxQueueSize: 200, timeout: 8s, dropPolicy: tail}}
  - {{priority: 1, name: agent-workflow, maxQueueSize: 500, timeout: 10s,
     dropPolicy: early-drop-on-pressure}}
  - {{priority: 2, name: batch-extraction, maxQueueSize: 1000, timeout: 10s,
     dropPolicy: fast-reject}}
server: {{maxBodyBytes: 1048576, readTimeout: 5s, headerTimeout: 5s}}
"""
DOCUMENTED_5XX = {
    502: {"upstream_error", "upstream_auth"},
    503: {"no_backend", "backend_overloaded", "too_many_connections", "shutting_down"}
    | {"unavailable"},
    504: {"upstream_timeout"},
}
# Longer than any bound the policy sets (queue timeouts 8-10 s, readTimeout 5 s) plus a
# generous answer time: a request still unanswered then is a hang.
HANG_S = 30.0
STREAM_TOKENS = 16


# -- the generator ---------------------------------------------------------------------------

_WEIRD: list[Any] = [
    None, True, False, 0, -1, 1, 2**31, 2**63 - 1, -(2**63), 1e308, -1e308, 0.5, "", "x",
    "0", "1e9", "true", [], {}, [1, 2], {"a": 1}, "\u0000", "\U0001f600" * 50, "é" * 1000,
]  # fmt: skip
_FIELDS = [
    "model", "messages", "stream", "max_tokens", "max_completion_tokens", "n", "best_of",
    "stream_options", "tools", "functions", "temperature", "prompt", "suffix", "user",
    "tool_choice", "response_format", "logprobs", "documents",
]  # fmt: skip


def _valid_chat(rng: random.Random, stream: bool) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": "sluice-sim",
        "max_tokens": rng.randint(1, 24),
        "messages": [{"role": "user", "content": "fuzz " * rng.randint(1, 60)}],
    }
    if stream:
        body["stream"] = True
    if rng.random() < 0.2:
        tool = {"type": "function", "function": {"name": "f", "description": "d" * 200}}
        body["tools"] = [tool]
    if rng.random() < 0.1:
        body["n"] = rng.randint(1, 3)
    return body


def _hostile_body(rng: random.Random) -> bytes:
    roll = rng.random()
    base = _valid_chat(rng, rng.random() < 0.3)
    if roll < 0.45:  # one field (or a few) replaced by something wrong
        for _ in range(rng.randint(1, 3)):
            base[rng.choice(_FIELDS)] = rng.choice(_WEIRD)
        if rng.random() < 0.1:  # a key hidden in the body: it must not reach the log
            base[rng.choice(["model", "user"])] = rng.choice(list(KEYS.values()))
        return orjson.dumps(base)
    if roll < 0.55:
        depth = rng.choice([100, 1000, 10_000, 100_000])
        return b'{"model":"sluice-sim","messages":' + b"[" * depth + b"]" * depth + b"}"
    if roll < 0.65:
        raw = orjson.dumps(base)
        return raw[: rng.randint(0, len(raw))]  # truncated
    if roll < 0.72:
        if rng.random() < 0.5:  # a lone surrogate, escaped
            return b'{"model":"sluice-sim","messages":[{"role":"user","content":"\\ud800"}]}'
        return b'{"model":"sluice-sim","messages":[{"role":"user","content":"\xff\xfe\x80"}]}'
    if roll < 0.78:
        size = rng.choice([200_000, 900_000, 1_500_000])  # the last one over maxBodyBytes
        base["messages"] = [{"role": "user", "content": "a" * size}]
        return orjson.dumps(base)
    if roll < 0.86:
        messages = [rng.choice(_WEIRD) for _ in range(rng.randint(1, 4))]
        return orjson.dumps({"model": "sluice-sim", "messages": messages})
    if roll < 0.93:
        return bytes(rng.randrange(256) for _ in range(rng.randint(1, 300)))
    return orjson.dumps(rng.choice(_WEIRD))


def _request(
    method: str, path: str, headers: list[tuple[bytes, bytes]], body: bytes, crlf: bytes = b"\r\n"
) -> bytes:
    lines = [f"{method} {path} HTTP/1.1".encode(), b"Host: gw", b"Connection: close"]
    lines += [k + b": " + v for k, v in headers]
    return crlf.join(lines) + crlf + crlf + body


def generate(rng: random.Random) -> tuple[str, bytes]:
    """One request: (kind, raw bytes)."""
    key = rng.choice([KEYS["p0"], KEYS["p1"], KEYS["p2"], KEYS["metered"]])
    auth = (b"Authorization", b"Bearer " + key.encode())
    ctype = (b"Content-Type", b"application/json")
    roll = rng.random()
    if roll < 0.35:
        stream = rng.random() < 0.4
        body = orjson.dumps(_valid_chat(rng, stream))
        headers = [auth, ctype, (b"Content-Length", str(len(body)).encode())]
        if rng.random() < 0.3:
            headers.append((b"X-Priority", rng.choice([b"1", b"2"])))
        if rng.random() < 0.2:
            headers.append((b"X-Request-Timeout", b"30"))
        if rng.random() < 0.1:
            headers.append((b"X-Sluice-Feature", b"summarize"))
        return ("valid-stream" if stream else "valid"), _request(
            "POST", "/v1/chat/completions", headers, body
        )
    if roll < 0.40:
        body = orjson.dumps(
            {"model": "sluice-sim", "prompt": ["a b c", "d e"], "max_tokens": rng.randint(1, 8)}
        )
        headers = [auth, ctype, (b"Content-Length", str(len(body)).encode())]
        return "valid", _request("POST", "/v1/completions", headers, body)
    if roll < 0.70:
        body = _hostile_body(rng)
        headers = [auth, ctype, (b"Content-Length", str(len(body)).encode())]
        return "hostile-body", _request("POST", "/v1/chat/completions", headers, body)
    if roll < 0.93:
        body = orjson.dumps(_valid_chat(rng, False))
        length = (b"Content-Length", str(len(body)).encode())
        kind = rng.randrange(12)
        if kind == 0:  # a key with a control character: the parser refuses the line
            headers = [(b"Authorization", b"Bearer " + key.encode() + b"\x01"), length]
        elif kind == 1:
            headers = [(b"Authorization", rng.choice([b"", b"Basic eA==", b"Bearer", b"x"]))]
            headers.append(length)
        elif kind == 2:  # smuggling: both a length and chunked
            headers = [auth, length, (b"Transfer-Encoding", b"chunked")]
        elif kind == 3:
            headers = [auth, (b"Content-Length", b"5"), (b"Content-Length", b"7")]
        elif kind == 4:
            headers = [auth, length, (b"X-Junk", b"a" * rng.choice([9000, 70_000]))]
        elif kind == 5:
            headers = [auth, length, (b"X-Priority", rng.choice([b"0", b"-1", b"9", b"x", b""]))]
        elif kind == 6:
            value = rng.choice([b"0", b"-5", b"nan", b"inf", b"1e999", b"abc", b"0.001"])
            headers = [auth, length, (b"X-Request-Timeout", value)]
        elif kind == 7:
            headers = [auth, length, (b"X-\xff\xfe", b"\xc3\x28")]  # not ASCII
        elif kind == 8:
            return "hostile-header", _request(
                "POST", "/v1/chat/completions", [auth, length], body, crlf=b"\n"
            )
        elif kind == 9:
            headers = [auth, (b"Content-Length", str(len(body) + 100).encode())]  # short body
        elif kind == 10:
            headers = [auth, length] + [(f"X-H{i}".encode(), b"v") for i in range(200)]
        else:
            headers = [auth, length, (b"Transfer-Encoding", b"gzip, chunked")]
        return "hostile-header", _request("POST", "/v1/chat/completions", headers, body)
    routes = [
        ("GET", "/v1/chat/completions"), ("DELETE", "/v1/models"), ("POST", "/v1/embeddingz"),
        ("GET", "/../../etc/passwd"), ("GET", "/v1/models%00"), ("BREW", "/"),
        ("GET", "/admin/state"), ("POST", "/admin/reload"), ("GET", "/dashboard/state"),
        ("GET", "/health"), ("GET", "/" + "a" * 9000), ("PRI", "*"),
    ]  # fmt: skip
    method, path = rng.choice(routes)
    headers = [auth] if rng.random() < 0.5 else []
    return "hostile-route", _request(method, path, headers, b"")


# -- sending ---------------------------------------------------------------------------------


async def send(host: str, port: int, raw: bytes) -> tuple[int, bytes, bytes]:
    """(status, head, body) of the answer; status 0 if the gateway closed without one."""
    reader, writer = await asyncio.open_connection(host, port, limit=2**22)
    head = body = b""
    try:
        writer.write(raw)
        await writer.drain()
        head = await reader.readuntil(b"\r\n\r\n")
        length = _content_length(head)
        # the whole answer: its Content-Length, or (a stream) until the gateway closes
        body = await (reader.readexactly(length) if length is not None else reader.read())
    except (ConnectionError, OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError):
        pass
    finally:
        writer.close()
    try:
        status = int(head.split(b" ", 2)[1])
    except (IndexError, ValueError):
        status = 0
    return status, head, body


def _content_length(head: bytes) -> int | None:
    for line in head.split(b"\r\n"):
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            return int(value)
    return None


def check(status: int, head: bytes, body: bytes) -> str | None:
    """What is wrong with an answer (None: nothing)."""
    if status == 0:
        return None  # closed without an answer (a request the parser never completed)
    if status < 400:
        return None
    if b"chunked" in head.lower():
        return f"{status} error answered chunked"
    try:
        err = orjson.loads(body)["error"]
        code = err["code"]
        assert isinstance(err["message"], str) and err["message"] and "type" in err
    except (orjson.JSONDecodeError, KeyError, TypeError, AssertionError):
        return f"{status} not in OpenAI's shape: {body[:80]!r}"
    if status >= 500 and code not in DOCUMENTED_5XX.get(status, set()):
        return f"undocumented {status} {code}"
    return None


async def background(url: str, stop: asyncio.Event, results: Counter[str]) -> None:
    body = {
        "model": "sluice-sim",
        "stream": True,
        "max_tokens": STREAM_TOKENS,
        "ignore_eos": True,
        "messages": [{"role": "user", "content": "steady"}],
    }
    headers = {"Authorization": f"Bearer {KEYS['steady']}"}
    async with httpx.AsyncClient(timeout=30) as client:
        while not stop.is_set():
            try:
                async with client.stream(
                    "POST", url + "/v1/chat/completions", json=body, headers=headers
                ) as r:
                    events = [x async for x in r.aiter_lines() if x.startswith("data: ")]
                content = [e for e in events if '"content"' in e]
                whole = r.status_code == 200 and events[-1:] == ["data: [DONE]"]
                if whole and len(content) >= STREAM_TOKENS:
                    results["intact"] += 1
                else:
                    results[f"broken: HTTP {r.status_code}, {len(content)} tokens"] += 1
            except httpx.HTTPError as exc:
                results[f"broken: {type(exc).__name__}"] += 1


async def run(args: argparse.Namespace, gw_url: str, gw_pid: int) -> dict[str, Any]:
    host, port = gw_url.removeprefix("http://").split(":")
    rng = random.Random(args.seed)
    queue: asyncio.Queue[tuple[str, bytes]] = asyncio.Queue()
    for _ in range(args.requests):
        queue.put_nowait(generate(rng))
    statuses: Counter[str] = Counter()
    by_kind: Counter[str] = Counter()
    problems: list[str] = []
    hangs = 0
    done = 0
    timeline: list[tuple[float, int, float]] = []
    stop = asyncio.Event()
    streams: Counter[str] = Counter()
    bg = [asyncio.create_task(background(gw_url, stop, streams)) for _ in range(3)]
    t0 = time.monotonic()

    async def worker() -> None:
        nonlocal hangs, done
        while not queue.empty():
            kind, raw = queue.get_nowait()
            try:
                status, head, body = await asyncio.wait_for(send(host, int(port), raw), HANG_S)
            except TimeoutError:
                hangs += 1
                problems.append(f"{kind}: no answer within {HANG_S:.0f} s: {raw[:80]!r}")
                continue
            done += 1
            statuses[str(status)] += 1
            by_kind[f"{kind} {status}"] += 1
            if (problem := check(status, head, body)) is not None:
                problems.append(f"{kind}: {problem}: {raw[:80]!r}")

    async def sampler() -> None:
        last = -1
        while not stop.is_set():
            now = time.monotonic() - t0
            timeline.append((now, done, rss_mib(gw_pid)))
            if done // 1000 != last // 1000:
                print(f"  {done:6d}/{args.requests} answered, {now:5.1f} s", flush=True)
            last = done
            await asyncio.sleep(0.5)

    sample = asyncio.create_task(sampler())
    await asyncio.gather(*(worker() for _ in range(args.concurrency)))
    elapsed = time.monotonic() - t0
    stop.set()
    await asyncio.gather(*bg, sample)
    rss = [r for _, _, r in timeline if r > 0]
    return {
        "requests": args.requests,
        "answered": done,
        "seconds": round(elapsed, 1),
        "statuses": dict(sorted(statuses.items())),
        "by_kind": dict(sorted(by_kind.items())),
        "hangs": hangs,
        "problems": problems[:50],
        "problem_count": len(problems),
        "background_streams": dict(streams),
        "rss_mib": {"start": rss[0], "peak": max(rss), "end": rss[-1]} if rss else {},
        "timeline": timeline,
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=10_000)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--out", type=Path, default=Path("reports/fuzz"))
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    folder = Path(tempfile.mkdtemp(prefix="sluice-fuzz-"))
    redis = start_redis(folder, REDIS_PASSWORD)
    sim = start_sim("--profile", "tiny", "--speed", "4")
    gw = start_gateway(POLICY.format(**KEYS, sim=sim.url, redis=redis.url), folder)
    print(f"gateway {gw.url} (pid {gw.pid}), log {gw.log}; {args.requests} requests", flush=True)
    try:
        with BusySampler() as busy:
            result = asyncio.run(run(args, gw.url, gw.pid))
        result["gateway_alive"] = gw.alive()
    finally:
        gw.stop()
        sim.stop()
        redis.kill()
    assert gw.log is not None
    log = gw.log.read_text(errors="replace")
    secrets = [*KEYS.values(), REDIS_PASSWORD]
    result["secrets_in_log"] = [s for s in secrets if s in log]
    result["log_lines"] = log.count("\n")
    result["cpu"] = {
        "busy_fraction_max": round(max(busy.samples, default=0.0), 3),
        "busy_fraction_mean": round(sum(busy.samples) / max(1, len(busy.samples)), 3),
        "saturated": max(busy.samples, default=0.0) > 0.9,
    }
    rss = result["rss_mib"]
    failures = []
    if result["problem_count"]:
        failures.append(f"{result['problem_count']} bad answers")
    if result["hangs"]:
        failures.append(f"{result['hangs']} hangs")
    if not result["gateway_alive"]:
        failures.append("the gateway died")
    if result["secrets_in_log"]:
        failures.append(f"secrets in the log: {result['secrets_in_log']}")
    if any(k.startswith("broken") for k in result["background_streams"]):
        failures.append("background streams broken")
    if rss and rss["end"] - rss["start"] > 64:
        failures.append(f"RSS grew {rss['end'] - rss['start']:.0f} MiB")
    result["failures"] = failures
    (args.out / "results.json").write_text(json.dumps(result, indent=1))
    _plot(result, args.out / "fuzz.png")
    summary = {k: v for k, v in result.items() if k not in ("timeline", "by_kind", "problems")}
    print(json.dumps(summary, indent=1))
    for line in result["problems"][:10]:
        print("  problem:", line)
    print("FAILED: " + "; ".join(failures) if failures else "OK", flush=True)
    return 1 if failures else 0


def _plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t = [x[0] for x in result["timeline"]]
    fig, ax = plt.subplots(figsize=(8, 3.5))
    ax.plot(t, [x[2] for x in result["timeline"]], color="tab:blue", label="gateway RSS (MiB)")
    ax.set_xlabel("seconds")
    ax.set_ylabel("RSS (MiB)", color="tab:blue")
    ax.set_ylim(bottom=0)
    ax2 = ax.twinx()
    ax2.plot(t, [x[1] for x in result["timeline"]], color="tab:orange", label="answered")
    ax2.set_ylabel("requests answered", color="tab:orange")
    ax.set_title(f"fuzz: {result['answered']} requests, {result['problem_count']} bad answers")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    sys.exit(main())
