"""Prefill-only requests keep their engine's pipeline full: a step computing, the next ready.

An embedding, a rerank, a score or a classification holds KV only for the step that
computes its prompt. vLLM 0.32's scheduler (vllm/v1/core/sched/scheduler.py, `schedule`
and `update_from_output`: "Pooling stops as soon as there is output") schedules the
running requests first and a waiting request only into the blocks they leave, and a
pooling request finishes in the step that computes the last of its prompt, freeing its
blocks. So a prefill-only request can neither be preempted for KV nor make a generation
request be: the KV budget, the gateway's margin against preemptions, is not what should
bound it. Counted at its whole prompt for its whole time in flight, it did: a pooling
engine whose cache holds three of a flood's embeddings got two at a time from the
gateway (a budget of 0.8 of the cache), idle between each answer and the next request
reaching it, where straight it ran seven at once (docs/bench.md, "Mixed routes").

What bounds it instead is latency: one more than the engine can compute in a step waits
in the engine's own queue, first come first served, out of the gateway's priorities. So
the gateway keeps `PIPELINE_STEPS` (2) steps' worth in flight, the one computing and the
next waiting, tokenised, for the blocks it frees: a prefill-only request sent to a
backend with only prefill-only requests in flight (a pooling engine) counts against its
KV budget (and in the limiter's KV cap in requests) at 1 / PIPELINE_STEPS of its prompt
(`kv_charge`; core/dispatcher.py decides where), the engine's signals are read without
what that pipeline puts there by design (`engine_view`): up to one queued request per
pipelined request of ours, and their KV; and each answer is its first token, judged by
the first-token signals (the controller's `on_finish`), which steer the pipeline. A P0
request that arrives waits at most for the step already queued (an embedding of ~1,100
tokens: tens of milliseconds on a GPU, 35-80 ms on the CPU test engine).

Beside generation requests a prefill-only request counts whole: its prefill would share
the steps that decode the others and prefill their first tokens, and their own signals
steer (`sluice bench mixed-routes`, where embeddings share the chat engines: with the
pipeline there too, P0 fell from 100 % to 95-98 % within its SLO).

Pure: no clock, no I/O.
"""

from __future__ import annotations

import dataclasses

from sluice.core.types import BackendMetrics

PIPELINE_STEPS = 2


def kv_charge(footprint: int, pipelined: bool) -> int:
    """The KV tokens a request counts for on its backend: its whole footprint, or a
    pipelined request's share of a pipeline of PIPELINE_STEPS steps (rounded up)."""
    if not pipelined:
        return footprint
    return -(-footprint // PIPELINE_STEPS)


def engine_view(
    m: BackendMetrics, pipelined: int, pipelined_tokens: float, capacity: float | None
) -> BackendMetrics:
    """The scrape as the limiter and the pressure read it: without the requests waiting and
    the KV held that our pipelined requests in flight (`pipelined` of them,
    `pipelined_tokens` of prompt) explain. A request of ours that waits for the blocks the
    one computing frees is the pipeline doing its job, not the engine queueing; their KV
    is freed at the end of the step. The scrape itself when none are in flight."""
    if pipelined <= 0:
        return m
    waiting = m.waiting
    if waiting is not None:
        waiting = max(0.0, waiting - pipelined)
    usage = m.kv_usage
    if usage is not None and capacity:
        usage = max(0.0, usage - pipelined_tokens / capacity)
    return dataclasses.replace(
        m,
        waiting=waiting,
        kv_usage=usage,
        set_aside_waiting=(m.waiting or 0.0) - (waiting or 0.0),
        set_aside_kv_usage=(m.kv_usage or 0.0) - (usage or 0.0),
    )
