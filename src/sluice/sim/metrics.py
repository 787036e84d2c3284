"""/metrics for the simulator with vLLM V1's metric names, labels and buckets.

Gauges and counters are read from the engine when scraped (nothing to update per step);
histograms are fed from each step's result. Each `SimMetrics` has its own
CollectorRegistry, so several simulators can live in one process. Histograms are kept
here rather than in prometheus_client.Histogram because a step observes one value per
running request, and a bisect into a list is several times cheaper."""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Callable, Iterator, Sequence

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from sluice.sim.engine import FINISH_REASONS, Engine, EngineSnapshot, RequestStats, StepResult

# vLLM V1 (vllm/v1/metrics/loggers.py) buckets
TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
    7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
ITL_BUCKETS = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
    10.0, 20.0, 40.0, 80.0,
)  # fmt: skip
REQUEST_LATENCY_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
    120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip


def build_1_2_5_buckets(max_value: int) -> tuple[float, ...]:
    """vLLM's token-count buckets: 1, 2, 5, 10, 20, 50, ... up to max_value."""
    out: list[float] = []
    exponent = 0
    while True:
        for m in (1, 2, 5):
            value = m * 10**exponent
            if value > max_value:
                return tuple(out)
            out.append(float(value))
        exponent += 1


class _Hist:
    __slots__ = ("bounds", "counts", "total")

    def __init__(self, bounds: Sequence[float]) -> None:
        self.bounds = list(bounds)
        self.counts = [0] * (len(self.bounds) + 1)
        self.total = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1
        self.total += value

    def cumulative(self) -> list[tuple[str, float]]:
        out: list[tuple[str, float]] = []
        running = 0
        for bound, count in zip(self.bounds, self.counts, strict=False):
            running += count
            out.append((_fmt(bound), running))
        out.append(("+Inf", running + self.counts[-1]))
        return out


def _fmt(bound: float) -> str:
    return repr(float(bound))


class SimMetrics(Collector):
    def __init__(
        self,
        engine: Engine,
        model_name: str,
        *,
        engine_index: int = 0,
        snapshot: Callable[[], EngineSnapshot] | None = None,
    ) -> None:
        self.engine = engine
        # the state the gauges show: the engine's own, or (virtual time) as of its last step
        self.snapshot = snapshot or engine.snapshot
        self.model_name = model_name
        self._labels = [model_name, str(engine_index)]
        max_len = engine.profile.max_model_len
        token_buckets = build_1_2_5_buckets(max_len)
        # name -> (documentation, histogram)
        self._hists: dict[str, tuple[str, _Hist]] = {
            "vllm:time_to_first_token_seconds": (
                "Histogram of time to first token in seconds.",
                _Hist(TTFT_BUCKETS),
            ),
            "vllm:inter_token_latency_seconds": (
                "Histogram of inter-token latency in seconds.",
                _Hist(ITL_BUCKETS),
            ),
            "vllm:request_time_per_output_token_seconds": (
                "Histogram of time_per_output_token_seconds per request.",
                _Hist(ITL_BUCKETS),
            ),
            "vllm:e2e_request_latency_seconds": (
                "Histogram of e2e request latency in seconds.",
                _Hist(REQUEST_LATENCY_BUCKETS),
            ),
            "vllm:request_queue_time_seconds": (
                "Histogram of time spent in WAITING phase for request.",
                _Hist(REQUEST_LATENCY_BUCKETS),
            ),
            "vllm:request_inference_time_seconds": (
                "Histogram of time spent in RUNNING phase for request.",
                _Hist(REQUEST_LATENCY_BUCKETS),
            ),
            "vllm:request_prefill_time_seconds": (
                "Histogram of time spent in PREFILL phase for request.",
                _Hist(REQUEST_LATENCY_BUCKETS),
            ),
            "vllm:request_decode_time_seconds": (
                "Histogram of time spent in DECODE phase for request.",
                _Hist(REQUEST_LATENCY_BUCKETS),
            ),
            "vllm:request_prompt_tokens": (
                "Number of prefill tokens processed.",
                _Hist(token_buckets),
            ),
            "vllm:request_generation_tokens": (
                "Number of generation tokens processed.",
                _Hist(token_buckets),
            ),
            "vllm:request_params_max_tokens": (
                "Histogram of the max_tokens request parameter.",
                _Hist(token_buckets),
            ),
            "vllm:iteration_tokens_total": (
                "Histogram of number of tokens per engine_step.",
                _Hist((1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)),
            ),
        }
        h = self._hists
        self._ttft = h["vllm:time_to_first_token_seconds"][1]
        self._itl = h["vllm:inter_token_latency_seconds"][1]
        self._tpot = h["vllm:request_time_per_output_token_seconds"][1]
        self._e2e = h["vllm:e2e_request_latency_seconds"][1]
        self._queue = h["vllm:request_queue_time_seconds"][1]
        self._inference = h["vllm:request_inference_time_seconds"][1]
        self._prefill = h["vllm:request_prefill_time_seconds"][1]
        self._decode = h["vllm:request_decode_time_seconds"][1]
        self._prompt_len = h["vllm:request_prompt_tokens"][1]
        self._gen_len = h["vllm:request_generation_tokens"][1]
        self._max_tokens = h["vllm:request_params_max_tokens"][1]
        self._iter_tokens = h["vllm:iteration_tokens_total"][1]
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(self)

    def observe_step(self, result: StepResult) -> None:
        if result.num_scheduled_tokens:
            self._iter_tokens.observe(result.num_scheduled_tokens)
        ttft, itl = self._ttft, self._itl
        for event in result.tokens:
            if event.index == 0:
                ttft.observe(event.latency)
            else:
                itl.observe(event.latency)
        for s in result.finished:
            if s.pooling:
                self._observe_pooled(s)
                continue
            self._e2e.observe(s.e2e)
            self._queue.observe(s.queue_time)
            self._inference.observe(s.inference_time)
            self._prefill.observe(s.prefill_time)
            self._decode.observe(s.decode_time)
            self._prompt_len.observe(s.prompt_tokens)
            self._gen_len.observe(s.generation_tokens)
            self._max_tokens.observe(s.max_tokens)
            tpot = s.time_per_output_token
            if tpot is not None:
                self._tpot.observe(tpot)

    def _observe_pooled(self, s: RequestStats) -> None:
        """A prefill-only request, as vLLM V1 counts one (vllm/v1/metrics/stats.py,
        `IterationStats`; vllm/v1/engine/output_processor.py): its first output is a
        first token for TTFT, it generated 0 tokens, it has no max_tokens parameter (not
        observed), and its mean time per output token is 0."""
        if s.ttft is not None:
            self._ttft.observe(s.ttft)
        self._e2e.observe(s.e2e)
        self._queue.observe(s.queue_time)
        self._inference.observe(s.inference_time)
        self._prefill.observe(s.prefill_time)
        self._decode.observe(s.decode_time)
        self._prompt_len.observe(s.prompt_tokens)
        self._gen_len.observe(0)
        self._tpot.observe(0.0)

    def collect(self) -> Iterator[Metric]:
        labels = ["model_name", "engine"]
        values = self._labels
        snap = self.snapshot()

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(name, doc, labels=labels)
            g.add_metric(values, value)
            return g

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            c = CounterMetricFamily(name, doc, labels=labels)
            c.add_metric(values, value)
            return c

        yield gauge(
            "vllm:num_requests_running",
            "Number of requests in model execution batches.",
            snap.running,
        )
        yield gauge(
            "vllm:num_requests_waiting", "Number of requests waiting to be processed.", snap.waiting
        )
        yield gauge(
            "vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", snap.kv_usage
        )
        yield gauge(
            "vllm:gpu_cache_usage_perc",
            "GPU KV-cache usage. 1 means 100 percent usage. "
            "DEPRECATED: Use vllm:kv_cache_usage_perc instead.",
            snap.kv_usage,
        )
        yield counter(
            "vllm:num_preemptions",
            "Cumulative number of preemption from the engine.",
            snap.num_preemptions_total,
        )
        yield counter(
            "vllm:prompt_tokens", "Number of prefill tokens processed.", snap.prompt_tokens_total
        )
        yield counter(
            "vllm:generation_tokens",
            "Number of generation tokens processed.",
            snap.generation_tokens_total,
        )
        success = CounterMetricFamily(
            "vllm:request_success",
            "Count of successfully processed requests.",
            labels=[*labels, "finished_reason"],
        )
        for reason in FINISH_REASONS:
            success.add_metric([*values, reason], snap.finished_total[reason])
        yield success

        for name, (doc, hist) in self._hists.items():
            fam = HistogramMetricFamily(name, doc, labels=labels)
            fam.add_metric(values, hist.cumulative(), sum_value=hist.total)
            yield fam

        profile = self.engine.profile
        info = {
            "block_size": str(profile.block_size),
            "cache_dtype": "auto",
            "enable_prefix_caching": "False",
            "gpu_memory_utilization": str(profile.gpu_memory_utilization),
            "num_cpu_blocks": "None",
            "num_gpu_blocks": str(profile.num_gpu_blocks),
            "num_gpu_blocks_override": "None",
            "engine": values[1],
        }
        cache = GaugeMetricFamily(
            "vllm:cache_config_info",
            "Information of the LLMEngine CacheConfig",
            labels=list(info),
        )
        cache.add_metric(list(info.values()), 1.0)
        yield cache

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
