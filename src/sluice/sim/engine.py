"""A vLLM V1-shaped inference engine in virtual time: continuous batching over a paged KV
cache, chunked prefill, preemption by recomputation, and a step-time model.

The engine is pure: no asyncio, no sockets, no sleeping, no wall clock. Whoever drives it
passes the time in. The real-time server loop (`sluice.sim.driver`) and a discrete-event
harness drive it the same way:

    engine = Engine(profile, seed=0)
    engine.submit(engine.make_request("r1", prompt_tokens=500, max_tokens=200), now=t)
    while engine.has_work():
        result = engine.step(t)          # schedules one batch that starts at t
        t = result.end                   # its tokens exist at t + result.duration
        ... deliver result.tokens / result.finished at result.end ...

`submit` and `abort` may be called at any time between steps; a submitted request is
considered from the next step on, an abort takes effect at the start of the next step
(its blocks are freed then, like vLLM, which handles aborts between scheduler steps).
After `step(now)` returns, the engine's state (and `snapshot()`) is the state at the end
of that step. Each step costs O(running + admitted + aborted) time; nothing is
proportional to the history.

Scheduling follows vLLM V1's `Scheduler.schedule()`:
1. running requests first, in admission order: each gets what it still has to compute
   (the rest of its prompt, capped by the step's token budget, or one token when
   decoding) and the blocks that needs (ceil(tokens / block_size) in total). When no
   block is free, the most recently admitted running request is preempted: its blocks
   are freed, it goes back to the front of the waiting queue and, when admitted again,
   recomputes its prompt and the tokens it had generated;
2. then, only if nothing was preempted in this step, waiting requests in order while the
   token budget, `max_num_seqs` and free blocks allow.
With `profile.kv_reserve` "request" or "slot" (engines that never preempt), a waiting
request is admitted only when the blocks it may reach (its prompt + max_tokens, or one
slot's share of the cache) are not reserved by the requests running: allocation then never
runs out, nothing is preempted, and requests wait instead.
A request that finishes computing all its known tokens samples one new token; it
finishes when it has produced `output_tokens` tokens (finish reason "length" when that
is `max_tokens`, "stop" otherwise); its blocks are freed at the end of the step.

A pooling request (embeddings, rerank, score, classify: `make_pooling_request`) holds
blocks only for its prompt and finishes, with finish reason "stop" and no output token,
at the end of the step that computes the last of its prompt. vLLM V1 does the same
(vllm/v1/request.py: `max_tokens = 1` for pooling; vllm/v1/core/sched/scheduler.py,
`update_from_output`: "Pooling stops as soon as there is output", FINISHED_STOPPED).
"""

from __future__ import annotations

import math
import random
from collections import deque
from dataclasses import dataclass

from sluice.sim.profiles import Profile

FINISH_STOP = "stop"
FINISH_LENGTH = "length"
FINISH_ABORT = "abort"
FINISH_REASONS = (FINISH_STOP, FINISH_LENGTH, FINISH_ABORT)


@dataclass(frozen=True, slots=True)
class EngineRequest:
    request_id: str
    prompt_tokens: int
    max_tokens: int
    # the number of tokens it will produce: max_tokens under ignore_eos, else a draw
    output_tokens: int
    # prefill only: finishes when its prompt is computed, producing no token
    pooling: bool = False

    def __post_init__(self) -> None:
        if self.prompt_tokens < 1:
            raise ValueError("prompt_tokens must be at least 1")
        if self.max_tokens < 1:
            raise ValueError("max_tokens must be at least 1")
        if not 1 <= self.output_tokens <= self.max_tokens:
            raise ValueError("output_tokens must be between 1 and max_tokens")


# Results are plain (not frozen) slotted dataclasses: a frozen one costs ~6x more to build,
# and steps build one per running request. Treat them as read-only.
@dataclass(slots=True)
class TokenEvent:
    """One output token of one request, emitted at the end of a step."""

    request_id: str
    index: int  # 0 for the first token
    finish_reason: str | None  # set on the request's last token
    latency: float  # TTFT (index 0: since arrival) or inter-token latency


@dataclass(slots=True)
class RequestStats:
    """A finished (or aborted) request, with the timings vLLM's histograms observe."""

    request_id: str
    finish_reason: str
    prompt_tokens: int
    max_tokens: int
    generation_tokens: int
    num_preemptions: int
    arrival: float
    first_scheduled: float | None
    first_token: float | None
    last_token: float | None
    finished: float
    pooling: bool = False  # a prefill-only request: first_token is when its prompt was done

    @property
    def e2e(self) -> float:
        return self.finished - self.arrival

    @property
    def queue_time(self) -> float:
        start = self.first_scheduled if self.first_scheduled is not None else self.finished
        return max(0.0, start - self.arrival)

    @property
    def ttft(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.arrival

    @property
    def inference_time(self) -> float:
        if self.first_scheduled is None:
            return 0.0
        return max(0.0, self.finished - self.first_scheduled)

    @property
    def prefill_time(self) -> float:
        if self.first_scheduled is None or self.first_token is None:
            return 0.0
        return max(0.0, self.first_token - self.first_scheduled)

    @property
    def decode_time(self) -> float:
        if self.first_token is None or self.last_token is None:
            return 0.0
        return self.last_token - self.first_token

    @property
    def time_per_output_token(self) -> float | None:
        """Mean inter-token time of this request (vLLM's request-level TPOT)."""
        if self.generation_tokens < 2:
            return None
        return self.decode_time / (self.generation_tokens - 1)


@dataclass(slots=True)
class StepResult:
    start: float
    duration: float  # engine time this step takes; its tokens exist at start + duration
    tokens: list[TokenEvent]
    finished: list[RequestStats]  # includes aborts processed at the start of the step
    preempted: list[str]
    num_scheduled_tokens: int
    num_prompt_tokens: int  # prompts that produced their first token in this step
    num_generation_tokens: int

    @property
    def end(self) -> float:
        return self.start + self.duration


@dataclass(frozen=True, slots=True)
class EngineSnapshot:
    running: int
    waiting: int
    kv_usage: float  # fraction of KV blocks in use, 0..1
    used_blocks: int
    num_gpu_blocks: int
    block_size: int
    num_preemptions_total: int
    prompt_tokens_total: int
    generation_tokens_total: int
    finished_total: dict[str, int]  # by finish reason
    reserved_blocks: int = 0  # set aside by admitted requests (kv_reserve engines)
    peak_running: int = 0  # the most requests one step has run since the start


_WAITING = 0
_RUNNING = 1
_DONE = 2


class _Seq:
    """Engine-side state of one request."""

    __slots__ = (
        "arrival",
        "blocks",
        "computed",
        "first_scheduled",
        "first_token",
        "generated",
        "last_token",
        "num_tokens",
        "preemptions",
        "req",
        "reserved",
        "state",
    )

    def __init__(self, req: EngineRequest, arrival: float) -> None:
        self.req = req
        self.arrival = arrival
        self.num_tokens = req.prompt_tokens  # prompt + generated so far
        self.computed = 0  # tokens whose KV is in the cache
        self.generated = 0
        self.blocks = 0
        self.reserved = 0  # blocks set aside at admission (kv_reserve engines)
        self.state = _WAITING
        self.first_scheduled: float | None = None
        self.first_token: float | None = None
        self.last_token: float | None = None
        self.preemptions = 0


class Engine:
    def __init__(self, profile: Profile, *, seed: int = 0) -> None:
        self.profile = profile
        self._seed = seed
        self._rng = random.Random(seed)
        self._block_size = profile.block_size
        self._free_blocks = profile.num_gpu_blocks
        self._unreserved = profile.num_gpu_blocks  # blocks no admitted request reserved
        self._reserve = profile.kv_reserve
        self._slot_blocks = max(1, profile.num_gpu_blocks // profile.max_num_seqs)
        self._seqs: dict[str, _Seq] = {}
        self._running: list[_Seq] = []
        self._waiting: deque[_Seq] = deque()  # may hold aborted entries, skipped lazily
        self._num_waiting = 0
        self._pending_aborts: list[str] = []
        self._preemptions_total = 0
        self._peak_running = 0  # the most requests one step has run
        self._prompt_tokens_total = 0
        self._generation_tokens_total = 0
        self._finished_total = dict.fromkeys(FINISH_REASONS, 0)

    # -- requests -------------------------------------------------------------------

    def draw_output_tokens(
        self, max_tokens: int, *, min_tokens: int = 0, sample_key: int | None = None
    ) -> int:
        """A seeded output length: log-normal around the profile's median, within
        [max(1, min_tokens), max_tokens]. Draws come from the engine's seeded stream, or,
        with a `sample_key` (a greedy or seeded request: the same prompt gives the same
        answer), from that key and the engine's seed alone."""
        p = self.profile
        rng = self._rng if sample_key is None else random.Random(f"{self._seed}:{sample_key}")
        draw = int(p.output_len_median * math.exp(rng.gauss(0.0, p.output_len_sigma)))
        return max(1, min(max_tokens, max(min_tokens, draw)))

    def make_request(
        self,
        request_id: str,
        prompt_tokens: int,
        max_tokens: int,
        *,
        ignore_eos: bool = False,
        min_tokens: int = 0,
        sample_key: int | None = None,
    ) -> EngineRequest:
        if ignore_eos:
            output = max_tokens
        else:
            output = self.draw_output_tokens(
                max_tokens, min_tokens=min_tokens, sample_key=sample_key
            )
        return EngineRequest(request_id, prompt_tokens, max_tokens, output)

    def make_pooling_request(self, request_id: str, prompt_tokens: int) -> EngineRequest:
        """A prefill-only request (embeddings, rerank, score, classify)."""
        return EngineRequest(request_id, prompt_tokens, 1, 1, pooling=True)

    def check_fits(self, prompt_tokens: int, max_tokens: int, *, pooling: bool = False) -> None:
        """Raise ValueError if a request of this size can never run on this engine."""
        limit = self.profile.max_model_len
        if pooling:
            # vLLM's pooling requests may fill the context: max_output_tokens is 0
            if prompt_tokens > limit:
                raise ValueError(f"prompt_tokens = {prompt_tokens} exceeds max_model_len {limit}")
            return
        if prompt_tokens + max_tokens > limit:
            raise ValueError(
                f"prompt_tokens + max_tokens = {prompt_tokens + max_tokens} exceeds "
                f"max_model_len {limit}"
            )

    def submit(self, req: EngineRequest, now: float) -> None:
        if req.request_id in self._seqs:
            raise ValueError(f"duplicate request id {req.request_id!r}")
        self.check_fits(req.prompt_tokens, req.max_tokens, pooling=req.pooling)
        seq = _Seq(req, now)
        self._seqs[req.request_id] = seq
        self._waiting.append(seq)
        self._num_waiting += 1

    def abort(self, request_id: str, now: float) -> None:
        """Abort at the start of the next step; unknown or finished ids are ignored."""
        if request_id in self._seqs:
            self._pending_aborts.append(request_id)

    def has_work(self) -> bool:
        return bool(self._running or self._num_waiting or self._pending_aborts)

    def is_active(self, request_id: str) -> bool:
        return request_id in self._seqs

    # -- the step -------------------------------------------------------------------

    def step(self, now: float, compute_factor: float = 1.0) -> StepResult:
        """One step starting at `now`. `compute_factor` stretches the step's work (not its
        fixed overhead): a host whose other work takes the engine's cores for part of the
        step (the bench's `computeNoise`)."""
        finished: list[RequestStats] = []
        if self._pending_aborts:
            self._process_aborts(now, finished)

        bs = self._block_size
        budget = self.profile.max_num_batched_tokens
        running = self._running
        scheduled: list[tuple[_Seq, int]] = []
        preempted: list[str] = []

        # 1. running requests, in admission order
        i = 0
        while i < len(running) and budget > 0:
            seq = running[i]
            n = seq.num_tokens - seq.computed
            if n > budget:
                n = budget
            need = -(-(seq.computed + n) // bs) - seq.blocks
            if need > self._free_blocks:
                can_schedule = True
                while need > self._free_blocks:
                    victim = running.pop()  # the most recently admitted
                    self._preempt(victim)
                    preempted.append(victim.req.request_id)
                    if victim is seq:
                        can_schedule = False
                        break
                if not can_schedule:
                    break
            if need > 0:
                self._free_blocks -= need
                seq.blocks += need
            scheduled.append((seq, n))
            budget -= n
            i += 1

        # 2. waiting requests, only when nobody was preempted (vLLM V1 does the same)
        if not preempted:
            waiting = self._waiting
            max_seqs = self.profile.max_num_seqs
            while self._num_waiting and budget > 0 and len(running) < max_seqs:
                seq = waiting[0]
                if seq.state != _WAITING:  # aborted while waiting
                    waiting.popleft()
                    continue
                n = seq.num_tokens - seq.computed
                if n > budget:
                    n = budget
                need = -(-(seq.computed + n) // bs) - seq.blocks
                if need > self._free_blocks:
                    break
                if self._reserve != "none" and not seq.reserved:
                    r = self._reservation(seq)
                    if r > self._unreserved:
                        break
                    self._unreserved -= r
                    seq.reserved = r
                waiting.popleft()
                self._num_waiting -= 1
                self._free_blocks -= need
                seq.blocks += need
                seq.state = _RUNNING
                if seq.first_scheduled is None:
                    seq.first_scheduled = now
                running.append(seq)
                scheduled.append((seq, n))
                budget -= n

        if len(running) > self._peak_running:
            self._peak_running = len(running)

        # 3. the step's duration
        tokens = 0
        context = 0
        pairs = 0.0
        for seq, n in scheduled:
            tokens += n
            context += seq.computed + n
            pairs += n * (seq.computed + (n + 1) / 2)
        p = self.profile
        duration = (
            p.step_overhead_s
            + compute_factor
            * (p.per_token_s * tokens + p.per_kv_token_s * context + p.per_attn_pair_s * pairs)
            if scheduled
            else 0.0
        )
        end = now + duration

        # 4. outputs at the end of the step
        events: list[TokenEvent] = []
        prompt_tokens = 0
        any_done = False
        for seq, n in scheduled:
            seq.computed += n
            if seq.computed < seq.num_tokens:
                continue  # a prefill chunk that did not reach the end of the prompt
            if seq.req.pooling:
                # its output is the pooled prompt: done, with no token and no decode
                seq.first_token = seq.last_token = end
                prompt_tokens += seq.req.prompt_tokens
                self._finish(seq, FINISH_STOP, end, finished)
                any_done = True
                continue
            index = seq.generated
            seq.generated = index + 1
            seq.num_tokens += 1
            if index == 0:
                seq.first_token = end
                latency = end - seq.arrival
                prompt_tokens += seq.req.prompt_tokens
            else:
                latency = end - seq.last_token  # type: ignore[operator]
            seq.last_token = end
            reason: str | None = None
            if seq.generated >= seq.req.output_tokens:
                reason = FINISH_LENGTH if seq.generated >= seq.req.max_tokens else FINISH_STOP
                self._finish(seq, reason, end, finished)
                any_done = True
            events.append(TokenEvent(seq.req.request_id, index, reason, latency))
        if any_done:
            self._running = [s for s in running if s.state == _RUNNING]

        generated = len(events)
        self._prompt_tokens_total += prompt_tokens
        self._generation_tokens_total += generated
        return StepResult(
            start=now,
            duration=duration,
            tokens=events,
            finished=finished,
            preempted=preempted,
            num_scheduled_tokens=tokens,
            num_prompt_tokens=prompt_tokens,
            num_generation_tokens=generated,
        )

    def _reservation(self, seq: _Seq) -> int:
        if self._reserve == "slot":
            return self._slot_blocks
        return -(-(seq.req.prompt_tokens + seq.req.max_tokens) // self._block_size)

    def _preempt(self, seq: _Seq) -> None:
        self._free_blocks += seq.blocks
        self._unreserved += seq.reserved
        seq.blocks = seq.reserved = 0
        seq.computed = 0  # recomputed from scratch when admitted again
        seq.state = _WAITING
        seq.preemptions += 1
        self._waiting.appendleft(seq)
        self._num_waiting += 1
        self._preemptions_total += 1

    def _process_aborts(self, now: float, finished: list[RequestStats]) -> None:
        aborted_running = False
        for request_id in self._pending_aborts:
            seq = self._seqs.get(request_id)
            if seq is None:
                continue  # finished meanwhile, or aborted twice
            if seq.state == _RUNNING:
                aborted_running = True
            else:
                self._num_waiting -= 1  # its deque entry is skipped later
            self._finish(seq, FINISH_ABORT, now, finished)
        self._pending_aborts.clear()
        if aborted_running:
            self._running = [s for s in self._running if s.state == _RUNNING]

    def _finish(self, seq: _Seq, reason: str, now: float, out: list[RequestStats]) -> None:
        self._free_blocks += seq.blocks
        self._unreserved += seq.reserved
        seq.blocks = seq.reserved = 0
        seq.state = _DONE
        del self._seqs[seq.req.request_id]
        self._finished_total[reason] += 1
        req = seq.req
        out.append(
            RequestStats(
                request_id=req.request_id,
                finish_reason=reason,
                prompt_tokens=req.prompt_tokens,
                max_tokens=req.max_tokens,
                generation_tokens=seq.generated,
                num_preemptions=seq.preemptions,
                arrival=seq.arrival,
                first_scheduled=seq.first_scheduled,
                first_token=seq.first_token,
                last_token=seq.last_token,
                finished=now,
                pooling=req.pooling,
            )
        )

    # -- observation ----------------------------------------------------------------

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        return self._num_waiting

    @property
    def num_gpu_blocks(self) -> int:
        return self.profile.num_gpu_blocks

    @property
    def block_size(self) -> int:
        return self._block_size

    @property
    def free_blocks(self) -> int:
        return self._free_blocks

    @property
    def kv_usage(self) -> float:
        total = self.profile.num_gpu_blocks
        return (total - self._free_blocks) / total

    def blocks_of(self, request_id: str) -> int:
        seq = self._seqs.get(request_id)
        return 0 if seq is None else seq.blocks

    def snapshot(self) -> EngineSnapshot:
        total = self.profile.num_gpu_blocks
        used = total - self._free_blocks
        return EngineSnapshot(
            running=len(self._running),
            waiting=self._num_waiting,
            kv_usage=used / total,
            used_blocks=used,
            num_gpu_blocks=total,
            block_size=self._block_size,
            num_preemptions_total=self._preemptions_total,
            prompt_tokens_total=self._prompt_tokens_total,
            generation_tokens_total=self._generation_tokens_total,
            finished_total=dict(self._finished_total),
            reserved_blocks=total - self._unreserved,
            peak_running=self._peak_running,
        )
