"""The httpx `[DONE]`-close pattern (issue 14, item 1): a client that leaves
`async with client.stream(...)` as soon as it reads `data: [DONE]`, before the chunked
terminator, as guidellm does. N requests (1,000 by default) one at a time, straight at a
`sluice sim --profile tiny` and through `sluice serve` in front of another, side by side
(the two loops interleaved): the count of answers that were not 200 for each, and the
gateway's upstream errors (a hang-up counted against the backend took it out of service
and answered `503 no_backend` to everyone, 202 of 300 requests in one run before).

    python bench/adversarial/done_close.py [--requests 1000] [--out DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

_VENV_PY = Path(__file__).resolve().parents[2] / ".venv" / "bin" / "python"
if _VENV_PY.exists() and Path(sys.prefix).resolve() != _VENV_PY.parent.parent.resolve():
    os.execv(str(_VENV_PY), [str(_VENV_PY), *sys.argv])

import httpx  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from stack import BusySampler, start_gateway, start_sim  # noqa: E402

POLICY = """
tenants: [{{name: app, apiKeys: [sk-done-close], priority: 1}}]
backends: [{{name: sim, url: "{sim}"}}]
"""
BODY = {
    "model": "sluice-sim",
    "stream": True,
    "max_tokens": 8,
    "messages": [{"role": "user", "content": "hello"}],
}


async def one(client: httpx.AsyncClient, url: str) -> int:
    async with client.stream("POST", url + "/v1/chat/completions", json=BODY) as r:
        status = r.status_code
        async for line in r.aiter_lines():
            if line == "data: [DONE]":
                break  # leave at once: the chunked terminator is never read
    return status


async def run(n: int, direct: str, gateway: str) -> dict[str, Counter[int]]:
    out: dict[str, Counter[int]] = {"direct": Counter(), "sluice": Counter()}
    headers = {"Authorization": "Bearer sk-done-close"}
    async with (
        httpx.AsyncClient(timeout=30) as d,
        httpx.AsyncClient(timeout=30, headers=headers) as g,
    ):
        for i in range(n):
            out["direct"][await one(d, direct)] += 1
            out["sluice"][await one(g, gateway)] += 1
            if (i + 1) % 100 == 0:
                print(f"  {i + 1}/{n}: direct {dict(out['direct'])}, sluice {dict(out['sluice'])}")
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=1000)
    p.add_argument("--out", type=Path, default=Path("reports/done-close"))
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    folder = Path(tempfile.mkdtemp(prefix="sluice-done-close-"))
    sims = [start_sim("--profile", "tiny", "--seed", str(i)) for i in range(2)]
    gw = start_gateway(POLICY.format(sim=sims[1].url), folder)
    try:
        t0 = time.monotonic()
        with BusySampler() as busy:
            counts = asyncio.run(run(args.requests, sims[0].url, gw.url))
        metrics = httpx.get(gw.url + "/metrics").text
    finally:
        gw.stop()
        for s in sims:
            s.stop()
    errors = sum(
        float(line.rsplit(" ", 1)[1])
        for line in metrics.splitlines()
        if line.startswith("sluice_upstream_errors_total{")
    )
    result = {
        "requests": args.requests,
        "seconds": round(time.monotonic() - t0, 1),
        "direct": dict(counts["direct"]),
        "sluice": dict(counts["sluice"]),
        "non_200": {k: sum(v for s, v in c.items() if s != 200) for k, c in counts.items()},
        "sluice_upstream_errors": errors,
        "cpu_busy_fraction_max": round(max(busy.samples, default=0.0), 3),
    }
    (args.out / "results.json").write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))
    return 0 if result["non_200"]["sluice"] == 0 and errors == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
