"""From one arm's raw run to the figures of results.json, with the
definitions docs/bench.md gives:

* offered: logical requests of the class (a request and its retries count once);
* completed: served to the client -- finished, or cancelled by the client after the N
  tokens it wanted (`cancel after N tokens`);
* rejected: refused (429) on its last attempt; timed_out: its client's deadline passed;
  failed: cut by a backend failure on its last attempt; unfinished: still going at the end;
* TTFT, TPOT and e2e are the client's: measured from the request's first attempt;
* slo_attainment: the share of OFFERED requests completed within the class's SLO;
* goodput: output tokens of requests that met their SLO, per second of the arrival window;
* by route (when the scenario has several `routes`): the same counts and the SLO
  attainment per route and class; a pooling request's (an embedding's) TTFT is its whole
  time, and it has no TPOT;
* wasted tokens: tokens generated for clients that had gone (after a cancel or a deadline,
  until the abort reached the engine), tokens of answers abandoned half-way (deadline or
  backend failure: a truncated answer is of no use), and KV tokens lost to preemption
  (computed again later).
"""

from __future__ import annotations

import math
from typing import Any

from sluice.bench.cuts import limiter_states
from sluice.bench.harness import CANCELLED, FAILED, OK, REJECTED, TIMEOUT, UNFINISHED, ArmRun
from sluice.bench.returns import refusal_figures
from sluice.bench.scenario import CLASSES, Scenario, Slo

# "The limit reached the new sweet spot": every backend's limit <= this x the sweet spot.
SETTLE_TOLERANCE = 1.2


def percentile(values: list[float], q: float) -> float | None:
    """Nearest-rank percentile (q in 0..1) of a list; None when empty."""
    if not values:
        return None
    s = sorted(values)
    k = max(0, min(len(s) - 1, math.ceil(q * len(s)) - 1))
    return s[k]


def _r(x: float | None, nd: int = 4) -> float | None:
    return None if x is None else round(x, nd)


def meets_slo(ttft: float | None, tpot: float | None, e2e: float | None, slo: Slo) -> bool:
    if slo.ttft is not None and (ttft is None or ttft > slo.ttft):
        return False
    if slo.tpot is not None and tpot is not None and tpot > slo.tpot:
        return False
    return not (slo.done_within is not None and (e2e is None or e2e > slo.done_within))


def arm_results(
    run: ArmRun,
    scenario: Scenario,
    *,
    sweet_spots: list[int] | None = None,
    settle_targets: list[int] | None = None,
) -> dict[str, Any]:
    """The results.json entry of one arm. `limit_settle_s` is measured against
    `settle_targets` (the oracle's caps) when given, else against the sweet spots."""
    phases = scenario.phases
    n_phases = len(phases)
    classes: dict[str, Any] = {}
    goodput_tokens = 0
    # Output tokens of every request completed within the scenario's window (its arrivals
    # and its drain), SLO met or not. Real mode runs a gateway arm past the drain, until
    # its longest Retry-After has come back (`real.longest_return_wait`), and every arm
    # until its requests have settled: what ends after the window is counted apart, or
    # the arms (and the two modes) would be compared over different lengths of time.
    window_end = scenario.duration + scenario.spec.drain
    delivered = 0
    delivered_late = 0
    phase_good = [0] * n_phases
    phase_offered = [[0, 0, 0] for _ in range(n_phases)]
    phase_met = [[0, 0, 0] for _ in range(n_phases)]
    truncated = 0
    per_class: dict[str, dict[str, Any]] = {
        c: {
            "offered": 0,
            "completed": 0,
            "rejected": 0,
            "timed_out": 0,
            "failed": 0,
            "unfinished": 0,
            "cancelled_by_client": 0,
            "met": 0,
            "ttft_met": 0,
            "ttft": [],
            "tpot": [],
            "tokens": 0,
        }
        for c in CLASSES
    }
    by_route: dict[tuple[str, str], dict[str, Any]] = {}
    for r in run.requests:
        spec = r.spec
        c = CLASSES[spec.priority]
        pc = per_class[c]
        pc["offered"] += 1
        rc = by_route.get((spec.route, c))
        if rc is None:
            rc = by_route[(spec.route, c)] = {
                "offered": 0, "completed": 0, "rejected": 0, "met": 0, "ttft": []
            }  # fmt: skip
        rc["offered"] += 1
        phase_offered[spec.phase][spec.priority] += 1
        truncated += r.wasted
        outcome = r.outcome
        if outcome in (OK, CANCELLED):
            pc["completed"] += 1
            if outcome == CANCELLED:
                pc["cancelled_by_client"] += 1
            ttft = None if r.first_token_at is None else r.first_token_at - spec.arrival
            tpot = None
            if r.tokens >= 2 and r.first_token_at is not None and r.last_token_at is not None:
                tpot = (r.last_token_at - r.first_token_at) / (r.tokens - 1)
            e2e = None if r.end_at is None else r.end_at - spec.arrival
            if ttft is not None:
                pc["ttft"].append(ttft)
            if tpot is not None:
                pc["tpot"].append(tpot)
            slo = scenario.slos[c]
            if slo.ttft is None or (ttft is not None and ttft <= slo.ttft):
                pc["ttft_met"] += 1
            if r.end_at is not None and r.end_at > window_end:
                delivered_late += r.tokens
            else:
                delivered += r.tokens
            rc["completed"] += 1
            if ttft is not None:
                rc["ttft"].append(ttft)
            if meets_slo(ttft, tpot, e2e, slo):
                rc["met"] += 1
                pc["met"] += 1
                pc["tokens"] += r.tokens
                goodput_tokens += r.tokens
                phase_good[spec.phase] += r.tokens
                phase_met[spec.phase][spec.priority] += 1
        elif outcome == REJECTED:
            pc["rejected"] += 1
            rc["rejected"] += 1
        elif outcome == TIMEOUT:
            pc["timed_out"] += 1
        elif outcome == FAILED:
            pc["failed"] += 1
        elif outcome == UNFINISHED:
            pc["unfinished"] += 1
    duration = scenario.duration
    for c in CLASSES:
        pc = per_class[c]
        offered = pc["offered"]
        classes[c] = {
            "offered": offered,
            "completed": pc["completed"],
            "rejected": pc["rejected"],
            "timed_out": pc["timed_out"],
            "failed": pc["failed"],
            "unfinished": pc["unfinished"],
            "cancelled_by_client": pc["cancelled_by_client"],
            "ttft_p50_s": _r(percentile(pc["ttft"], 0.5)),
            "ttft_p95_s": _r(percentile(pc["ttft"], 0.95)),
            "tpot_p95_s": _r(percentile(pc["tpot"], 0.95), 5),
            "slo_attainment": _r(pc["met"] / offered if offered else None),
            "ttft_slo_attainment": _r(pc["ttft_met"] / offered if offered else None),
            "goodput_tokens_per_s": round(pc["tokens"] / duration, 1),
            "rejections": dict(sorted(run.rejections[c].items())),
            "first_rejection_at_s": _r(run.first_rejection_at[c], 3),
        }

    preempt_by_phase = [0] * n_phases
    for t in run.preemption_times:
        preempt_by_phase[scenario.phase_at(t).index] += 1
    per_phase = []
    for p in phases:
        length = p.end - p.start
        per_phase.append(
            {
                "name": p.name,
                "start_s": p.start,
                "end_s": p.end,
                "goodput_tokens_per_s": round(phase_good[p.index] / length, 1),
                "backend_preemptions": preempt_by_phase[p.index],
                # what the engines ran in the phase (against its sweet spot, below)
                "backend_running_mean": backend_running(run.series, p.end, p.start)["mean"],
                "slo_attainment": {
                    c: _r(phase_met[p.index][k] / phase_offered[p.index][k])
                    if phase_offered[p.index][k]
                    else None
                    for k, c in enumerate(CLASSES)
                },
            }
        )
    if sweet_spots is not None:
        targets = settle_targets or sweet_spots
        settle = limit_settle_times(run, scenario, sweet_spots, targets)
        for k, (entry, s) in enumerate(zip(per_phase, settle, strict=True)):
            entry["sweet_spot"] = sweet_spots[k]
            entry["settle_target"] = targets[k]
            entry["limit_settle_s"] = s

    advised = [
        ra
        for r in run.requests
        for _, why, ra in (r.retried_at or ())
        if why == REJECTED and ra is not None
    ]
    reactions = [ep.cut_at - ep.start for ep in run.episodes if ep.cut_at is not None]
    came_back = run.retry_after_retries
    order = refusal_order(run.first_rejection_at)
    wasted = run.preempted_tokens + run.wasted_after_gone + truncated
    routes: dict[str, Any] = {}
    if len(scenario.spec.routes) > 1:
        for (route, c), rc in sorted(by_route.items()):
            offered = rc["offered"]
            routes.setdefault(route, {})[c] = {
                "offered": offered,
                "completed": rc["completed"],
                "rejected": rc["rejected"],
                "slo_attainment": _r(rc["met"] / offered if offered else None),
                "ttft_p50_s": _r(percentile(rc["ttft"], 0.5)),
                "ttft_p95_s": _r(percentile(rc["ttft"], 0.95)),
            }
    return {
        "goodput_tokens_per_s": round(goodput_tokens / duration, 1),
        "tokens_delivered": delivered,
        "tokens_delivered_after_window": delivered_late,
        "backend_running": backend_running(run.series, duration),
        "backend_preemptions": len(run.preemption_times),
        "wasted_tokens": wasted,
        "wasted_breakdown": {
            "recomputed_after_preemption": run.preempted_tokens,
            "generated_after_client_left": run.wasted_after_gone,
            "abandoned_answers": truncated,
        },
        "classes": classes,
        **({"routes": routes} if routes else {}),
        "rejections_by_cause": _total_rejections(run),
        "refusal_order": order,
        "returns": refusal_figures(run, scenario),
        "retry_admission": {
            "came_back_at_retry_after": came_back,
            "admitted": run.retry_after_admitted,
            "ratio": _r(run.retry_after_admitted / came_back if came_back else None),
            "retry_after_p50_s": _r(percentile(advised, 0.5), 3),
            "retry_after_max_s": _r(max(advised) if advised else None, 3),
        },
        "limit_reaction": {
            "episodes": len(run.episodes),
            "cut": len(reactions),
            "p50_s": _r(percentile(reactions, 0.5)),
            "max_s": _r(max(reactions) if reactions else None),
        },
        "phases": per_phase,
        "limiters": limiter_states(run.controller_snapshot),
        "virtual_end_s": round(run.ended_at, 3),
        "wall_s": round(run.wall_s, 3),
        "events": run.events,
    }


def backend_running(
    series: dict[str, Any], until: float, since: float = 0.0
) -> dict[str, float | None]:
    """Requests the engines ran (vLLM's num_requests_running, as last published at each
    sample), per backend, over the samples from `since` to before `until` (by default the
    arrival window): the mean across backends and samples, and the largest."""
    times: list[float] = series.get("t", [])
    cols: list[list[float]] = series.get("running") or []
    values = [
        col[k] for col in cols for k, t in enumerate(times) if since <= t < until and k < len(col)
    ]
    if not values:
        return {"mean": None, "max": None}
    return {"mean": round(sum(values) / len(values), 2), "max": max(values)}


def _total_rejections(run: ArmRun) -> dict[str, int]:
    total: dict[str, int] = {}
    for counts in run.rejections.values():
        for code, n in counts.items():
            total[code] = total.get(code, 0) + n
    return dict(sorted(total.items()))


def refusal_order(first: dict[str, float | None]) -> str:
    """Classes in the order of their first refusal, e.g. 'P2<P1<P0'; classes never refused
    come last, in brackets: 'P2<P1<[P0]'."""
    refused = sorted((t, c) for c, t in first.items() if t is not None)
    never = [c for c in sorted(first, reverse=True) if first[c] is None]
    parts = [c for _, c in refused] + [f"[{c}]" for c in never]
    return "<".join(parts)


def limit_settle_times(
    run: ArmRun,
    scenario: Scenario,
    sweet_spots: list[int],
    targets: list[int] | None = None,
    tolerance: float = SETTLE_TOLERANCE,
) -> list[float | None]:
    """For each phase whose sweet spot is lower than the previous phase's (the right
    concurrency fell): seconds from the phase's start until every backend's limit is at
    most `tolerance` x the phase's target -- `targets[i]` (the oracle's best cap) when
    given, else its sweet spot. None: never, or not applicable. From the series, so to its
    sampling step."""
    series = run.series
    times: list[float] = series["t"]
    limits: list[list[float]] = series["limit"]
    out: list[float | None] = []
    for p in scenario.phases:
        i = p.index
        if i == 0 or not limits or not limits[0] or sweet_spots[i] >= sweet_spots[i - 1]:
            out.append(None)
            continue
        target = (targets or sweet_spots)[i] * tolerance
        found = None
        for k, t in enumerate(times):
            if t < p.start or t >= p.end:
                continue
            if all(col[k] <= target for col in limits):
                found = round(t - p.start, 3)
                break
        out.append(found)
    return out
