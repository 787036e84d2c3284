"""Refused requests and their returns: what each refusal said, whether the client that came
back at its Retry-After was let in, and how long after its first refusal each request was
served, against the earliest it could have been served in hindsight (docs/bench.md,
"Refusals and returns"). Shared by virtual time and real mode.

Hindsight, from the run's own record. For a class c, the *opportunities* are the moments
the class could have started a request: every dispatch of a request of class c or of a
lower class (c would have gone first), and the capacity left unused: at each sample of
the series, the free slots class c could use (each backend's limit, less P0's reserved
share for P1/P2, less what was in flight), each worth one start per mean slot-holding time
of the class. The hindsight earliest of a served request is the opportunity it gets when
every served request of the class, in the order of its first arrival, takes the first
free opportunity at or after its arrival: one FIFO queue of the class, served with the
capacity the run actually had, nobody waiting outside. A request's hindsight delay is
that time less its first refusal (at least 0). It flatters no Retry-After rule: a rule
that sends clients back late leaves capacity unused, which counts as opportunities; a rule
that sends them back early gets refused returns, which take none. It is an estimate: a
free slot may have had no KV room, and lower classes' requests are not re-served.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from sluice.bench.scenario import CLASSES, Scenario

if TYPE_CHECKING:
    from sluice.bench.harness import ArmRun, ReqState

CANNOT_SERVE_IN_TIME = "cannot_serve_in_time"
PEAK_WINDOW_S = 0.1  # "the busiest 100 ms of returns"
_SERVED = ("ok", "cancelled")


def note_refusal(
    r: ReqState,
    now: float,
    code: str,
    retry_after: float | None,
    booking: str | None = None,
    window_s: float = 0.0,
) -> None:
    """Record a refusal on the client's request: what the next attempt sends back (its
    booking) and how it spreads its return (the window), and the figures kept here."""
    r.booking = booking
    r.booking_due = None if booking is None or retry_after is None else now + retry_after
    r.ra_window = window_s
    if r.first_refused_at is None:
        r.first_refused_at = now
    if retry_after is not None and code != CANNOT_SERVE_IN_TIME:
        r.ra_given.append(retry_after)


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    s = sorted(values)
    return s[max(0, min(len(s) - 1, math.ceil(q * len(s)) - 1))]


def _r(x: float | None, nd: int = 3) -> float | None:
    return None if x is None else round(x, nd)


def opportunities(run: ArmRun, priority: int) -> list[float]:
    """The moments class `priority` could have started a request (module docstring),
    sorted."""
    times = [t for t, p in run.dispatch_log if p >= priority]
    times += _idle_starts(run, priority)
    times.sort()
    return times


def _idle_starts(run: ArmRun, priority: int) -> list[float]:
    s = run.series
    ts: list[float] = s.get("t") or []
    limits: list[list[float]] = s.get("limit") or []
    inflight: list[list[int]] = s.get("inflight") or []
    if len(ts) < 2 or not limits or not limits[0]:
        return []
    holding = _mean_holding(run.requests, priority)
    if holding is None or holding <= 0:
        return []
    share = 1.0 if priority == 0 else 1.0 - run.reserved_p0
    out: list[float] = []
    acc = 0.0
    for k in range(len(ts) - 1):
        free = 0.0
        for lim, inf in zip(limits, inflight, strict=True):
            if k < len(lim) and k < len(inf):
                if not math.isfinite(lim[k]):  # a peer without a limit: no free-slot count
                    continue
                cap = lim[k] if priority == 0 else max(1.0, math.floor(lim[k] * share + 1e-9))
                free += max(0.0, cap - inf[k])
        dt = ts[k + 1] - ts[k]
        acc += free * dt / holding
        n = math.floor(acc)
        if n:
            acc -= n
            out += [ts[k] + dt * (j + 0.5) / n for j in range(n)]
    return out


def _mean_holding(reqs: Sequence[ReqState], priority: int) -> float | None:
    spans = [
        r.end_at - r.sent_at
        for r in reqs
        if r.spec.priority == priority and r.outcome in _SERVED and r.end_at is not None
    ]
    return sum(spans) / len(spans) if spans else None


def hindsight_starts(reqs: Sequence[ReqState], opps: list[float]) -> dict[int, float]:
    """FIFO by first arrival over the opportunities: the start each served request gets
    (by its index in the workload); requests left without one are not in the result."""
    served = sorted(
        (r for r in reqs if r.outcome in _SERVED), key=lambda r: (r.spec.arrival, r.spec.index)
    )
    out: dict[int, float] = {}
    k = 0
    for r in served:
        # the first opportunity at or after its arrival not taken by those before it
        k = max(k, bisect.bisect_left(opps, r.spec.arrival, lo=k))
        if k >= len(opps):
            break
        out[r.spec.index] = opps[k]
        k += 1
    return out


def _returns_at_ra(r: ReqState) -> list[float]:
    """When the request's client came back after a Retry-After it followed."""
    if not r.spec.retry.follow_retry_after:
        return []
    return [when for when, why, ra in (r.retried_at or ()) if why == "rejected" and ra]


def peak_ratio(times: list[float], start: float, end: float) -> dict[str, Any]:
    """The busiest `PEAK_WINDOW_S` (sliding) of these times within [start, end], against
    the mean count per such window over the seconds in which they came (1 s bins holding
    at least one): a herd told the same instant shows as a peak far above that mean,
    returns spread at the pace the gateway gave do not, and a quiet gap (a class whose
    backlog is served, the next not yet due) dilutes nothing. `ratio_over_span`: the
    same peak against the mean over the whole span from the first to the last."""
    inside = sorted(t for t in times if start <= t <= end)
    n = len(inside)
    if n < 10:
        return {"returns": n, "busiest_100ms": None, "ratio": None, "ratio_over_span": None}
    busiest = 0
    j = 0
    for i, t in enumerate(inside):
        while inside[j] < t - PEAK_WINDOW_S + 1e-12:
            j += 1
        busiest = max(busiest, i - j + 1)
    active = len({math.floor(t) for t in inside})
    mean = n * PEAK_WINDOW_S / active
    span = max(PEAK_WINDOW_S, inside[-1] - inside[0])
    return {
        "returns": n,
        "active_s": active,
        "mean_per_100ms": _r(mean),
        "busiest_100ms": busiest,
        "ratio": _r(busiest / mean),
        "ratio_over_span": _r(busiest / (n * PEAK_WINDOW_S / span)),
    }


def recovery_window(scenario: Scenario) -> tuple[float, float | None]:
    """The recovery: the phase after the busiest one (the highest rate), or from the end
    of the busiest phase on when it is the last (None: to the last return)."""
    phases = scenario.phases
    peak = max(phases, key=lambda p: (p.rate or 0.0, p.rate_rps or 0.0))
    after = [p for p in phases if p.index == peak.index + 1]
    return peak.end, (after[0].end if after else None)


SERIES_BIN_S = 0.5  # returns and refusals per bin, for the plots
MAX_POINTS = 2000  # per class and list, for the plots


def _thin(values: list[Any], limit: int = MAX_POINTS) -> list[Any]:
    if len(values) <= limit:
        return values
    step = len(values) / limit
    return [values[int(i * step)] for i in range(limit)]


def _counts(times: list[float], end: float) -> list[int]:
    out = [0] * (math.floor(end / SERIES_BIN_S) + 1)
    for t in times:
        k = math.floor(t / SERIES_BIN_S)
        if 0 <= k < len(out):
            out[k] += 1
    return out


def refusal_figures(run: ArmRun, scenario: Scenario) -> dict[str, Any]:
    """The `returns` entry of an arm in results.json: per class and overall, and what
    the plots draw (`series`)."""
    classes: dict[str, Any] = {}
    all_returns: list[float] = []
    series: dict[str, Any] = {"bin_s": SERIES_BIN_S, "returns": {}, "refusals": {}}
    samples: dict[str, Any] = {}
    end_t = run.ended_at
    for p, c in enumerate(CLASSES):
        reqs = [r for r in run.requests if r.spec.priority == p]
        refused = [r for r in reqs if r.first_refused_at is not None]
        given = [ra for r in refused for ra in r.ra_given]
        came_back = sum(r.ra_attempts for r in refused)
        admitted = sum(r.admitted_after_ra for r in refused)
        served = [r for r in refused if r.outcome in _SERVED]
        unservable = [
            r
            for r in refused
            if r.outcome == "rejected" and r.rejections[-1] == CANNOT_SERVE_IN_TIME
        ]
        hind = hindsight_starts(reqs, opportunities(run, p)) if served else {}
        to_served = [r.sent_at - r.first_refused_at for r in served]  # type: ignore[operator]
        to_hind = [
            max(0.0, hind[r.spec.index] - r.first_refused_at)  # type: ignore[operator]
            for r in served
            if r.spec.index in hind
        ]
        p50 = _pct(to_served, 0.5)
        h50 = _pct(to_hind, 0.5)
        came_at: list[float] = []
        for r in refused:
            came_at += _returns_at_ra(r)
        all_returns += came_at
        series["returns"][c] = _counts(came_at, end_t)
        series["refusals"][c] = _counts(
            [r.first_refused_at for r in refused if r.first_refused_at is not None], end_t
        )
        samples[c] = {
            "refusal_to_served_s": _thin(sorted(round(x, 3) for x in to_served)),
            "hindsight_s": _thin(sorted(round(x, 3) for x in to_hind)),
            "first_retry_after": _thin(
                [
                    (round(r.first_refused_at, 3), round(r.ra_given[0], 3))  # type: ignore[arg-type]
                    for r in refused
                    if r.ra_given
                ]
            ),
        }
        classes[c] = {
            "refused": len(refused),
            "served": len(served),
            "served_share": _r(len(served) / len(refused) if refused else None, 4),
            "told_cannot_serve_in_time": len(unservable),
            "retry_after_s": {
                "p50": _r(_pct(given, 0.5)),
                "p90": _r(_pct(given, 0.9)),
                "max": _r(max(given) if given else None),
            },
            "came_back_at_retry_after": came_back,
            "admitted_on_return": admitted,
            "admitted_share": _r(admitted / came_back if came_back else None, 4),
            "refusal_to_served_s": {"p50": _r(p50), "p90": _r(_pct(to_served, 0.9))},
            "hindsight_s": {"p50": _r(h50), "p90": _r(_pct(to_hind, 0.9))},
            "vs_hindsight_p50": _r(p50 / h50 if p50 is not None and h50 else None),
        }
    start, end = recovery_window(scenario)
    last = max(all_returns, default=start)
    came = sum(v["came_back_at_retry_after"] for v in classes.values())
    adm = sum(v["admitted_on_return"] for v in classes.values())
    return {
        "classes": classes,
        "came_back_at_retry_after": came,
        "admitted_on_return": adm,
        "admitted_share": _r(adm / came if came else None, 4),
        "returns_peak_recovery": peak_ratio(all_returns, start, last if end is None else end),
        "returns_peak_after_burst": peak_ratio(all_returns, start, last),
        "recovery_s": [start, end],
        "series": series,
        "samples": samples,
    }
