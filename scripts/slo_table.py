"""The table "today's limiter (`sluice`) against the objective-steered one (`slo`)" from
`sluice bench` results (docs/limiter.md, "`slo`"). Give it result folders (or their
results.json); arms of the same scenario and seed from several runs are put together
(the oracle's sweep is long: run it apart with --arms oracle).

    sluice bench burst --arms sluice,slo --out reports/slo/burst
    sluice bench burst --arms oracle --out reports/slo/burst-oracle
    python scripts/slo_table.py reports/slo/burst reports/slo/burst-oracle
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import orjson


def _load(paths: list[str]) -> dict[tuple[str, int], dict[str, Any]]:
    merged: dict[tuple[str, int], dict[str, Any]] = {}
    for p in paths:
        f = Path(p)
        f = f / "results.json" if f.is_dir() else f
        r = orjson.loads(f.read_bytes())
        key = (r["scenario"], r["seed"])
        merged.setdefault(key, {})
        merged[key].update(r["arms"])
    return merged


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f} %"


def rows(merged: dict[tuple[str, int], dict[str, Any]]) -> list[list[str]]:
    out = []
    for (scenario, seed), arms in sorted(merged.items()):
        oracle = arms.get("oracle", {}).get("goodput_tokens_per_s")
        direct = arms.get("direct", {}).get("goodput_tokens_per_s")
        for name in ("sluice", "slo", "tpot-target"):
            a = arms.get(name)
            if a is None:
                continue
            p0 = a["classes"]["P0"]
            good = a["goodput_tokens_per_s"]
            out.append(
                [
                    f"{scenario} (seed {seed})",
                    name,
                    _pct(p0["slo_attainment"]),
                    f"{1000 * (p0['tpot_p95_s'] or 0):.0f}",
                    f"{p0['ttft_p95_s']:.2f}",
                    str(a["backend_preemptions"]),
                    f"{good:,.0f}",
                    "-" if not oracle else f"{good / oracle:.2f}",
                    "-" if not direct else f"{good / direct:.2f}",
                    f"{a['backend_running']['mean']:.0f}",
                ]
            )
    return out


HEAD = [
    "scenario",
    "limiter",
    "P0 SLO",
    "P0 TPOT p95 ms",
    "P0 TTFT p95 s",
    "preemptions",
    "goodput tok/s",
    "vs oracle",
    "vs direct",
    "running mean",
]


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__, file=sys.stderr)
        return 2
    merged = _load(argv)
    print("| " + " | ".join(HEAD) + " |")
    print("|" + "---|" * len(HEAD))
    for r in rows(merged):
        print("| " + " | ".join(r) + " |")
    for (scenario, _), arms in sorted(merged.items()):
        o = arms.get("oracle")
        if o:
            met = o.get("constraint", {}).get("met_per_phase")
            print(
                f"\n{scenario}: oracle caps per phase {o.get('caps_per_phase')}, P0 SLO "
                f"{_pct(o['classes']['P0']['slo_attainment'])}, goodput "
                f"{o['goodput_tokens_per_s']:,.0f} tok/s, P0 >= 99 % per phase in the sweep: {met}"
            )
        d = arms.get("direct")
        if d:
            print(
                f"{scenario}: direct P0 SLO {_pct(d['classes']['P0']['slo_attainment'])}, "
                f"goodput {d['goodput_tokens_per_s']:,.0f} tok/s"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
