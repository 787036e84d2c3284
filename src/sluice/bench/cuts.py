"""What Sluice's limiters did in a run: their state at the end (`describe()`: cuts by
reason, latency limit, bases, EWMAs) and their cuts by reason over time, read from the
controller's snapshot -- in virtual time from the Controller, in real mode from the
gateway's /admin/state -- so the two modes can be compared cut for cut."""

from __future__ import annotations

from typing import Any


def limiter_states(snapshot: dict[str, Any] | None) -> dict[str, Any] | None:
    """Per backend, the limiter's state at the end of the run (`describe()`: its cuts by
    reason, latency limit, bases and EWMAs), from the controller's snapshot; None for arms
    without Sluice's controller."""
    if not snapshot:
        return None
    out = {}
    for name, b in snapshot.get("backends", {}).items():
        lim = b.get("limiter")
        if isinstance(lim, dict):
            out[name] = {"limit": b.get("limit"), **lim}
    return out or None


def cuts_so_far(snapshot: dict[str, Any]) -> dict[str, int]:
    """Limit cuts by reason so far, summed over the backends of a controller snapshot."""
    total: dict[str, int] = {}
    for b in snapshot.get("backends", {}).values():
        for reason, n in (b.get("limiter") or {}).get("cut_reasons", {}).items():
            total[reason] = total.get(reason, 0) + int(n)
    return total


def add_cuts_sample(series: dict[str, Any], n_samples: int, cuts: dict[str, int]) -> None:
    """Append one sample of cumulative cuts by reason to `series["cuts"]` (a reason first
    seen now gets zeros before)."""
    col = series.setdefault("cuts", {})
    for reason, n in cuts.items():
        col.setdefault(reason, [0] * (n_samples - 1)).append(n)
    for values in col.values():
        if len(values) < n_samples:
            values.append(values[-1] if values else 0)
