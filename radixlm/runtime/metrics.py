"""Prometheus metrics of the server, named after vLLM's and SGLang's with ``radixlm:``.

Request-level histograms and counters are observed in the tokenizer manager as outputs
arrive; the scheduler's gauges and counters come from its ``get_info()`` snapshot, taken
when ``/metrics`` is scraped (``SchedulerCollector``).

Custom labels (SGLang's ``custom_labels``): the request metrics (TTFT, inter-token
latency, e2e latency, finished requests) carry one label per name the server allows
(``--tokenizer-metrics-allowed-custom-labels``), "" where a request gives none. A client
picks the values, so their number is bounded: each value has at most
``MAX_CUSTOM_LABEL_CHARS`` characters (longer is a 400), and once
``MAX_CUSTOM_LABEL_SETS`` distinct value combinations have been seen, requests with a new
combination are counted under ``OTHER_LABEL`` in every custom label. The series of one
metric are thus at most ``MAX_CUSTOM_LABEL_SETS + 2`` per other label value.
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
MAX_CUSTOM_LABEL_SETS = 100
MAX_CUSTOM_LABEL_CHARS = 128
OTHER_LABEL = "__other__"
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
        yield from _namespace_metrics(info.get("namespace_cache", {}))


def _namespace_metrics(by_label: dict[str, dict[str, int]]) -> Iterator[Metric]:
    """Prompt tokens by cache namespace (``validation.namespace_label``: a tenant's name,
    ``default``, ``salted`` or ``other``; never a key or salt), cached vs computed."""
    families = {
        "cached": CounterMetricFamily(PREFIX + "namespace_cached_prompt_tokens",
                                      "Prompt tokens found in the prefix cache, by namespace",
                                      labels=["namespace"]),
        "computed": CounterMetricFamily(PREFIX + "namespace_computed_prompt_tokens",
                                        "Prompt tokens computed (not cached), by namespace",
                                        labels=["namespace"]),
        "rate": GaugeMetricFamily(PREFIX + "namespace_cache_hit_rate",
                                  "Share of prompt tokens found in the prefix cache, by "
                                  "namespace", labels=["namespace"]),
    }
    for label, c in sorted(by_label.items()):
        prompt, cached = c["prompt_tokens"], c["cached_tokens"]
        families["cached"].add_metric([label], cached)
        families["computed"].add_metric([label], prompt - cached)
        families["rate"].add_metric([label], cached / max(prompt, 1))
    yield from families.values()


LabelValues = tuple[str, ...]  # one value per allowed custom label name, in flag order


class ServerMetrics:
    """Every collector of one server, in its own registry. ``custom_labels``: the label
    names requests may set (SGLang's ``--tokenizer-metrics-allowed-custom-labels``)."""

    def __init__(self, custom_labels: tuple[str, ...] = ()) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.scheduler = SchedulerCollector()
        self.registry.register(self.scheduler)
        reg = self.registry
        self.custom_labels = tuple(custom_labels)
        self._label_sets: set[LabelValues] = set()
        names = list(self.custom_labels)
        self.request_success = Counter(
            PREFIX + "request_success", "Finished requests", ["finish_reason", *names],
            registry=reg,
        )
        self.ttft = Histogram(
            PREFIX + "time_to_first_token_seconds",
            "Time to first token",
            names,
            buckets=_LATENCY_BUCKETS,
            registry=reg,
        )
        self.itl = Histogram(
            PREFIX + "inter_token_latency_seconds",
            "Time between tokens",
            names,
            buckets=_LATENCY_BUCKETS,
            registry=reg,
        )
        self.e2e = Histogram(
            PREFIX + "e2e_request_latency_seconds",
            "Request latency",
            names,
            buckets=_E2E_BUCKETS,
            registry=reg,
        )
        self.queue_time = Histogram(
            PREFIX + "request_queue_time_seconds",
            "Time waiting before the first prefill",
            buckets=_LATENCY_BUCKETS,
            registry=reg,
        )

    def check_labels(self, labels: dict[str, str] | None) -> None:
        """ValueError (a 400) unless every name is allowed and every value a short string."""
        for name, value in (labels or {}).items():
            if name not in self.custom_labels:
                allowed = ", ".join(self.custom_labels) or "none"
                raise ValueError(f"custom_labels: label {name!r} is not allowed on this "
                                 f"server (allowed: {allowed}; "
                                 "--tokenizer-metrics-allowed-custom-labels)")
            if not isinstance(value, str) or len(value) > MAX_CUSTOM_LABEL_CHARS:
                raise ValueError(f"custom_labels.{name} must be a string of at most "
                                 f"{MAX_CUSTOM_LABEL_CHARS} characters, got {value!r:.80}")

    def label_values(self, labels: dict[str, str] | None) -> LabelValues:
        """A checked request's label values, with new combinations past
        ``MAX_CUSTOM_LABEL_SETS`` folded into ``OTHER_LABEL``."""
        values = tuple((labels or {}).get(name, "") for name in self.custom_labels)
        if not labels or values in self._label_sets:
            return values
        if len(self._label_sets) >= MAX_CUSTOM_LABEL_SETS:
            return (OTHER_LABEL,) * len(values)
        self._label_sets.add(values)
        return values

    def on_first_token(self, ttft: float, labels: LabelValues = ()) -> None:
        self._with(self.ttft, labels).observe(ttft)

    def on_tokens(self, gap: float, n: int, labels: LabelValues = ()) -> None:
        """``n`` tokens arrived ``gap`` seconds after the previous ones."""
        itl = self._with(self.itl, labels)
        for _ in range(n):
            itl.observe(gap / n)

    def on_finish(self, finish_reason: dict[str, Any] | None, e2e: float,
                  labels: LabelValues = ()) -> None:
        reason = (finish_reason or {}).get("type", "unknown")
        self.request_success.labels(reason, *self._values(labels)).inc()
        self._with(self.e2e, labels).observe(e2e)

    def _values(self, labels: LabelValues) -> LabelValues:
        return labels if labels else ("",) * len(self.custom_labels)

    def _with(self, metric: Any, labels: LabelValues) -> Any:
        return metric.labels(*self._values(labels)) if self.custom_labels else metric

    def on_queue_times(self, values: list[float]) -> None:
        for v in values:
            self.queue_time.observe(v)

    def render(self, scheduler_info: dict[str, Any]) -> bytes:
        self.scheduler.update(scheduler_info)
        return generate_latest(self.registry)
