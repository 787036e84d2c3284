"""What a fleet's shared tenant quotas came to (bench/fleet_quotas.py's records), per tenant:
the report's tables, the plot, and the bounds the tests hold them to.

Admitted tokens of a request: the charge it came to by the one charge rule (core/quota.py
`settlement`: its usage when it ran, nothing when it never did), counted at the moment the
quota was charged (the store's time when shared, the replica's when local); admitted
requests: those that ran. Per minute: over a period, times 60 over its length. Periods:
while the store answers, each outage, after each return, up to the end of the arrivals.

The reference is one exact bucket per limit (`Ideal`): the quota held once and never
lost, charged with each admitted request's final amount at its admission. Its excess at a
moment is how far the fleet is in debt to it, max(0, -level); `allowed` over a period is
its level at the start (less that debt) plus its refill.

While the store answers, the excess is bounded by the overdraw not yet settled: a request
is charged the Controller's estimate, capped at a full bucket, and what it uses above it
reaches the store only when it ends (at most a flush and a round trip later); meanwhile
every replica may admit against it. With X(t) = sum, over requests charged by t and not
settled in the store by t, of max(0, final - charge):

    excess(t) <= X(t)

Proof: the store admits only when its level covers the charge, so its level is >= 0
after each admission; the ideal level differs from the store's by the unsettled deltas
(at most X) and by give-backs not yet sent (which only lower the store's); the caps on
refill only narrow the gap. It needs the store's floor (minus a bucket) never to have
forgiven a debt: `forgiven` says. Requests have no overdraw: no excess while
shared. The bound is not "one request per replica": every request in flight may
overdraw, by at most its prompt plus its max_tokens less its estimate.

While the store is lost, replica k enforces f_k of every limit from the moment it goes
local (core/quota_failover.py: its part of the recent demand, with a floor spread evenly),
starting from f_k of the level it last saw, refilled since. Requests admitted before the
loss and ending during it settle into the share they end on. Together:

    admitted locally <= sum_k [start_k + f_k * quota * (back - local_k) / 60]
                        + given back by earlier requests + overdraw of the local ones

A replica with no count of the processes (started while the store was lost) follows the
part of the fleet it estimates (`reshares`): its refill is integrated over its fraction's
moves.

After the return each replica hands back what it admitted on its own (`HandBack`: its
use less what its share refilled meanwhile, core/quota_failover.py `Ledger`; a store that
came back empty first gets the level the first replica back last saw), and keeps its
share as a second check until the others may have handed back too. Once all have,
`handed_out_twice` is the store's level less the ideal's: what the store offers that one
exact quota would not. It is bounded by what the store never learns of: the overdraw
unsettled at the loss, that of the requests admitted locally, the error of a restored
level, what replicas that exited unhanded admitted, and the refill credited by shares
that together held more than one quota (`bound`); without the hand-back it would be about
everything used during the outage. From then on the excess stays within
`handed_out_twice` plus X(t).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from sluice.bench.fleet_quotas import LOCAL, SHARED, UNCHECKED, Admitted, FleetQuotas
from sluice.core.settings import TenantLimits

SERIES_BIN_S = 5.0


def _r(x: float | None, nd: int = 1) -> float | None:
    return None if x is None or math.isnan(x) else round(x, nd)


def _final(rec: Admitted) -> int:
    return rec.charge if rec.tokens is None else rec.tokens


def _ran(rec: Admitted) -> int:
    return 0 if rec.tokens is not None and not rec.ran else 1


def _overdraw(rec: Admitted) -> int:
    if rec.tokens is None:
        return 0  # still open at the end: its usage is not known
    return max(0, rec.tokens - rec.charge)


def periods(duration: float, outages: Sequence[tuple[float, float]]) -> list[dict[str, Any]]:
    """Shared, then each outage and what follows it, up to `duration` (cut there)."""
    out: list[dict[str, Any]] = []
    t, name = 0.0, "shared"
    for i, (at, back) in enumerate(outages):
        n = "" if len(outages) == 1 else f" {i + 1}"
        out.append({"name": name, "from_s": t, "to_s": at})
        out.append({"name": f"outage{n}", "from_s": at, "to_s": back})
        t, name = back, f"after{n}"
    out.append({"name": name, "from_s": t, "to_s": duration})
    for p in out:
        p["to_s"] = min(p["to_s"], duration)
    return [p for p in out if p["to_s"] > p["from_s"]]


class Ideal:
    """One exact bucket fed with final charges at their moments; its level and the
    overdraw not yet settled, queried in time order (module docstring)."""

    def __init__(self, cap: float, charges: Sequence[tuple[float, float, float, float]]):
        # charges: (at, amount, overdraw, settled_at), sorted by `at`
        self.cap = cap
        self._charges = charges
        self._i = 0
        self.level = cap
        self.at = 0.0
        self.unsettled: list[tuple[float, float]] = []  # (settled_at, overdraw)
        self.overdraw = 0.0

    def _refill(self, t: float) -> None:
        if t > self.at:
            self.level = min(self.cap, self.level + (t - self.at) * self.cap / 60)
            self.at = t

    def _settle(self, t: float) -> None:
        keep = []
        for settled_at, o in self.unsettled:
            if settled_at <= t:
                self.overdraw -= o
            else:
                keep.append((settled_at, o))
        self.unsettled = keep

    def advance(self, t: float) -> list[tuple[float, float, float]]:
        """Take every charge up to `t`; per charge (its time, excess, overdraw) after it."""
        out = []
        charges = self._charges
        while self._i < len(charges) and charges[self._i][0] <= t:
            at, amount, o, settled_at = charges[self._i]
            self._i += 1
            self._refill(at)
            self._settle(at)
            self.level -= amount
            if o > 0 and settled_at > at:
                self.unsettled.append((settled_at, o))
                self.overdraw += o
            out.append((at, max(0.0, -self.level), self.overdraw))
        self._refill(t)
        self._settle(t)
        return out


def _charges(recs: list[Admitted], tokens: bool) -> list[tuple[float, float, float, float]]:
    rows = []
    for rec in recs:
        amount = (
            float(_final(rec))
            if tokens
            else (0.0 if rec.tokens is not None and not rec.ran else 1.0)
        )
        if amount == 0:
            continue
        o = float(_overdraw(rec)) if tokens else 0.0
        if tokens and rec.mode == UNCHECKED:
            o = amount  # charged nowhere
        rows.append((rec.charged_at, amount, o, rec.settled_at))
    rows.sort()
    return rows


def tenant_figures(q: FleetQuotas, lim: TenantLimits, duration: float) -> dict[str, Any]:
    recs = [r for r in q.records.admitted.values() if r.tenant == lim.name]
    outages = [(o.at, o.back) for o in q.store.outages]
    spans = periods(duration, outages)
    out: dict[str, Any] = {
        "tokens_per_minute": lim.tokens_per_minute,
        "requests_per_minute": lim.requests_per_minute,
        "max_concurrency": lim.max_concurrency,
    }
    limits = [("tokens", lim.tokens_per_minute, True), ("requests", lim.requests_per_minute, False)]
    ideals = {what: Ideal(cap, _charges(recs, tokens)) for what, cap, tokens in limits if cap}
    rows = []
    for p in spans:
        a, b = p["from_s"], p["to_s"]
        inside = [r for r in recs if a <= r.charged_at < b]
        minutes = (b - a) / 60
        tokens = sum(_final(r) for r in inside)
        requests = sum(1 for r in inside if r.tokens is None or r.ran)
        row: dict[str, Any] = {
            **p,
            "admitted_tokens": tokens,
            "tokens_per_min": _r(tokens / minutes),
            "admitted_requests": requests,
            "requests_per_min": _r(requests / minutes),
            "by_mode": {
                m: sum(_final(r) for r in inside if r.mode == m) for m in (SHARED, LOCAL, UNCHECKED)
            },
        }
        for what, ideal in ideals.items():
            start = ideal.level
            seen = ideal.advance(b)
            # what one exact bucket allows over the period: its level at the start (less
            # the fleet's debt to it) plus its refill
            row[f"allowed_{what}"] = _r(max(0.0, start + ideal.cap * (b - a) / 60))
            row[f"excess_{what}_max"] = _r(max((e for _, e, _ in seen), default=0.0))
            row[f"excess_over_overdraw_{what}_max"] = _r(
                max((e - o for _, e, o in seen), default=0.0)
            )
            row[f"overdraw_{what}_max"] = _r(max((o for _, _, o in seen), default=0.0))
        rows.append(row)
    out["periods"] = rows
    refusals = [x for x in q.records.refusals if x["tenant"] == lim.name]
    quota_429 = sorted(x["retry_after_s"] for x in refusals if x["code"] == "tenant_quota")
    out["refusals"] = {
        "tenant_quota": len(quota_429),
        "cannot_serve_in_time": sum(1 for x in refusals if x["code"] == "cannot_serve_in_time"),
        "by_store": sum(1 for x in refusals if x["by"] == SHARED),
        "by_local_share": sum(1 for x in refusals if x["by"] == LOCAL),
        "retry_after_p50_s": _r(_pct(quota_429, 0.5), 3),
        "retry_after_p95_s": _r(_pct(quota_429, 0.95), 3),
        "retry_after_max_s": _r(quota_429[-1] if quota_429 else None, 3),
    }
    out["outages"] = [_outage(q, lim, recs, o.at, o.back) for o in q.store.outages]
    out["forgiven"] = {
        what: _r(q.store.forgiven.get((lim.name, what), 0.0)) for what in ("tokens", "requests")
    }
    out["series"] = _series(recs, duration)
    return out


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    return values[max(0, min(len(values) - 1, math.ceil(q * len(values)) - 1))]


def _outage(
    q: FleetQuotas, lim: TenantLimits, recs: list[Admitted], at: float, back: float
) -> dict[str, Any]:
    """One outage of the store, for one tenant: who took over with what share, what they
    admitted against the failover bound, what they handed back, and what the store
    offered once they all had, against one exact bucket."""
    name = lim.name
    takes: dict[int, dict[str, Any]] = {}
    for tk in q.records.take_overs:  # each replica's first take-over in the outage
        if at <= tk["t"] < back and name in tk["tenants"]:
            takes.setdefault(tk["replica"], {"t": tk["t"], **tk["tenants"][name]})
    shares = [{"replica": k, **{key: _r(v, 4) for key, v in s.items()}} for k, s in takes.items()]
    # each share's fraction over time: a replica with no count follows its fleet share
    following = min((o.at for o in q.store.outages if o.at >= back), default=math.inf)
    moves = {k: _fractions(q, k, name, s["t"], s["fraction"], following) for k, s in takes.items()}
    local = [r for r in recs if r.mode == LOCAL and at <= r.charged_at < back]
    # requests admitted through the store before the loss that gave back while it was
    # lost: what they did not use went to the local share they ended on
    held = [r for r in recs if r.mode == SHARED and r.charged_at < at <= r.closed_at < back]
    out: dict[str, Any] = {
        "at_s": at,
        "back_s": back,
        "replicas_took_over": len(takes),
        "fraction_sum": _r(sum(s["fraction"] for s in takes.values()), 4),
        # the most the replicas held at once (from the take-over to the exit or the
        # hand-back), as each share moved
        "fraction_sum_held_max": _r(_held_max(q, moves, back), 4),
        "shares": shares,
        "unchecked_requests": sum(
            1 for r in recs if r.mode == UNCHECKED and at <= r.charged_at < back
        ),
    }
    for what, cap in (("tokens", lim.tokens_per_minute), ("requests", lim.requests_per_minute)):
        if not cap:
            continue
        level = f"{what}_level"
        start = sum(s[level] for s in takes.values() if s[level] is not None)
        refill = sum(_share_refill(points, cap, back) for points in moves.values())
        if what == "tokens":
            admitted = float(sum(_final(r) for r in local))
            given = float(sum(max(0, r.charge - _final(r)) for r in held))
            overdraw = float(sum(_overdraw(r) for r in local))
        else:
            admitted = float(sum(1 for r in local if r.tokens is None or r.ran))
            given = float(sum(1 for r in held if not r.ran))
            overdraw = 0.0
        out[what] = {
            "local_admitted": _r(admitted),
            # each replica enforces its share: f_k of the level it last saw (refilled),
            # f_k of the rate; plus what requests admitted before gave back into the
            # shares and the overdraw of the local requests (module docstring)
            "failover_bound": _r(start + refill + given + overdraw),
            "shares_start": _r(start),
            "shares_refill": _r(refill),
            "given_back_by_earlier": _r(given),
            "local_overdraw": _r(overdraw),
        }
    out.update(_return(q, lim, recs, at, back, moves))
    return out


def _fractions(
    q: FleetQuotas, replica: int, name: str, t0: float, f0: float, until: float
) -> list[tuple[float, float]]:
    """A replica's share of a tenant's quota from its take-over at `t0` (before `until`,
    the next outage): (from, fraction)."""
    points = [(t0, f0)]
    for r in q.records.reshares:
        if r["replica"] == replica and t0 < r["t"] < until and name in r["tenants"]:
            points.append((r["t"], r["tenants"][name]))
    return points


def _share_refill(points: list[tuple[float, float]], cap: float, until: float) -> float:
    """What a share refills from its take-over to `until`, at each fraction's rate."""
    total = 0.0
    for (t, f), (nxt, _) in zip(points, [*points[1:], (until, 0.0)], strict=True):
        total += f * cap * max(0.0, min(nxt, until) - t) / 60
    return total


def _held_max(q: FleetQuotas, moves: dict[int, list[tuple[float, float]]], back: float) -> float:
    """The largest sum of the shares held at once: each from its take-over until its
    replica exits or hands back."""
    ends = {}
    for k in moves:
        ended = [h["t"] for h in q.records.hand_backs if h["replica"] == k and h["t"] >= back]
        ends[k] = min([q.records.exits.get(k, math.inf), *ended])
    times = sorted({t for points in moves.values() for t, _ in points})
    best = 0.0
    for t in times:
        held = 0.0
        for k, points in moves.items():
            if points[0][0] <= t < ends[k]:
                held += next(f for start, f in reversed(points) if start <= t)
        best = max(best, held)
    return best


def _return(
    q: FleetQuotas,
    lim: TenantLimits,
    recs: list[Admitted],
    at: float,
    back: float,
    moves: dict[int, list[tuple[float, float]]],
) -> dict[str, Any]:
    """The store once every replica has handed back after the outage `at`..`back`."""
    name = lim.name
    until = min((o.at for o in q.store.outages if o.at >= back), default=math.inf)
    firsts: dict[int, dict[str, Any]] = {}
    for h in q.records.hand_backs:
        if back <= h["t"] < until:
            firsts.setdefault(h["replica"], h)
    if not firsts:
        return {"replicas_handed_back": 0}
    first = min(firsts.values(), key=lambda h: h["t"])
    last = max(firsts.values(), key=lambda h: h["t"])
    out: dict[str, Any] = {
        "replicas_handed_back": len(firsts),
        "hand_back_from_s": _r(first["t"], 3),
        "hand_back_done_s": _r(last["t"], 3),
        "handed_back": {
            what: _r(
                sum(h["owed"][name][f"{what}_charge"] for h in firsts.values() if name in h["owed"])
            )
            for what in ("tokens", "requests")
        },
    }
    levels = q.records.store_levels
    lost: dict[str, Any] = next((x["levels"].get(name, {}) for x in levels if x["t"] == at), {})
    wiped = any(o.wiped and o.at == at for o in q.store.outages)
    for what, cap in (("tokens", lim.tokens_per_minute), ("requests", lim.requests_per_minute)):
        if not cap:
            continue
        ideal = Ideal(cap, _charges(recs, what == "tokens"))
        ideal.advance(at)
        overdraw_at_loss = ideal.overdraw
        ideal.advance(last["t"])
        store = last["store_after"][name][what]
        # a store back empty gets the first replica's estimate of the level had nothing
        # been used: its last sight refilled, against the level when the store was lost
        restore_error = 0.0
        owed = first["owed"].get(name)
        if wiped and owed is not None and owed[f"{what}_level"] >= 0 and lost.get(what) is not None:
            true = min(cap, lost[what] + cap * (first["t"] - at) / 60)
            restore_error = owed[f"{what}_level"] - true
        since = [r for r in recs if at <= r.charged_at <= last["t"]]
        local_overdraw = (
            float(sum(_overdraw(r) for r in since if r.mode == LOCAL)) if what == "tokens" else 0.0
        )
        amount = _final if what == "tokens" else _ran
        # let through while their calls failed and the circuit was still closed: charged
        # nowhere (the gateway fails open)
        unchecked = float(sum(amount(r) for r in since if r.mode == UNCHECKED))
        # admitted on their own by replicas that exited before Redis was back
        gone = float(sum(amount(r) for r in since if r.mode == LOCAL and r.replica not in firsts))
        # a debt past minus a bucket, wiped off by the store's floor (the hand-back's too)
        forgiven = q.store.forgiven.get((name, what), 0.0)
        # each hand-back credits what its share refilled (core/quota_failover.py Ledger):
        # shares that add up to more than one quota at once credit more than one bucket
        # refilled in the same time
        credited = sum(
            _share_refill(moves[k], cap, h["t"]) for k, h in firsts.items() if k in moves
        )
        refill_over_one = max(0.0, credited - cap * (last["t"] - at) / 60)
        out[f"return_{what}"] = {
            "store_after": _r(store),
            "ideal_after": _r(ideal.level),
            # what the store offers that one exact quota would not, once all are back
            "handed_out_twice": _r(max(0.0, store - ideal.level)),
            # ... bounded by what the store never learns: the overdraw unsettled at the
            # loss and that of the local requests, a restored level's error, what was
            # let through unchecked and what replicas gone meanwhile admitted
            "bound": _r(
                overdraw_at_loss
                + local_overdraw
                + max(0.0, restore_error)
                + unchecked
                + gone
                + forgiven
                + refill_over_one
            ),
            "overdraw_at_loss": _r(overdraw_at_loss),
            "local_overdraw": _r(local_overdraw),
            "restore_error": _r(restore_error),
            "unchecked": _r(unchecked),
            "not_handed_back": _r(gone),
            "forgiven": _r(forgiven),
            "refill_over_one": _r(refill_over_one),
            "store_at_loss": _r(lost.get(what)),
        }
    return out


def _series(recs: list[Admitted], duration: float) -> dict[str, Any]:
    n = max(1, math.ceil(duration / SERIES_BIN_S))
    modes = (SHARED, LOCAL, UNCHECKED)
    tokens = {m: [0] * n for m in modes}
    requests = {m: [0] * n for m in modes}
    for r in recs:
        i = int(r.charged_at // SERIES_BIN_S)
        if 0 <= i < n:
            tokens[r.mode][i] += _final(r)
            requests[r.mode][i] += 1 if r.tokens is None or r.ran else 0
    per_min = 60 / SERIES_BIN_S
    return {
        "bin_s": SERIES_BIN_S,
        "t": [i * SERIES_BIN_S for i in range(n)],
        "tokens_per_min": {m: [round(v * per_min) for v in col] for m, col in tokens.items()},
        "requests_per_min": {m: [round(v * per_min) for v in col] for m, col in requests.items()},
    }


def quota_results(q: FleetQuotas, duration: float) -> dict[str, Any]:
    """The results.json entry of a fleet's shared quotas."""
    spec = q.spec
    jitter = spec.round_trip
    tenants = {
        name: tenant_figures(q, lim, duration)
        for name, lim in q.tenants.items()
        if lim.tokens_per_minute or lim.requests_per_minute or lim.max_concurrency
    }
    return {
        "store": {
            "round_trip_p50_s": spec.round_trip_s if jitter is None else jitter.p50_s,
            "round_trip_p99_s": spec.round_trip_s if jitter is None else jitter.p99_s,
            "outages": [
                {"at_s": o.at, "back_s": o.back, "failure": o.failure, "wiped": o.wiped}
                for o in spec.outages
            ],
            "calls": q.store.calls,
        },
        "periods": periods(duration, [(o.at, o.back) for o in spec.outages]),
        "replicas": [
            {"replica": k, "went_local": g.went_local, "unchecked": g.unchecked, "late": g.late}
            for k, g in enumerate(q.gates)
        ],
        "tenants": tenants,
    }


# -- report.md and the plot -----------------------------------------------------------------


def _n(x: float | None, nd: int = 0) -> str:
    if x is None:
        return "-"
    return f"{x:,.{nd}f}"


def report_lines(arm: str, quotas: dict[str, Any]) -> list[str]:
    """report.md's section on an arm's shared quotas."""
    from sluice.bench.report import _md_table

    store = quotas["store"]
    outages = "; ".join(
        f"lost at {o['at_s']:g} s, back at {o['back_s']:g} s ({o['failure']}"
        + (", empty" if o["wiped"] else "")
        + ")"
        for o in store["outages"]
    )
    lines = [
        f"## Tenant quotas shared through Redis ({arm})",
        "",
        f"Round trip {1000 * store['round_trip_p50_s']:g} ms (p99 "
        f"{1000 * store['round_trip_p99_s']:g} ms), {store['calls']:,} calls; "
        + (outages or "never lost")
        + ". Admitted: what the requests came to (their usage), by when they were charged; "
        "allowed: what one exact bucket (the quota held once, never lost) allows over the "
        "period, from its level at the start; excess - overdraw: the fleet's largest debt "
        "to that bucket less the overdraw of the requests not yet settled (<= 0: within "
        'the quota; docs/bench.md, "Fleets").',
        "",
    ]
    rows = []
    for name, t in quotas["tenants"].items():
        for p in t["periods"]:
            quota = []
            if t["tokens_per_minute"]:
                quota.append(f"{t['tokens_per_minute']:,} tok")
            if t["requests_per_minute"]:
                quota.append(f"{t['requests_per_minute']:,} req")
            minutes = (p["to_s"] - p["from_s"]) / 60
            excess = [
                p.get(f"excess_over_overdraw_{w}_max")
                for w in ("tokens", "requests")
                if p.get(f"excess_over_overdraw_{w}_max") is not None
            ]
            local = p["by_mode"]["local"] + p["by_mode"]["unchecked"]
            rows.append(
                [
                    name,
                    " + ".join(quota) or "-",
                    f"{p['name']} ({p['from_s']:g}-{p['to_s']:g} s)",
                    _n(p["tokens_per_min"]),
                    _n(None if "allowed_tokens" not in p else p["allowed_tokens"] / minutes),
                    _n(p["requests_per_min"], 1),
                    _n(
                        None if "allowed_requests" not in p else p["allowed_requests"] / minutes,
                        1,
                    ),
                    f"{100 * local / max(1, p['admitted_tokens']):.0f} %",
                    " / ".join(_n(e) for e in excess) or "-",
                ]
            )
    lines += [
        _md_table(
            [
                "tenant",
                "quota / min",
                "period",
                "admitted tok/min",
                "allowed tok/min",
                "admitted req/min",
                "allowed req/min",
                "by local shares",
                "excess - overdraw",
            ],
            rows,
        ),
        "",
    ]
    rows = []
    for name, t in quotas["tenants"].items():
        r = t["refusals"]
        rows.append(
            [
                name,
                _n(r["tenant_quota"]),
                f"{r['by_store']:,} / {r['by_local_share']:,}",
                _n(r["cannot_serve_in_time"]),
                " / ".join(_n(r[k], 2) for k in ("retry_after_p50_s", "retry_after_p95_s"))
                + f" / {_n(r['retry_after_max_s'], 2)}",
            ]
        )
    lines += [
        _md_table(
            [
                "tenant",
                "429 tenant_quota",
                "by Redis / by local shares",
                "cannot_serve_in_time",
                "Retry-After p50 / p95 / max s",
            ],
            rows,
        ),
        "",
    ]
    rows = []
    for name, t in quotas["tenants"].items():
        for o in t["outages"]:
            for what in ("tokens", "requests"):
                if what not in o:
                    continue
                ret = o.get(f"return_{what}", {})
                rows.append(
                    [
                        name,
                        what,
                        f"{o['replicas_took_over']} ({_n(o['fraction_sum'], 3)}; "
                        f"{_n(o['fraction_sum_held_max'], 3)})",
                        f"{_n(o[what]['local_admitted'])} / {_n(o[what]['failover_bound'])}",
                        _n(o.get("handed_back", {}).get(what)),
                        f"{_n(ret.get('store_after'))} / {_n(ret.get('ideal_after'))}",
                        f"{_n(ret.get('handed_out_twice'))} / {_n(ret.get('bound'))}",
                    ]
                )
    if rows:
        lines += [
            "While Redis was lost each replica enforced its share (core/quota_failover.py); "
            "once back (or leaving, within its grace), each charged it for what it admitted "
            "(its use less what its share refilled meanwhile), and kept its share as a "
            "second check until the others had too.",
            "",
            _md_table(
                [
                    "tenant",
                    "limit",
                    "replicas local (sum of shares; most held at once)",
                    "admitted locally / failover bound",
                    "charged back",
                    "Redis after / one exact bucket",
                    "handed out twice / bound",
                ],
                rows,
            ),
            "",
        ]
    return lines


def plot(results: dict[str, Any], out: Any) -> str | None:
    """quotas.png: per tenant with a quota, what the fleet admitted per minute (5 s bins,
    through Redis and by the local shares) against the quota, the outages shaded."""
    arms = [(a, r["quotas"]) for a, r in results["arms"].items() if r.get("quotas")]
    if not arms:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    arm, quotas = arms[0]
    tenants = list(quotas["tenants"].items())
    fig, axes = plt.subplots(
        len(tenants), 1, figsize=(9, 2.3 * len(tenants) + 0.8), sharex=True, squeeze=False
    )
    fig.suptitle(f"Admitted per minute, fleet-wide ({arm}; 5 s bins)")
    for ax, (name, t) in zip((row[0] for row in axes), tenants, strict=True):
        s = t["series"]
        xs = [x + s["bin_s"] / 2 for x in s["t"]]
        what = "tokens" if t["tokens_per_minute"] else "requests"
        col = s[f"{what}_per_min"]
        shared = col[SHARED]
        local = [a + b for a, b in zip(col[LOCAL], col[UNCHECKED], strict=True)]
        width = s["bin_s"] * 0.9
        ax.bar(xs, shared, width, color="tab:blue", label="through Redis")
        ax.bar(xs, local, width, bottom=shared, color="tab:orange", label="by local shares")
        ax.axhline(t[f"{what}_per_minute"], color="k", lw=1, ls="--", label="quota")
        ax.set_ylabel(f"{name}\n{what}/min", fontsize=8)
        for o in quotas["store"]["outages"]:
            ax.axvspan(o["at_s"], o["back_s"], color="tab:red", alpha=0.12, lw=0)
        ax.legend(loc="upper right", fontsize=7)
    axes[-1][0].set_xlabel("time (s); shaded: Redis lost")
    fig.tight_layout()
    fig.savefig(out / "quotas.png", dpi=90)
    plt.close(fig)
    return "quotas.png"
