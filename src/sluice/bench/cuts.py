"""What Sluice's limiters did in a run: their state at the end (`describe()`: cuts by
reason, latency limit, bases, EWMAs) and their cuts by reason over time, read from the
controller's snapshot -- in virtual time from the Controller, in real mode from the
gateway's /admin/state (`ControllerSnapshot.from_dict`) -- so the two modes can be
compared cut for cut."""

from __future__ import annotations

from typing import Any

from sluice.core.snapshot import ControllerSnapshot


def limiter_states(snapshot: ControllerSnapshot | None) -> dict[str, Any] | None:
    """Per backend, the limiter's state at the end of the run (`describe()`: its cuts by
    reason, latency limit, bases and EWMAs), from the controller's snapshot; None for arms
    without Sluice's controller."""
    if snapshot is None:
        return None
    out = {}
    for name, b in snapshot.backends.items():
        if b.limiter is not None:
            out[name] = {"limit": b.limit, **b.limiter}
    return out or None


def cuts_so_far(snapshot: ControllerSnapshot) -> dict[str, int]:
    """Limit cuts by reason so far, summed over the backends of a controller snapshot
    (from each limiter's `describe()`, whose fields are its algorithm's: those without
    `cut_reasons` count none)."""
    total: dict[str, int] = {}
    for b in snapshot.backends.values():
        reasons = (b.limiter or {}).get("cut_reasons")
        if isinstance(reasons, dict):
            for reason, n in reasons.items():
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
