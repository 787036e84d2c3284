"""Turn a results.json document into PNG plots and a short report.md beside it."""

# The plots reuse short names (xs, ys, axes) for lists, tuples and arrays alike.
# mypy: disable-error-code="assignment"

from __future__ import annotations

from pathlib import Path
from typing import Any

CLASS_COLOURS = {"P0": "tab:red", "P1": "tab:blue", "P2": "tab:green"}
ARM_COLOURS = {
    "direct": "tab:gray",
    "static": "tab:orange",
    "fifo": "tab:purple",
    "sluice": "tab:blue",
    "slo": "navy",
    "tpot-target": "slateblue",
    "oracle": "tab:green",
    "gie": "tab:brown",
    "gie-flow": "tab:pink",
    "litellm": "tab:olive",
    "envoy": "tab:cyan",
    "ra-drain": "tab:gray",
    "ra-60s": "tab:purple",
    "ra-1s": "tab:red",
}
MAX_BACKENDS_PLOTTED = 4


def _fmt(x: Any, pct: bool = False, nd: int = 2) -> str:
    if x is None:
        return "-"
    if pct:
        return f"{100 * x:.1f}%"
    if isinstance(x, float):
        return f"{x:.{nd}f}"
    return str(x)


def _running_of_spot(phase: dict[str, Any]) -> str:
    """A phase's mean running per engine, and its share of the phase's sweet spot."""
    running = phase.get("backend_running_mean")
    spot = phase.get("sweet_spot")
    if running is None:
        return "-"
    if not spot:
        return f"{running:.1f}"
    return f"{running:.1f} ({100 * running / spot:.0f}%)"


def _delivered(arm: dict[str, Any]) -> str:
    """Tokens delivered within the scenario's window, and what a real run delivered after
    it (a gateway arm's run lasts until its longest Retry-After has come back)."""
    cell = _fmt(arm.get("tokens_delivered"))
    late = arm.get("tokens_delivered_after_window")
    return f"{cell} (+{late} after)" if late else cell


def summary_rows(results: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    """The headline table: one row per arm (shared by report.md and the console)."""
    head = [
        "arm",
        "P0 SLO",
        "P0 TTFT p95 s",
        "P1 SLO",
        "P2 SLO",
        "goodput tok/s",
        "tokens delivered",
        "running mean / max",
        "preemptions",
        "wasted tokens",
        "refused (attempts)",
        "retry admitted",
        "refusal order",
    ]
    rows = []
    for name, a in results["arms"].items():
        c = a["classes"]
        ra = a.get("retry_admission", {})
        running = a.get("backend_running") or {}
        rows.append(
            [
                name,
                _fmt(c["P0"]["slo_attainment"], pct=True),
                _fmt(c["P0"]["ttft_p95_s"]),
                _fmt(c["P1"]["slo_attainment"], pct=True),
                _fmt(c["P2"]["slo_attainment"], pct=True),
                f"{a['goodput_tokens_per_s']:.0f}",
                _delivered(a),
                f"{_fmt(running.get('mean'), nd=1)} / {_fmt(running.get('max'))}",
                str(a["backend_preemptions"]),
                str(a["wasted_tokens"]),
                str(sum(a.get("rejections_by_cause", {}).values())),
                _fmt(ra.get("ratio"), pct=True),
                a.get("refusal_order", "-"),
            ]
        )
    return head, rows


def cpu_rows(results: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    """Real mode: per arm, the machine's busy fraction, who used the CPU (this bench's
    simulators, gateway and load generator, and other work), and how late the load
    generator sent its arrivals."""
    head = [
        "arm",
        "busy max",
        "busy mean",
        "sims",
        "gateway",
        "load generator",
        "other work",
        "arrivals late p99 ms",
        "saturated",
    ]
    rows = []
    for name, a in results["arms"].items():
        cpu = a.get("cpu")
        if not cpu:
            continue
        cores = cpu.get("cores_used_mean", {})
        late = cpu.get("arrival_late_p99_s")
        rows.append(
            [
                name,
                _fmt(cpu.get("busy_fraction_max"), pct=True),
                _fmt(cpu.get("busy_fraction_mean"), pct=True),
                _fmt(cores.get("sims")),
                _fmt(cores.get("gateway")),
                _fmt(cores.get("bench")),
                _fmt(cores.get("other")),
                "-" if late is None else f"{1000 * late:.0f}",
                "yes" if cpu.get("saturated") else "no",
            ]
        )
    return head, rows


def class_rows(results: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    head = [
        "arm",
        "class",
        "offered",
        "completed",
        "rejected",
        "timed out",
        "TTFT p50 s",
        "TTFT p95 s",
        "TPOT p95 ms",
        "SLO",
        "goodput tok/s",
    ]
    rows = []
    for name, a in results["arms"].items():
        for cls, c in a["classes"].items():
            tpot = c.get("tpot_p95_s")
            rows.append(
                [
                    name,
                    cls,
                    str(c.get("offered", "-")),
                    str(c["completed"]),
                    str(c["rejected"]),
                    str(c.get("timed_out", "-")),
                    _fmt(c["ttft_p50_s"]),
                    _fmt(c["ttft_p95_s"]),
                    "-" if tpot is None else f"{1000 * tpot:.0f}",
                    _fmt(c["slo_attainment"], pct=True),
                    _fmt(c.get("goodput_tokens_per_s"), nd=0),
                ]
            )
    return head, rows


def returns_rows(results: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    """Refused requests and their returns, per arm and class (bench/returns.py)."""
    head = [
        "arm",
        "class",
        "refused",
        "Retry-After p50 / p90 / max s",
        "came back at it",
        "admitted on return",
        "later served",
        "told cannot serve in time",
        "refusal to served p50 / p90 s",
        "hindsight p50 s",
        "p50 / hindsight",
    ]
    rows = []
    for name, a in results["arms"].items():
        for cls, c in (a.get("returns") or {}).get("classes", {}).items():
            if not c["refused"]:
                continue
            ra = c["retry_after_s"]
            ts = c["refusal_to_served_s"]
            rows.append(
                [
                    name,
                    cls,
                    str(c["refused"]),
                    f"{_fmt(ra['p50'], nd=1)} / {_fmt(ra['p90'], nd=1)} / {_fmt(ra['max'], nd=1)}",
                    str(c["came_back_at_retry_after"]),
                    _fmt(c["admitted_share"], pct=True),
                    _fmt(c["served_share"], pct=True),
                    str(c["told_cannot_serve_in_time"]),
                    f"{_fmt(ts['p50'], nd=1)} / {_fmt(ts['p90'], nd=1)}",
                    _fmt(c["hindsight_s"]["p50"], nd=1),
                    _fmt(c["vs_hindsight_p50"]),
                ]
            )
    return head, rows


def retry_after_rows(results: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    """One row per arm: the issue-17 figures side by side with the burst must-show."""
    head = [
        "arm",
        "admitted on return",
        "P1 p50 / hindsight",
        "P2 p50 / hindsight",
        "busiest 100 ms / mean: recovery, after the burst",
        "P1 / P2 later served",
        "P0 TTFT SLO",
        "preemptions",
        "refusal order",
        "goodput tok/s",
    ]
    rows = []
    for name, a in results["arms"].items():
        rt = a.get("returns")
        if not rt or not any(c["refused"] for c in rt["classes"].values()):
            continue
        cl = rt["classes"]
        rows.append(
            [
                name,
                _fmt(rt["admitted_share"], pct=True),
                _fmt(cl["P1"]["vs_hindsight_p50"]),
                _fmt(cl["P2"]["vs_hindsight_p50"]),
                f"{_fmt(rt['returns_peak_recovery'].get('ratio'))}, "
                f"{_fmt(rt['returns_peak_after_burst'].get('ratio'))}",
                f"{_fmt(cl['P1']['served_share'], pct=True)} / "
                f"{_fmt(cl['P2']['served_share'], pct=True)}",
                _fmt(a["classes"]["P0"].get("ttft_slo_attainment"), pct=True),
                str(a["backend_preemptions"]),
                a.get("refusal_order", "-"),
                f"{a['goodput_tokens_per_s']:.0f}",
            ]
        )
    return head, rows


def route_rows(results: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    """Per route and class, for the scenarios with several routes."""
    head = ["arm", "route", "class", "offered", "completed", "rejected", "TTFT p95 s", "SLO"]
    rows = []
    for name, a in results["arms"].items():
        for route, by_class in (a.get("routes") or {}).items():
            for cls, c in by_class.items():
                rows.append(
                    [
                        name,
                        route,
                        cls,
                        str(c["offered"]),
                        str(c["completed"]),
                        str(c["rejected"]),
                        _fmt(c["ttft_p95_s"]),
                        _fmt(c["slo_attainment"], pct=True),
                    ]
                )
    return head, rows


def _md_table(head: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def write_plots(results: dict[str, Any], out: Path) -> list[str]:
    """Write the PNGs; returns their file names."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    arms = {k: v for k, v in results["arms"].items() if v.get("series")}
    if not arms:
        return []
    files: list[str] = []
    gateway = {
        k: v for k, v in arms.items() if v["series"].get("limit") and v["series"]["limit"][0]
    }
    phases = results.get("plan", {}).get("phases", [])

    def mark_phases(ax: Any) -> None:
        for p in phases[1:]:
            ax.axvline(p["start_s"], color="k", lw=0.6, ls=":")

    def grid(n: int, title: str, height: float = 2.4) -> tuple[Any, list[Any]]:
        fig, axes = plt.subplots(n, 1, figsize=(9, height * n + 0.6), sharex=True, squeeze=False)
        fig.suptitle(title)
        return fig, [row[0] for row in axes]

    def save(fig: Any, name: str) -> None:
        fig.tight_layout()
        fig.savefig(out / name, dpi=90)
        plt.close(fig)
        files.append(name)

    # limit and in-flight per backend
    if gateway:
        fig, axes = grid(
            len(gateway), "Limit (solid), in-flight (dotted), engine running (dash-dot)"
        )
        for ax, (name, a) in zip(axes, gateway.items(), strict=True):
            s = a["series"]
            for b in range(min(MAX_BACKENDS_PLOTTED, len(s["limit"]))):
                (line,) = ax.plot(s["t"], s["limit"][b], lw=1.2, label=f"{s['backends'][b]} limit")
                ax.plot(s["t"], s["inflight"][b], lw=0.8, ls=":", color=line.get_color())
                if s.get("running"):
                    ax.plot(s["t"], s["running"][b], lw=0.6, ls="-.", color=line.get_color())
            ax.set_ylabel(name)
            mark_phases(ax)
        axes[-1].set_xlabel("time (s)")
        save(fig, "limit_inflight.png")

    # what the engines ran, every arm, against the sweet spot
    sweet = [p["sweet_spot_per_backend"] for p in phases]
    with_running = {k: v for k, v in arms.items() if v["series"].get("running")}
    if with_running:
        fig, axes = grid(1, "Requests the engines ran (mean over backends) and the sweet spot", 3.2)
        ax = axes[0]
        for name, a in with_running.items():
            s = a["series"]
            cols = s["running"]
            mean = [sum(col[k] for col in cols) / len(cols) for k in range(len(s["t"]))]
            ax.plot(s["t"], mean, lw=1, color=ARM_COLOURS.get(name), label=name)
        for p, spot in zip(phases, sweet, strict=True):
            ax.hlines(spot, p["start_s"], p["end_s"], colors="k", lw=0.8, ls="--")
        ax.set_ylabel("running")
        ax.set_xlabel("time (s)")
        ax.legend(loc="upper right", fontsize=8)
        mark_phases(ax)
        save(fig, "running.png")

    # a trace's arrivals over time against capacity
    arrivals = results.get("plan", {}).get("arrivals")
    if arrivals:
        fig, axes = grid(1, "Offered load: arrivals per second (bins) and capacity", 3.0)
        ax = axes[0]
        width = arrivals["bin_s"]
        xs = [i * width for i in range(len(arrivals["per_s"]))]
        ax.step(xs, arrivals["per_s"], where="post", lw=1, color="k", label="arrivals/s")
        cap = phases[0]["capacity_rps"] if phases else None
        if cap:
            ax.axhline(cap, color="tab:red", lw=0.8, ls="--", label="capacity")
        ax.set_ylabel("requests/s")
        ax.set_xlabel("time (s)")
        ax.legend(loc="upper left", fontsize=8)
        save(fig, "arrivals.png")

    # TTFT per class
    fig, axes = grid(len(arms), "TTFT per class (from the first attempt), log scale")
    for ax, (name, a) in zip(axes, arms.items(), strict=True):
        # P2 first so that P0, the class that matters most here, is drawn on top
        for cls, pts in sorted(a["series"].get("ttft", {}).items(), reverse=True):
            if pts:
                xs, ys = zip(*pts, strict=True)
                ax.scatter(xs, ys, s=2, color=CLASS_COLOURS[cls], label=cls, alpha=0.5)
        ax.set_yscale("log")
        ax.axhline(1.0, color="tab:red", lw=0.6, ls="--")
        ax.set_ylabel(name)
        mark_phases(ax)
    axes[0].legend(loc="upper left", markerscale=4, fontsize=8)
    axes[-1].set_xlabel("time of the first token (s)")
    save(fig, "ttft.png")

    # queue depth per class
    if gateway:
        fig, axes = grid(len(gateway), "Gateway queue depth per class")
        for ax, (name, a) in zip(axes, gateway.items(), strict=True):
            s = a["series"]
            for cls, col in s["queued"].items():
                ax.plot(s["t"], col, color=CLASS_COLOURS[cls], lw=1, label=cls)
            ax.set_ylabel(name)
            mark_phases(ax)
        axes[0].legend(loc="upper left", fontsize=8)
        axes[-1].set_xlabel("time (s)")
        save(fig, "queue_depth.png")

    # KV usage: the fullest backend, per arm
    fig, axes = grid(1, "KV-cache usage (fullest backend) and engine waiting queue", 3.2)
    ax = axes[0]
    for name, a in arms.items():
        s = a["series"]
        kv = [max(col[k] for col in s["kv_usage"]) for k in range(len(s["t"]))]
        ax.plot(s["t"], kv, lw=1, color=ARM_COLOURS.get(name), label=name)
    ax.set_ylim(0, 1.05)
    ax.set_ylabel("KV usage")
    ax.set_xlabel("time (s)")
    ax.legend(loc="upper left", fontsize=8)
    mark_phases(ax)
    save(fig, "kv_usage.png")

    # refused clients coming back, per arm: returns (at a Retry-After) and refusals per bin
    with_ret = {
        k: v
        for k, v in arms.items()
        if (v.get("returns") or {}).get("series", {}).get("returns")
        and any(v["returns"]["classes"][c]["refused"] for c in v["returns"]["classes"])
    }
    if with_ret:
        fig, axes = grid(
            len(with_ret),
            "Refused clients coming back (returns/s, by class; grey: first refusals/s)",
        )
        for ax, (name, a) in zip(axes, with_ret.items(), strict=True):
            ser = a["returns"]["series"]
            width = ser["bin_s"]
            bottom: list[float] | None = None
            for cls in ("P1", "P2", "P0"):
                col = ser["returns"].get(cls) or []
                if not any(col):
                    continue
                xs = [i * width for i in range(len(col))]
                ys = [n / width for n in col]
                ax.bar(
                    xs,
                    ys,
                    width=width,
                    bottom=bottom,
                    color=CLASS_COLOURS[cls],
                    label=cls,
                    align="edge",
                    alpha=0.8,
                )
                bottom = ys if bottom is None else [b + y for b, y in zip(bottom, ys, strict=True)]
            ref = [sum(v) for v in zip(*ser["refusals"].values(), strict=True)]
            ax.plot(
                [i * width for i in range(len(ref))], [n / width for n in ref], color="0.4", lw=0.8
            )
            rec = a["returns"].get("recovery_s") or []
            if rec and rec[0] is not None:
                ax.axvspan(rec[0], rec[1] or ax.get_xlim()[1], color="0.9", zorder=0)
            ax.set_ylabel(name)
            mark_phases(ax)
        axes[0].legend(loc="upper right", fontsize=8)
        axes[-1].set_xlabel("time (s); shaded: the recovery the busiest 100 ms is measured in")
        save(fig, "returns.png")

        # time from the first refusal to being served, against the hindsight earliest
        fig, axes = plt.subplots(1, 2, figsize=(10, 3.6), squeeze=False)
        fig.suptitle("First refusal to served (solid) and hindsight earliest (dashed), CDF")
        for ax, cls in zip(axes[0], ("P1", "P2"), strict=True):
            for name, a in with_ret.items():
                smp = a["returns"]["samples"].get(cls) or {}
                colour = ARM_COLOURS.get(name)
                for key, ls in (("refusal_to_served_s", "-"), ("hindsight_s", "--")):
                    v = smp.get(key) or []
                    if v:
                        ax.plot(
                            v,
                            [(i + 1) / len(v) for i in range(len(v))],
                            ls=ls,
                            lw=1.1,
                            color=colour,
                            label=name if ls == "-" else None,
                        )
            ax.set_title(cls)
            ax.set_xlabel("seconds after the first refusal")
            ax.set_ylim(0, 1.02)
        axes[0][0].set_ylabel("share of the refused later served")
        if axes[0][0].get_legend_handles_labels()[0]:
            axes[0][0].legend(loc="lower right", fontsize=8)
        save(fig, "refusal_to_served.png")

    # rejections by cause
    with_rej = {k: v for k, v in arms.items() if v["series"].get("rejected_cumulative")}
    if with_rej:
        fig, axes = grid(len(with_rej), "Refusals by cause (cumulative attempts)")
        for ax, (name, a) in zip(axes, with_rej.items(), strict=True):
            s = a["series"]
            for code, col in s["rejected_cumulative"].items():
                ax.plot(s["t"][: len(col)], col, lw=1, label=code)
            ax.set_ylabel(name)
            ax.legend(loc="upper left", fontsize=7)
            mark_phases(ax)
        axes[-1].set_xlabel("time (s)")
        save(fig, "rejections.png")

    # Sluice's limit cuts by reason (which signal held the limit down)
    with_cuts = {k: v for k, v in arms.items() if v["series"].get("cuts")}
    if with_cuts:
        fig, axes = grid(len(with_cuts), "Limit cuts by reason (cumulative, all backends)")
        for ax, (name, a) in zip(axes, with_cuts.items(), strict=True):
            s = a["series"]
            for reason, col in sorted(s["cuts"].items()):
                ax.plot(s["t"][: len(col)], col, lw=1, label=reason)
            ax.set_ylabel(name)
            ax.legend(loc="upper left", fontsize=7)
            mark_phases(ax)
        axes[-1].set_xlabel("time (s)")
        save(fig, "limit_cuts.png")

    # SLO attainment per route and class (scenarios with several routes)
    routed = {k: v for k, v in arms.items() if v.get("routes")}
    if routed:
        fig, axes = plt.subplots(
            1, len(routed), figsize=(4.2 * len(routed), 3.4), sharey=True, squeeze=False
        )
        fig.suptitle("SLO attainment by route and class")
        for ax, (name, a) in zip(axes[0], routed.items(), strict=True):
            routes = list(a["routes"])
            classes = list(CLASS_COLOURS)
            width = 0.8 / len(classes)
            for k, cls in enumerate(classes):
                values = [
                    (a["routes"][r].get(cls) or {}).get("slo_attainment") or 0 for r in routes
                ]
                xs = [i + (k - 1) * width for i in range(len(routes))]
                ax.bar(xs, values, width, label=cls, color=CLASS_COLOURS[cls])
            ax.set_xticks(range(len(routes)), routes, rotation=20, fontsize=8)
            ax.set_ylim(0, 1.05)
            ax.set_title(name, fontsize=9)
        axes[0][0].set_ylabel("share of offered requests")
        axes[0][0].legend(fontsize=7)
        save(fig, "routes_slo.png")

    # each backend's TPOT and TTFT against the objectives (bench.objectives)
    from sluice.bench.objectives import plot_objectives

    if (name := plot_objectives(results, out)) is not None:
        files.append(name)
    if results.get("fleet_sweep"):
        from sluice.bench.fleet_sweep import plot_sweep

        files.append(plot_sweep(results["fleet_sweep"], out))
    from sluice.bench.quota_figures import plot as plot_quotas

    if (name := plot_quotas(results, out)) is not None:
        files.append(name)
    return files


def write_sweep_plot(doc: dict[str, Any], out: Path) -> str:
    """`sweep.png` of a `--sweep` document: output tokens/s and the clients' TPOT p95 per
    level, each mode, preempting levels marked, the sweet spot each mode found."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 5.4), sharex=True)
    fig.suptitle(f"Closed-loop sweep, {doc['scenario']} (one backend)")
    for mode, style in (("virtual", "-"), ("real", "--")):
        d = doc.get(mode)
        if not d:
            continue
        rows = d["levels"]
        xs = [r["concurrency"] for r in rows]
        colour = "tab:blue" if mode == "virtual" else "tab:orange"
        top.plot(
            xs,
            [r["tokens_per_s"] for r in rows],
            ls=style,
            marker="o",
            ms=3,
            color=colour,
            label=f"{mode} tokens/s",
        )
        hot = [r for r in rows if r["preemptions"] > 0]
        if hot:
            top.scatter(
                [r["concurrency"] for r in hot],
                [r["tokens_per_s"] for r in hot],
                marker="x",
                s=40,
                color="tab:red",
                zorder=3,
            )
        tpot = [(r["concurrency"], 1000 * r["tpot_p95_s"]) for r in rows if r["tpot_p95_s"]]
        if tpot:
            bottom.plot(
                *zip(*tpot, strict=True),
                ls=style,
                marker="o",
                ms=3,
                color=colour,
                label=f"{mode} TPOT p95",
            )
        if d.get("sweet_spot") is not None:
            for ax in (top, bottom):
                ax.axvline(d["sweet_spot"], color=colour, lw=0.8, ls=":")
    top.scatter([], [], marker="x", color="tab:red", label="preemptions")
    top.set_ylabel("output tokens/s")
    top.legend(loc="lower right", fontsize=8)
    bottom.set_ylabel("TPOT p95 (ms)")
    bottom.set_xlabel("requests in flight (dotted: each mode's sweet spot)")
    bottom.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "sweep.png", dpi=90)
    plt.close(fig)
    return "sweep.png"


def write_report(results: dict[str, Any], out: Path, plots: list[str]) -> Path:
    lines = [f"# sluice bench: {results['scenario']} ({results['mode']})", ""]
    if results.get("description"):
        lines += [results["description"], ""]
    cpu = results.get("cpu") or {}
    if results["mode"] == "real":
        busy = cpu.get("busy_fraction_max")
        lines += [
            f"CPU busy (max of 1 s samples, whole machine): {_fmt(busy, pct=True)}"
            + (" -- SATURATED: these figures do not count." if cpu.get("saturated") else ""),
            "",
        ]
    plan = results.get("plan")
    if plan:
        lines += [
            f"{plan['backends']} backends ({plan['profile']}), {plan['requests']} requests, "
            f"seed {results.get('seed')}.",
            "",
            _md_table(
                [
                    "phase",
                    "from s",
                    "to s",
                    "x capacity",
                    "offered req/s",
                    "capacity req/s",
                    "sweet spot / backend",
                ],
                [
                    [
                        p["name"],
                        _fmt(p["start_s"], nd=1),
                        _fmt(p["end_s"], nd=1),
                        _fmt(p.get("rate_x_capacity")),
                        _fmt(p["offered_rps"]),
                        _fmt(p["capacity_rps"]),
                        str(p["sweet_spot_per_backend"]),
                    ]
                    for p in plan["phases"]
                ],
            ),
            "",
        ]
    head, rows = summary_rows(results)
    lines += ["## Summary", "", _md_table(head, rows), ""]
    if results.get("fleet_sweep"):
        lines += fleet_sweep_lines(results["fleet_sweep"])
    head, rows = cpu_rows(results)
    if rows:
        lines += [
            "## CPU during each arm's load (cores: CPU seconds per second of wall time)",
            "",
            _md_table(head, rows),
            "",
        ]
    head, rows = class_rows(results)
    lines += ["## Per class", "", _md_table(head, rows), ""]
    for name, a in results["arms"].items():
        if a.get("quotas"):
            from sluice.bench.quota_figures import report_lines

            lines += report_lines(name, a["quotas"])
    head, rows = retry_after_rows(results)
    if rows:
        lines += [
            "## Retry-After: refused clients and their returns",
            "",
            "Admitted on return: of the attempts that came back at the Retry-After they "
            "were given, the share sent to a backend. p50 / hindsight: the median time "
            "from a request's first refusal to being served, over the median of the "
            "earliest it could have been served in hindsight. Busiest 100 ms: the most "
            "returns in any 100 ms of the recovery, over the mean per 100 ms of the "
            'seconds in which clients came back (docs/bench.md, "Refusals and returns").',
            "",
            _md_table(head, rows),
            "",
        ]
        head, rows = returns_rows(results)
        lines += ["Per class:", "", _md_table(head, rows), ""]
    head, rows = route_rows(results)
    if rows:
        lines += ["## Per route and class", "", _md_table(head, rows), ""]
    phase_rows = []
    for name, a in results["arms"].items():
        for p in a.get("phases", []):
            phase_rows.append(
                [
                    name,
                    p["name"],
                    f"{p['goodput_tokens_per_s']:.0f}",
                    str(p["backend_preemptions"]),
                    _fmt(p["slo_attainment"].get("P0"), pct=True),
                    _running_of_spot(p),
                    _fmt(p.get("limit_settle_s")),
                ]
            )
    if phase_rows:
        lines += [
            "## Per phase (requests by arrival phase)",
            "",
            _md_table(
                [
                    "arm",
                    "phase",
                    "goodput tok/s",
                    "preemptions",
                    "P0 SLO",
                    "running mean (of the sweet spot)",
                    "limit settle s",
                ],
                phase_rows,
            ),
            "",
        ]
    reaction = [
        [
            name,
            str(a["limit_reaction"]["episodes"]),
            str(a["limit_reaction"]["cut"]),
            _fmt(a["limit_reaction"]["p50_s"], nd=3),
            _fmt(a["limit_reaction"]["max_s"], nd=3),
        ]
        for name, a in results["arms"].items()
        if a.get("limit_reaction")
    ]
    if reaction and results["mode"] == "virtual":
        lines += [
            "## Limit reaction (engine starts queueing -> first limit cut)",
            "",
            _md_table(["arm", "episodes", "cut", "p50 s", "max s"], reaction),
            "",
        ]
    if results.get("oracle_sweep"):
        caps = results["arms"].get("oracle", {}).get("caps_per_phase")
        lines += [f"Oracle caps per phase: {caps} (sweep in results.json).", ""]
    timing = results.get("timing", {})
    if timing:
        lines += [f"Wall time: {timing.get('total_s')} s.", ""]
    lines += ["Definitions: docs/bench.md.", ""]
    for name in plots:
        lines += [f"![{name}]({name})", ""]
    path = out / "report.md"
    path.write_text("\n".join(lines), encoding="utf-8")
    return path


def fleet_sweep_lines(sweep: dict[str, Any]) -> list[str]:
    """The fleet sweep's two tables (`bench.fleet_sweep`)."""
    from sluice.bench.fleet_sweep import HEAD, sweep_rows

    every = sweep["replicas_at_scrape_interval_s"]
    return [
        "## The fleet against one gateway",
        "",
        f"Replica counts, each replica scraping every {every:g} s:",
        "",
        _md_table(HEAD, sweep_rows(sweep, "by_replicas")),
        "",
        f"Scrape intervals, {sweep['scrape_intervals_at_replicas']} replicas:",
        "",
        _md_table(HEAD, sweep_rows(sweep, "by_scrape_interval")),
        "",
        f"CPU of the sweep: {sweep['cpu_s']:g} s.",
        "",
    ]
