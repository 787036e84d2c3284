"""Each backend's TPOT and TTFT over time against the classes' objectives: the series
(in results.json, `series.objectives`) and its plot (`objectives.png`)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from sluice.bench.harness import ArmRun
from sluice.bench.metrics import percentile

BINS = 120  # over the run, at least 1 s each


def objective_series(run: ArmRun, horizon: float) -> dict[str, Any]:
    """Per backend, per time bin: the p95 TPOT of the requests that ended in it (every
    class: they share the batch's steps) and the p95 TTFT (from the first attempt) of the
    P0 requests whose first token came in it; None for an empty bin."""
    width = max(1.0, math.ceil(horizon / BINS))
    n_bins = max(1, math.ceil(horizon / width))
    n_backends = len(run.backend_names)
    tpot: list[list[list[float]]] = [[[] for _ in range(n_bins)] for _ in range(n_backends)]
    ttft: list[list[list[float]]] = [[[] for _ in range(n_bins)] for _ in range(n_backends)]
    for r in run.requests:
        b = r.backend
        if not 0 <= b < n_backends or r.first_token_at is None:
            continue
        if r.spec.priority == 0:
            k = min(n_bins - 1, int(r.first_token_at / width))
            ttft[b][k].append(r.first_token_at - r.spec.arrival)
        if r.tokens >= 2 and r.last_token_at is not None:
            k = min(n_bins - 1, int(r.last_token_at / width))
            tpot[b][k].append((r.last_token_at - r.first_token_at) / (r.tokens - 1))

    def p95(cols: list[list[list[float]]]) -> list[list[float | None]]:
        return [
            [None if not v else round(percentile(v, 0.95) or 0.0, 4) for v in col] for col in cols
        ]

    return {"bin_s": width, "tpot_p95": p95(tpot), "p0_ttft_p95": p95(ttft)}


def plot_objectives(results: dict[str, Any], out: Path, max_backends: int = 4) -> str | None:
    """TPOT p95 (all classes) and P0's TTFT p95 per backend over time, with P0's
    objectives; one row per arm with a gateway. Returns the file name, None if nothing."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    arms = {
        k: v["series"]["objectives"]
        for k, v in results["arms"].items()
        if v.get("series", {}).get("objectives")
    }
    if not arms:
        return None
    p0 = results.get("slos", {}).get("P0", {})
    fig, axes = plt.subplots(
        len(arms), 2, figsize=(12, 2.4 * len(arms) + 0.8), sharex=True, squeeze=False
    )
    fig.suptitle("Per backend: TPOT p95 (ended requests) and P0 TTFT p95, against P0's objective")
    for row, (name, s) in zip(axes, arms.items(), strict=True):
        xs = [(i + 0.5) * s["bin_s"] for i in range(len(s["tpot_p95"][0]) if s["tpot_p95"] else 0)]
        for col, key, objective, label in (
            (row[0], "tpot_p95", p0.get("tpot"), "TPOT p95 s"),
            (row[1], "p0_ttft_p95", p0.get("ttft"), "P0 TTFT p95 s"),
        ):
            for b, ys in enumerate(s[key][:max_backends]):
                col.plot(xs, [math.nan if y is None else y for y in ys], lw=0.9, label=f"b{b}")
            if objective:
                col.axhline(objective, color="tab:red", lw=1, ls="--", label="objective")
            col.set_ylabel(f"{name}\n{label}", fontsize=8)
            col.set_ylim(bottom=0)
    axes[0][0].legend(loc="upper left", fontsize=7)
    for col in axes[-1]:
        col.set_xlabel("time (s)")
    fig.tight_layout()
    name = "objectives.png"
    fig.savefig(out / name, dpi=90)
    plt.close(fig)
    return name
