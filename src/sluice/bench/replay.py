"""A trace scenario's workload: the slice's requests, their classes and tenants, and the
time scale that puts the trace's busiest window at `peak` x the backends' capacity.

* **Lengths**: each request has the trace's prompt length and is forced to the trace's
  output length (the replay sends `max_tokens` = output with `ignore_eos`), both times
  the real-mode `lengthScale`; a prompt is cut so that prompt + output fits the engine's
  `max_model_len` (`plan.describe()` counts them: `clamped`).
* **Capacity** for the trace's mix: the sweet spot and requests/s of one backend in
  closed loop (`bench.capacity`), the requests drawn from the slice's (prompt, output)
  pairs.
* **Time**: with `peak`, arrivals are divided by k = peak x capacity_rps / busiest_rps,
  busiest_rps the most arrivals in any `peakWindow` s of trace time (sliding); with
  `speedup`, k = speedup; else k = 1 (trace time).
* **Class**: by a stable hash of the request's line in the file (the same request gets
  the same class whatever the slice, the seed or the peak) against the cumulative
  `classes` shares; or `classValues[row's classColumn]`. **Tenant** within the class by
  its `share`, by another stable hash of the line.
* Client behaviour (deadline, cancel, retry) from the scenario's `clients`, as for phases.
"""

from __future__ import annotations

import dataclasses
import random

from sluice.bench.capacity import Capacity, calibrate_pairs
from sluice.bench.scenario import CLASSES, ClientBehaviour, Scenario, TenantSpec
from sluice.bench.trace import Trace
from sluice.bench.workload import ClientRequest, pick_by_weight, unit_hash
from sluice.sim.profiles import Profile

_CLASS_SALT = 0x5C1A55
_TENANT_SALT = 0x7E4A47


@dataclasses.dataclass(frozen=True, slots=True)
class TracePlan:
    scenario: Scenario  # its one phase in bench time
    capacity: Capacity  # per backend, for the trace's mix
    rate_rps: float  # mean offered rate in bench time
    time_scale: float  # k: bench seconds = trace seconds / k
    busiest_rps: float  # of the trace, in trace time
    workload: list[ClientRequest]
    clamped: int  # prompts cut to fit max_model_len


def _lengths(trace: Trace, scale: float, max_model_len: int) -> tuple[list[tuple[int, int]], int]:
    pairs: list[tuple[int, int]] = []
    clamped = 0
    for r in trace.requests:
        out = max(1, min(max_model_len - 1, round(r.output_tokens * scale)))
        prompt = max(1, round(r.prompt_tokens * scale))
        if prompt + out > max_model_len:
            prompt = max_model_len - out
            clamped += 1
        pairs.append((prompt, out))
    return pairs, clamped


def plan_trace(scenario: Scenario, profile: Profile, *, seed: int) -> TracePlan:
    ts = scenario.spec.trace
    trace = scenario.trace
    assert ts is not None and trace is not None
    pairs, clamped = _lengths(trace, scenario.trace_length_scale, profile.max_model_len)
    tpot_slo = scenario.slos["P0"].tpot
    capacity = calibrate_pairs(profile, tuple(pairs), tpot_slo)
    n_backends = scenario.spec.backends.count
    busiest, _ = trace.busiest(ts.peak_window)
    k = ts.speedup or 1.0
    if ts.peak is not None:
        k = ts.peak * capacity.rps * n_backends / busiest
    phase = scenario.phases[0]
    end = max(trace.duration / k, 1e-3)
    n = len(pairs)
    phase = dataclasses.replace(phase, end=end, rate=ts.peak, rate_rps=n / end)
    scaled = dataclasses.replace(scenario, phases=(phase,))

    tenants: dict[int, list[TenantSpec]] = {}
    for t in scenario.spec.tenants:
        tenants.setdefault(t.priority, []).append(t)
    shares = {c: ts.classes.get(c, 0.0) for c in CLASSES}  # type: ignore[call-overload]
    rng_clients = random.Random(f"{seed}/clients")
    out: list[ClientRequest] = []
    for i, (r, (prompt, output)) in enumerate(zip(trace.requests, pairs, strict=True)):
        cls: str
        if ts.class_column is not None:
            cls = ts.class_values[r.column]  # type: ignore[index]
        else:
            cls = pick_by_weight(shares, unit_hash(_CLASS_SALT, r.line))
        priority = CLASSES.index(cls)
        choices = tenants[priority]
        tenant = choices[0]
        if len(choices) > 1:
            name = pick_by_weight(
                {t.name: t.share for t in choices}, unit_hash(_TENANT_SALT, r.line)
            )
            tenant = next(t for t in choices if t.name == name)
        behaviour: ClientBehaviour = phase.clients[cls]
        cancel_after = None
        if behaviour.cancel is not None and rng_clients.random() < behaviour.cancel.probability:
            cancel_after = behaviour.cancel.after_tokens
        max_tokens = max(output, min(ts.max_tokens or output, profile.max_model_len - prompt))
        out.append(
            ClientRequest(
                index=i,
                request_id=f"r{i}",
                arrival=r.at / k,
                phase=0,
                priority=priority,
                tenant=tenant.name,
                weight=tenant.weight,
                prompt_tokens=prompt,
                max_tokens=max_tokens,
                output_tokens=output,
                cancel_after=cancel_after,
                deadline=behaviour.deadline,
                retry=behaviour.retry,
            )
        )
    return TracePlan(
        scenario=scaled,
        capacity=capacity,
        rate_rps=n / end,
        time_scale=k,
        busiest_rps=busiest,
        workload=out,
        clamped=clamped,
    )
