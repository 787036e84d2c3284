"""guidellm against Sluice and straight at the backend, side by side in one run (issue
14's must-show): two `sluice sim` processes of the same profile and seed, `sluice serve`
in front of one; two guidellm runs at the same constant rate (below the backend's
capacity) started together (or one after the other: `--one-after-the-other`), one at
the gateway, one at the other simulator. guidellm
validates its target with GET /health first (Sluice answered 404 there before).

    python bench/adversarial/guidellm_compare.py [--rate 4] [--seconds 60]
        [--profile h100-llama3-8b] [--prompt-tokens 256] [--output-tokens 128] [--out DIR]

guidellm comes from scripts/guidellm/install.sh (a venv in ~/.cache/sluice, CPU torch,
a tokenizer built offline). Passes (exit 0) with 0 errored requests in both arms and
Sluice's mean and median TTFT within 1.1x of direct. Writes DIR/results.json, each
arm's guidellm JSON, and DIR/ttft.png."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

_VENV_PY = Path(__file__).resolve().parents[2] / ".venv" / "bin" / "python"
if _VENV_PY.exists() and Path(sys.prefix).resolve() != _VENV_PY.parent.parent.resolve():
    os.execv(str(_VENV_PY), [str(_VENV_PY), *sys.argv])

sys.path.insert(0, str(Path(__file__).resolve().parent))
from stack import REPO, BusySampler, start_gateway, start_sim  # noqa: E402

KEY = "sk-guidellm-1"
POLICY = """
tenants: [{{name: bench, apiKeys: [{key}], priority: 0}}]
backends: [{{name: sim, url: "{sim}"}}]
"""


def install() -> Path:
    out = subprocess.run(
        ["bash", str(REPO / "scripts" / "guidellm" / "install.sh")],
        check=True,
        capture_output=True,
        text=True,
    )
    return Path(out.stdout.strip().splitlines()[-1])


def guidellm(
    venv: Path, target: str, out: Path, args: argparse.Namespace, key: str | None
) -> subprocess.Popen[bytes]:
    backend = f"kind=openai_http,target={target},model=sluice-sim"
    if key:
        backend += f",api_key={key}"
    cmd = [
        str(venv / "bin" / "guidellm"),
        "run",
        "--backend",
        backend,
        "--profile",
        f"kind=constant,rate={args.rate}",
        "--constraint",
        f"kind=max_requests,count={round(args.rate * args.seconds)}",
        "--data",
        f"kind=synthetic_text,prompt_tokens={args.prompt_tokens},"
        f"output_tokens={args.output_tokens}",
        "--tokenizer",
        f"kind=huggingface_auto,model={venv / 'tokenizer'}",
        "--seed",
        "kind=static,value=1",
        "--output",
        f"kind=json,path={out}",
        "--disable-console-interactive",
    ]
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    log = open(out.with_suffix(".log"), "wb")  # noqa: SIM115
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)


def summary(path: Path) -> dict[str, Any]:
    bench = json.loads(path.read_text())["benchmarks"][0]["metrics"]
    totals = bench["request_totals"]
    ttft = bench["time_to_first_token_ms"]["successful"]
    pct = ttft.get("percentiles") or {}
    return {
        "successful": totals["successful"],
        "errored": totals["errored"],
        "incomplete": totals["incomplete"],
        "ttft_ms_mean": ttft["mean"],
        "ttft_ms_median": ttft["median"],
        "ttft_ms_p95": pct.get("p95"),
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rate", type=float, default=4.0, help="requests per second, each arm")
    p.add_argument("--seconds", type=float, default=60.0, help="rate x seconds requests")
    p.add_argument("--profile", default="h100-llama3-8b")
    p.add_argument("--prompt-tokens", type=int, default=256)
    p.add_argument("--output-tokens", type=int, default=128)
    p.add_argument("--out", type=Path, default=Path("reports/guidellm"))
    p.add_argument(
        "--scrape-direct",
        action="store_true",
        help="scrape the direct arm's simulator's /metrics as the gateway scrapes its own "
        "(every scraper.interval, 0.25 s): both engines then pay for a scrape, and the "
        "ratio is the relay's alone",
    )
    p.add_argument(
        "--one-after-the-other",
        action="store_true",
        help="run the arms in turn, not at once (on 2 cores two guidellm runs saturate them)",
    )
    args = p.parse_args()
    args.out = args.out.resolve()
    args.out.mkdir(parents=True, exist_ok=True)
    venv = install()
    folder = Path(tempfile.mkdtemp(prefix="sluice-guidellm-"))
    sims = [start_sim("--profile", args.profile, "--seed", "7") for _ in range(2)]
    gw = start_gateway(POLICY.format(key=KEY, sim=sims[1].url), folder, "--no-access-log")
    arms = f"direct {sims[0].url}, sluice {gw.url} -> {sims[1].url}"
    print(f"{arms}; {args.seconds:.0f} s at {args.rate}/s each", flush=True)
    try:
        t0 = time.monotonic()
        scraper = _Scraper(sims[0].url) if args.scrape_direct else contextlib.nullcontext()
        with BusySampler() as busy, scraper:
            targets = {"direct": (sims[0].url, None), "sluice": (gw.url, KEY)}
            runs: dict[str, subprocess.Popen[bytes]] = {}
            codes: dict[str, int] = {}
            for name, (url, key) in targets.items():
                runs[name] = guidellm(venv, url, args.out / f"{name}.json", args, key)
                if args.one_after_the_other:
                    codes[name] = runs[name].wait(args.seconds * 4 + 300)
            for name, proc in runs.items():
                codes[name] = proc.wait(args.seconds * 4 + 300)
        elapsed = time.monotonic() - t0
        gateway_view = _gateway_view(gw.url)
    finally:
        gw.stop()
        for s in sims:
            s.stop()
    if any(codes.values()):
        for name, code in codes.items():
            if code:
                print(f"guidellm ({name}) exited {code}:")
                print((args.out / f"{name}.log").read_text()[-3000:])
        return 1
    arms = {name: summary(args.out / f"{name}.json") for name in runs}
    ratio = {
        "mean": arms["sluice"]["ttft_ms_mean"] / arms["direct"]["ttft_ms_mean"],
        "median": arms["sluice"]["ttft_ms_median"] / arms["direct"]["ttft_ms_median"],
    }
    result = {
        "settings": {k: str(v) for k, v in vars(args).items()},
        "seconds": round(elapsed, 1),
        "arms": arms,
        "ttft_ratio_sluice_over_direct": {k: round(v, 3) for k, v in ratio.items()},
        # whether the gateway queued anyone (its limiter below the offered concurrency)
        "gateway": gateway_view,
        "cpu": {
            "busy_fraction_max": round(max(busy.samples, default=0.0), 3),
            "busy_fraction_mean": round(sum(busy.samples) / max(1, len(busy.samples)), 3),
        },
    }
    ok = all(a["errored"] == 0 for a in arms.values()) and max(ratio.values()) <= 1.1
    result["pass"] = ok
    (args.out / "results.json").write_text(json.dumps(result, indent=1))
    _plot(arms, args.out / "ttft.png")
    print(json.dumps(result, indent=1))
    return 0 if ok else 1


class _Scraper:
    """GET url/metrics every `interval` s in a thread, as the gateway's scraper does."""

    def __init__(self, url: str, interval: float = 0.25) -> None:
        self.url, self.interval = url + "/metrics", interval
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def _loop(self) -> None:
        import httpx

        with httpx.Client(timeout=5) as client:
            while not self._stop.wait(self.interval):
                with contextlib.suppress(httpx.HTTPError):
                    client.get(self.url)

    def __enter__(self) -> _Scraper:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join()


def _gateway_view(url: str) -> dict[str, float]:
    """From the gateway's /metrics: the requests that waited in its queue over 25 ms (its
    smallest bucket), the mean wait, and the backend's adaptive limit at the end."""
    import httpx

    text = httpx.get(url + "/metrics", timeout=10).text
    total = fast = wait_sum = limit = 0.0
    for line in text.splitlines():
        name, _, value = line.rpartition(" ")
        if name.startswith("sluice_queue_wait_seconds_count{"):
            total += float(value)
        elif name.startswith("sluice_queue_wait_seconds_sum{"):
            wait_sum += float(value)
        elif name.startswith("sluice_queue_wait_seconds_bucket{") and 'le="0.025"' in name:
            fast += float(value)
        elif name.startswith("sluice_backend_limit{"):
            limit += float(value)
    return {
        "requests": total,
        "queued_over_25ms": total - fast,
        "queue_wait_ms_mean": round(wait_sum / max(1.0, total) * 1000, 3),
        "backend_limit_at_end": limit,
    }


def _plot(arms: dict[str, dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    stats = ["ttft_ms_mean", "ttft_ms_median", "ttft_ms_p95"]
    fig, ax = plt.subplots(figsize=(6, 3.2))
    for i, (name, arm) in enumerate(arms.items()):
        values = [arm[s] or 0 for s in stats]
        ax.bar([x + i * 0.38 for x in range(len(stats))], values, width=0.38, label=name)
    ax.set_xticks([x + 0.19 for x in range(len(stats))], ["mean", "median", "p95"])
    ax.set_ylabel("TTFT (ms), guidellm")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    sys.exit(main())
