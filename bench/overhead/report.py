"""Aggregate the overhead benchmark's phases into results.json, a markdown table and a chart."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from sluice.bench.procfs import TICK_HZ

COARSE_TICKS = 25  # below this a mode's CPU total is quantised by more than ~4%

MODES = {
    "json": "non-streaming",
    "stream": "streaming, as fast as possible",
    "paced": "streaming, paced one chunk per read",
    "serial": "non-streaming, one request at a time (latency without queueing)",
}


def _pct(values: list[float], q: float) -> float | None:
    return float(np.percentile(values, q)) * 1000.0 if values else None


def _sub(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else a - b


def aggregate(
    phases: list[dict[str, Any]], arms: list[str], modes: list[str], floor: str
) -> dict[str, Any]:
    """Pool every round of each (arm, mode): latencies, proxy CPU, relayed chunks."""
    out: dict[str, dict[str, Any]] = {}
    for arm in arms:
        out[arm] = {}
        for mode in modes:
            mine = [p for p in phases if p["arm"] == arm and p["mode"] == mode]
            if not mine:
                continue
            lat = [x for p in mine for x in p["latencies_s"]]
            ttft = [x for p in mine for x in p["ttfts_s"]]
            ok = sum(len(p["latencies_s"]) for p in mine)
            events = sum(p["events"] for p in mine)
            errors: dict[str, int] = {}
            for p in mine:
                for k, v in p["errors"].items():
                    errors[k] = errors.get(k, 0) + v
            cpu = None if mine[0]["cpu_s"] is None else sum(p["cpu_s"] for p in mine)
            sent = ok + sum(errors.values())
            per_round = [
                p["cpu_s"] * 1000.0 / max(1, len(p["latencies_s"]))
                for p in mine
                if p["cpu_s"] is not None
            ]
            out[arm][mode] = {
                "requests": ok,
                "errors": errors,
                "chunks": events,
                "latency_p50_ms": _pct(lat, 50),
                "latency_p99_ms": _pct(lat, 99),
                "ttft_p50_ms": _pct(ttft, 50),
                "ttft_p99_ms": _pct(ttft, 99),
                "proxy_cpu_s": cpu,
                "proxy_cpu_ticks": None if cpu is None else round(cpu * TICK_HZ),
                "cpu_ms_per_request": None if cpu is None else cpu * 1000.0 / max(1, sent),
                "cpu_us_per_chunk": None if cpu is None or not events else cpu * 1e6 / events,
                "cpu_ms_per_request_by_round": per_round,
                "busy_fraction_mean": float(np.mean([p["busy_mean"] for p in mine])),
                "busy_fraction_max": max(p["busy_max"] for p in mine),
                "wall_s": sum(p["wall_s"] for p in mine),
            }
    # Differences against direct; CPU ratios against nginx and the bare pass-through (`floor`).
    for mode in modes:
        base = out.get("direct", {}).get(mode)
        refs = {"nginx": out.get("nginx", {}).get(mode), "bare": out.get(floor, {}).get(mode)}
        for arm in arms:
            row = out[arm].get(mode)
            if row is None:
                continue
            for q in ("p50", "p99"):
                row[f"added_{q}_ms"] = _sub(
                    row[f"latency_{q}_ms"], base and base[f"latency_{q}_ms"]
                )
                row[f"added_ttft_{q}_ms"] = _sub(row[f"ttft_{q}_ms"], base and base[f"ttft_{q}_ms"])
            for key in ("cpu_ms_per_request", "cpu_us_per_chunk"):
                for ref_name, ref in refs.items():
                    mine_v, ref_v = row[key], ref and ref[key]
                    ratio = mine_v / ref_v if mine_v is not None and ref_v else None
                    row[f"{key}_vs_{ref_name}"] = ratio
    return out


def _f(v: float | None, digits: int = 2) -> str:
    return "–" if v is None else f"{v:.{digits}f}"


def markdown(results: dict[str, Any]) -> str:
    cfg = results["config"]
    cpu = results["cpu"]
    lines = [
        "# Proxy overhead",
        "",
        f"{cfg['rounds']} interleaved round(s); per arm and round: {cfg['requests']} non-streaming,"
        f" {cfg['stream_requests']} streaming, {cfg['paced_requests']} paced requests at"
        f" concurrency {cfg['concurrency']} and {cfg['serial_requests']} serial requests at"
        f" concurrency 1; {cfg['chunks']} chunks per stream,"
        f" paced every {cfg['interval_ms']:g} ms. {cfg['cores']} cores.",
        f"Machine busy fraction (whole machine, /proc/stat): mean over phases"
        f" {cpu['busy_fraction_mean']:.2f}, max 250 ms sample"
        f" {cpu['busy_fraction_max']:.2f}; saturated: **{'yes' if cpu['saturated'] else 'no'}**"
        f" ({', '.join(cpu['saturated_modes']) or 'no mode'}).",
        "Added latency = arm percentile − direct percentile (to the last byte of the answer)."
        " CPU = the proxy's processes' utime+stime from /proc, per request sent and per relayed"
        " SSE chunk (per-chunk includes each stream's per-request share). × bare = CPU relative"
        " to the bare pass-through on the gateway's own stack (Sluice's goal: at most 1.3).",
        "",
    ]
    coarse = [
        f"{results['labels'][a]} / {m}: {r['proxy_cpu_ticks']} ticks"
        for a, by_mode in results["arms"].items()
        for m, r in by_mode.items()
        if r["proxy_cpu_ticks"] is not None and r["proxy_cpu_ticks"] < COARSE_TICKS
    ]
    if coarse:
        lines += [
            f"Coarse CPU figures (/proc counts {1000 / TICK_HZ:g} ms ticks; under"
            f" {COARSE_TICKS} ticks in all): {'; '.join(coarse)}. Raise --requests or --rounds.",
            "",
        ]
    for arm, notes in results.get("notes", {}).items():
        if arm in results["labels"]:
            lines.append(f"- {results['labels'][arm]}: {'; '.join(notes)}")
    for arm, why in results["skipped"].items():
        lines.append(f"- **{arm} skipped**: {why.splitlines()[0]}")
    if results["skipped"] or results.get("notes"):
        lines.append("")
    arms = results["arms"]
    for mode, title in MODES.items():
        rows = [(a, arms[a][mode]) for a in arms if mode in arms[a]]
        if not rows:
            continue
        lines += [
            f"## {title}",
            "",
            "| arm | p50 ms | p99 ms | added p50 ms | added p99 ms | added TTFT p50 ms"
            " | CPU ms/req | CPU µs/chunk | CPU × nginx | CPU × bare | busy mean | errors |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for arm, r in rows:
            streamed = mode in ("stream", "paced")
            key = "cpu_us_per_chunk" if streamed else "cpu_ms_per_request"
            lines.append(
                f"| {results['labels'][arm]}"
                f" | {_f(r['latency_p50_ms'])} | {_f(r['latency_p99_ms'])}"
                f" | {_f(r['added_p50_ms'])} | {_f(r['added_p99_ms'])}"
                f" | {_f(r['added_ttft_p50_ms']) if streamed else '–'}"
                f" | {_f(r['cpu_ms_per_request'], 3)}"
                f" | {_f(r['cpu_us_per_chunk'], 1) if streamed else '–'}"
                f" | {_f(r[key + '_vs_nginx'], 1)} | {_f(r[key + '_vs_bare'], 2)}"
                f" | {r['busy_fraction_mean']:.2f}"
                f" | {sum(r['errors'].values())} |"
            )
        lines.append("")
    return "\n".join(lines)


def chart(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    arms = [a for a in results["arms"] if a != "direct"]
    labels = [results["labels"][a].replace(" (", "\n(") for a in arms]
    colors = plt.get_cmap("tab10").colors
    panels = [
        ("json", "cpu_ms_per_request", "CPU ms per request\n(non-streaming)"),
        ("stream", "cpu_us_per_chunk", "CPU µs per chunk\n(streaming, fast)"),
        ("paced", "cpu_us_per_chunk", "CPU µs per chunk\n(streaming, paced)"),
        ("serial", "added_p50_ms", "added p50 ms\n(non-streaming, one at a time)"),
    ]
    fig, axes = plt.subplots(1, len(panels), figsize=(4 * len(panels), 4.2))
    for ax, (mode, key, title) in zip(axes, panels, strict=True):
        vals = [results["arms"][a].get(mode, {}).get(key) for a in arms]
        xs = range(len(arms))
        ax.bar(xs, [v or 0.0 for v in vals], color=[colors[i % 10] for i in xs])
        for x, v in zip(xs, vals, strict=True):
            ax.annotate(
                _f(v, 3 if key == "cpu_ms_per_request" else 1),
                (x, v or 0.0),
                ha="center",
                va="bottom",
                fontsize=8,
            )
        ax.set_xticks(list(xs), labels, rotation=30, ha="right", fontsize=8)
        ax.set_title(title, fontsize=10)
        ax.grid(axis="y", alpha=0.3)
    sat = (
        " (CPU saturated in: " + ", ".join(results["cpu"]["saturated_modes"]) + ")"
        if results["cpu"]["saturated"]
        else ""
    )
    fig.suptitle(
        f"Proxy overhead on loopback, {results['config']['cores']} cores{sat}", fontsize=11
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
