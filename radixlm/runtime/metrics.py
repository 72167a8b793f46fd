"""Prometheus metrics of the server, named after vLLM's and SGLang's with ``radixlm:``.

Request-level histograms and counters are observed in the tokenizer manager as outputs
arrive; the scheduler's gauges and counters come from its ``get_info()`` snapshot, taken
when ``/metrics`` is scraped (``SchedulerCollector``).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

logger = logging.getLogger(__name__)

PREFIX = "radixlm:"
_LATENCY_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
_E2E_BUCKETS = (
    0.1,
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
)

# get_info() key -> (metric, help); counters are exposed with a ``_total`` suffix
_GAUGES = {
    "num_running_reqs": ("num_requests_running", "Requests in the running batch"),
    "num_waiting_reqs": ("num_requests_waiting", "Requests waiting to be scheduled"),
}
_COUNTERS = {
    "prompt_tokens": ("prompt_tokens", "Prompt tokens admitted (recomputed ones included)"),
    "generation_tokens": ("generation_tokens", "Tokens generated"),
    "num_preemptions": ("num_preemptions", "Requests retracted when the KV cache was full"),
}


class SchedulerCollector(Collector):
    """Exposes the last scheduler snapshot (``get_info()``) set through ``update``."""

    def __init__(self) -> None:
        self.info: dict[str, Any] = {}

    def update(self, info: dict[str, Any]) -> None:
        self.info = info

    def collect(self) -> Iterator[Metric]:
        info = self.info
        for key, (name, doc) in _GAUGES.items():
            yield GaugeMetricFamily(PREFIX + name, doc, value=info.get(key, 0))
        yield GaugeMetricFamily(
            PREFIX + "kv_cache_usage_perc",
            "Share of the KV pool in use (1 = full)",
            value=info.get("token_usage", 0.0),
        )
        for key, (name, doc) in _COUNTERS.items():
            yield CounterMetricFamily(PREFIX + name, doc, value=info.get(key, 0))
        yield CounterMetricFamily(
            PREFIX + "prefix_cache_queries",
            "Prompt tokens looked up in the prefix cache",
            value=info.get("prompt_tokens", 0),
        )
        yield CounterMetricFamily(
            PREFIX + "prefix_cache_hits",
            "Prompt tokens found in the prefix cache",
            value=info.get("cached_tokens", 0),
        )


class ServerMetrics:
    """Every collector of one server, in its own registry."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.scheduler = SchedulerCollector()
        self.registry.register(self.scheduler)
        reg = self.registry
        self.request_success = Counter(
            PREFIX + "request_success", "Finished requests", ["finish_reason"], registry=reg
        )
        self.ttft = Histogram(
            PREFIX + "time_to_first_token_seconds",
            "Time to first token",
            buckets=_LATENCY_BUCKETS,
            registry=reg,
        )
        self.itl = Histogram(
            PREFIX + "inter_token_latency_seconds",
            "Time between tokens",
            buckets=_LATENCY_BUCKETS,
            registry=reg,
        )
        self.e2e = Histogram(
            PREFIX + "e2e_request_latency_seconds",
            "Request latency",
            buckets=_E2E_BUCKETS,
            registry=reg,
        )
        self.queue_time = Histogram(
            PREFIX + "request_queue_time_seconds",
            "Time waiting before the first prefill",
            buckets=_LATENCY_BUCKETS,
            registry=reg,
        )

    def on_first_token(self, ttft: float) -> None:
        self.ttft.observe(ttft)

    def on_tokens(self, gap: float, n: int) -> None:
        """``n`` tokens arrived ``gap`` seconds after the previous ones."""
        for _ in range(n):
            self.itl.observe(gap / n)

    def on_finish(self, finish_reason: dict[str, Any] | None, e2e: float) -> None:
        self.request_success.labels((finish_reason or {}).get("type", "unknown")).inc()
        self.e2e.observe(e2e)

    def on_queue_times(self, values: list[float]) -> None:
        for v in values:
            self.queue_time.observe(v)

    def render(self, scheduler_info: dict[str, Any]) -> bytes:
        self.scheduler.update(scheduler_info)
        return generate_latest(self.registry)
