"""SGLang's /metrics (Prometheus; the server needs `--enable-metrics`).

Names from SGLang's own source, `python/sglang/srt/metrics/collector.py`
(SchedulerMetricsCollector and TokenizerMetricsCollector; 0.4.x to 0.5.x):
`sglang:num_running_reqs`, `sglang:num_queue_reqs`, `sglang:token_usage` (0..1, the share
of the KV pool in use), the histograms `sglang:time_to_first_token_seconds` and
`sglang:inter_token_latency_seconds` (`sglang:time_per_output_token_seconds` in 0.4).
KV capacity in tokens, by version: the gauge `sglang:max_total_num_tokens` (0.5.x), the
gauges `sglang:page_size` x `sglang:num_pages` (0.5.11 on), the labels of
`sglang:cache_config_info{page_size,num_pages}` (0.5.x before 0.5.11, as the Gateway API
Inference Extension's model-server protocol table reads it), else derived as
`sglang:num_used_tokens / sglang:token_usage` while the pool is in use (0.4.x, which has
neither). The page size (the gauge, or the label) is handed on as the block size: the
pool allocates whole pages, so a request's KV rounds up to one. The scheduler rounds
`token_usage` to 2 decimals (`scheduler.py`, `log_prefill_stats` / `log_decode_stats`:
`round(num_used / self.max_total_num_tokens, 2)`), so the derivation is off by up to
0.005 / usage: it waits for a usage of 0.1 (5 %), keeps the figure from the fullest pool
seen, and is flagged an estimate (the budget's fraction absorbs it; a request is never
refused against it). Preemptions are "retractions": the counter
`sglang:num_retracted_requests_total` (0.5.x), else the gauge `sglang:num_retracted_reqs`
(the last batch's retractions), turned here into a counter that rises with every scrape
that shows retractions."""

from __future__ import annotations

from collections.abc import Mapping

from sluice.core.types import BackendMetrics
from sluice.gateway.engines.base import EngineAdapter, Route
from sluice.gateway.engines.prom import Page, Scanner, WindowedP95, int_or_none

RUNNING = "sglang:num_running_reqs"
WAITING = "sglang:num_queue_reqs"
USAGE = "sglang:token_usage"
USED = "sglang:num_used_tokens"
MAX_TOKENS = "sglang:max_total_num_tokens"
PAGE_SIZE = "sglang:page_size"
NUM_PAGES = "sglang:num_pages"
RETRACTED_TOTAL = "sglang:num_retracted_requests"
RETRACTED_NOW = "sglang:num_retracted_reqs"
CACHE_INFO = "sglang:cache_config_info"
# The usage (rounded to 2 decimals by SGLang) from which used / usage is taken as the
# capacity: within 5 % there.
MIN_DERIVING_USAGE = 0.1
TTFT = ("sglang:time_to_first_token_seconds",)
TPOT = ("sglang:inter_token_latency_seconds", "sglang:time_per_output_token_seconds")


class SglangAdapter(EngineAdapter):
    name = "sglang"
    routes = (Route("/metrics", required=True),)
    start_hint = "start SGLang with --enable-metrics"

    def __init__(self) -> None:
        values = (RUNNING, WAITING, USAGE, USED, MAX_TOKENS, PAGE_SIZE, NUM_PAGES)
        self._scan = Scanner(
            (*values, RETRACTED_TOTAL, RETRACTED_NOW), (*TTFT, *TPOT), (CACHE_INFO,)
        )
        self._ttft = WindowedP95()
        self._tpot = WindowedP95()
        # derived from used / usage (kept: static), and the usage it was derived at
        self._capacity: float | None = None
        self._capacity_usage = 0.0
        self._retractions = 0.0  # a counter made from the gauge, when there is no counter

    def read(self, pages: Mapping[str, str], at: float) -> BackendMetrics:
        page = self._scan.scan(pages["/metrics"])
        v = page.values
        page_size = _page_size(page)
        capacity = _stated_capacity(page, page_size)
        estimated = capacity is None
        if estimated:
            capacity = self._derive_capacity(page)
        preemptions = v.get(RETRACTED_TOTAL)
        if preemptions is None and RETRACTED_NOW in v:
            self._retractions += max(0.0, v[RETRACTED_NOW])
            preemptions = self._retractions
        ttft, has_ttft = self._ttft.update(page, TTFT)
        tpot, has_tpot = self._tpot.update(page, TPOT)
        return self.metrics(
            at,
            has_ttft=has_ttft,
            has_tpot=has_tpot,
            running=v.get(RUNNING),
            waiting=v.get(WAITING),
            kv_usage=v.get(USAGE),
            preemptions_total=preemptions,
            kv_capacity_tokens=capacity,
            kv_capacity_estimated=estimated and capacity is not None,
            block_size=page_size,
            ttft_p95_s=ttft,
            tpot_p95_s=tpot,
        )

    def _derive_capacity(self, page: Page) -> float | None:
        """used / usage, from the fullest pool seen (the least rounding error)."""
        usage, used = page.values.get(USAGE), page.values.get(USED)
        if usage and used and usage >= MIN_DERIVING_USAGE and usage > self._capacity_usage:
            self._capacity, self._capacity_usage = used / usage, usage
        return self._capacity


def _stated_capacity(page: Page, page_size: int | None) -> float | None:
    v = page.values
    if v.get(MAX_TOKENS):
        return v[MAX_TOKENS]
    count = v.get(NUM_PAGES) or int_or_none(page.infos.get(CACHE_INFO, {}).get("num_pages"))
    if page_size and count:
        return float(page_size * count)
    return None


def _page_size(page: Page) -> int | None:
    """Tokens per page of the KV pool (the engine allocates whole pages, as vLLM's
    blocks: what bounded outputs round each request up by), where SGLang says."""
    size = page.values.get(PAGE_SIZE) or int_or_none(
        page.infos.get(CACHE_INFO, {}).get("page_size")
    )
    return int(size) if size and size > 0 else None
