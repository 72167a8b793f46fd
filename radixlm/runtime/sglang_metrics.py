"""SGLang's metric names, so SGLang's dashboards and alerts work unchanged: the scheduler
gauges and counters read from ``get_info`` (``SGLANG_GAUGES`` / ``SGLANG_COUNTERS``,
exposed by ``metrics.SchedulerCollector``), SGLang's default buckets, and its request
metrics (``SGLangRequestMetrics``: its TokenizerMetricsCollector's names)."""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram

LabelValues = tuple[str, ...]  # one value per allowed custom label name, in flag order

SGLANG = "sglang:"
SGLANG_LABELS = ["model_name", "engine_type"]
# SGLang's default buckets (metrics_collector.py)
SGLANG_TTFT_BUCKETS = (0.1, 0.2, 0.4, 0.6, 0.8, 1, 2, 4, 6, 8, 10, 20, 40, 60, 80, 100, 200,
                       400)
SGLANG_E2E_BUCKETS = (*SGLANG_TTFT_BUCKETS, 600, 1200, 1800, 2400)
SGLANG_ITL_BUCKETS = (0.002, 0.004, 0.006, 0.008, 0.010, 0.015, 0.020, 0.025, 0.030, 0.035,
                      0.040, 0.060, 0.080, 0.100, 0.200, 0.400, 0.600, 0.800, 1.0, 2.0, 4.0,
                      6.0, 8.0)
SGLANG_QUEUE_BUCKETS = (0.0, 0.001, 0.005, 0.01, 0.05, 0.1, 0.2, 0.5, 1, 2, 3, 4, 5, 10, 15,
                        20, 30, 40, 50, 60, 70, 80, 90, 100, 200, 300, 400, 500, 600, 700,
                        800, 900, 1000, 1200, 1400, 1600, 1800, 2000, 2500, 3000)
# sglang gauge -> (get_info() key, help)
SGLANG_GAUGES = {
    "num_running_reqs": ("num_running_reqs", "The number of running requests."),
    "num_queue_reqs": ("num_queue_reqs", "The number of requests in the waiting queue."),
    "num_grammar_queue_reqs": ("num_grammar_queue_reqs",
                               "The number of requests in the grammar waiting queue."),
    "gen_throughput": ("gen_throughput", "The generation throughput (token/s), over the last "
                       "--decode-log-interval decode steps."),
    "cache_hit_rate": ("cache_hit_rate", "The prefix cache hit rate (cached / admitted "
                       "prompt tokens since start)."),
    "token_usage": ("token_usage", "The token usage (share of the KV pool in use)."),
    "num_used_tokens": ("used_tokens", "KV slots in use (tree's locked ones and requests')."),
    "max_total_num_tokens": ("max_total_num_tokens", "KV pool size in tokens."),
    "spec_accept_length": ("spec_accept_length",
                           "The average acceptance length of speculative decoding."),
}
# sglang counter (exposed with _total) -> (get_info() key, help)
SGLANG_COUNTERS = {
    "num_retracted_requests": ("num_preemptions", "Total number of retracted requests."),
    "evicted_tokens": ("evicted_tokens", "The number of KV token slots freed by eviction."),
    "num_grammar_cache_hit": ("grammar_cache_hits", "Number of grammar cache hits."),
}


class SGLangRequestMetrics:
    """SGLang's request metrics (its TokenizerMetricsCollector's names), labelled
    ``model_name``, ``engine_type`` and the allowed custom labels."""

    def __init__(self, reg: CollectorRegistry, model_name: str, custom: list[str]) -> None:
        self.base = (model_name, "unified")
        names = [*SGLANG_LABELS, *custom]

        def hist(name: str, doc: str, buckets: tuple[float, ...],
                 labels: list[str] = names) -> Histogram:
            return Histogram(SGLANG + name, doc, labels, buckets=buckets, registry=reg)

        def counter(name: str, doc: str) -> Counter:
            c = Counter(SGLANG + name, doc, names, registry=reg)
            c.labels(*self.base, *[""] * len(custom))  # 0 from the start, not absent
            return c

        self.ttft = hist("time_to_first_token_seconds",
                         "Histogram of time to first token in seconds.", SGLANG_TTFT_BUCKETS)
        self.itl = hist("inter_token_latency_seconds",
                        "Histogram of inter-token latency in seconds.", SGLANG_ITL_BUCKETS)
        self.tpot = hist("request_time_per_output_token_seconds",
                         "Per-request TPOT in seconds: (finished_time - first_token_time) / "
                         "(completion_tokens - 1).", SGLANG_ITL_BUCKETS)
        self.e2e = hist("e2e_request_latency_seconds",
                        "Histogram of End-to-end request latency in seconds",
                        SGLANG_E2E_BUCKETS)
        self.queue_time = hist("queue_time_seconds", "Histogram of queueing time in seconds.",
                               SGLANG_QUEUE_BUCKETS, SGLANG_LABELS)
        self.prompt_tokens = counter("prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = counter("generation_tokens",
                                         "Number of generation tokens processed.")
        self.cached_tokens = counter("cached_tokens", "Number of cached prompt tokens.")
        self.requests = counter("num_requests", "Number of requests processed.")
        self.aborted = counter("num_aborted_requests", "Number of requests aborted.")

    def on_finish(self, labels: LabelValues, e2e: float, tpot: float | None, out: Any,
                  aborted: bool) -> None:
        values = (*self.base, *labels)
        self.e2e.labels(*values).observe(e2e)
        if tpot is not None:
            self.tpot.labels(*values).observe(tpot)
        self.requests.labels(*values).inc()
        if aborted:
            self.aborted.labels(*values).inc()
        if out is not None:
            self.prompt_tokens.labels(*values).inc(out.prompt_tokens)
            self.generation_tokens.labels(*values).inc(out.completion_tokens)
            self.cached_tokens.labels(*values).inc(out.cached_tokens)
