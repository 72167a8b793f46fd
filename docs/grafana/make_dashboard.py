"""Writes radixlm.json, the Grafana (10+) dashboard of a radixlm server's /metrics:
``python docs/grafana/make_dashboard.py``. Latency panels use SGLang's metric names, so the
dashboard also reads an SGLang server; cache panels add radixlm's per-namespace counters."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

DS = {"type": "prometheus", "uid": "${datasource}"}
SEL = '{model_name=~"$model_name"}'
RATE = "$__rate_interval"


def quantiles(metric: str) -> list[tuple[str, str]]:
    """p50/p90/p99 of an SGLang histogram, over the selected models."""
    return [(f"histogram_quantile({q}, sum by (le) (rate({metric}_bucket{SEL}[{RATE}])))",
             f"p{int(q * 100)}") for q in (0.5, 0.9, 0.99)]


def panel(pid: int, title: str, targets: list[tuple[str, str]], unit: str, x: int, y: int,
          w: int = 8, h: int = 8, description: str = "") -> dict[str, Any]:
    return {
        "id": pid, "type": "timeseries", "title": title, "description": description,
        "datasource": DS, "gridPos": {"x": x, "y": y, "w": w, "h": h},
        "fieldConfig": {"defaults": {"unit": unit, "custom": {"lineWidth": 1}},
                        "overrides": []},
        "options": {"legend": {"displayMode": "list", "placement": "bottom", "showLegend": True},
                    "tooltip": {"mode": "multi", "sort": "none"}},
        "targets": [{"datasource": DS, "expr": expr, "legendFormat": legend,
                     "refId": chr(ord("A") + i)} for i, (expr, legend) in enumerate(targets)],
    }


def row(pid: int, title: str, y: int) -> dict[str, Any]:
    return {"id": pid, "type": "row", "title": title, "collapsed": False, "panels": [],
            "gridPos": {"x": 0, "y": y, "w": 24, "h": 1}}


def panels() -> list[dict[str, Any]]:
    def ns(kind: str) -> str:
        return f"sum by (namespace) (rate(radixlm:namespace_{kind}_prompt_tokens_total[{RATE}]))"

    hit_ns = f"{ns('cached')} / ({ns('cached')} + {ns('computed')})"
    hit_window = (f"sum(rate(radixlm:prefix_cache_hits_total[{RATE}])) / "
                  f"sum(rate(radixlm:prefix_cache_queries_total[{RATE}]))")
    return [
        row(1, "Latency", 0),
        panel(2, "Time to first token", quantiles("sglang:time_to_first_token_seconds"),
              "s", 0, 1),
        panel(3, "Time per output token (TPOT)",
              quantiles("sglang:request_time_per_output_token_seconds"), "s", 8, 1,
              description="(finish - first token) / (completion tokens - 1), per request"),
        panel(4, "Inter-token latency", quantiles("sglang:inter_token_latency_seconds"),
              "s", 16, 1),
        panel(5, "End-to-end request latency", quantiles("sglang:e2e_request_latency_seconds"),
              "s", 0, 9),
        panel(6, "Queue time", quantiles("sglang:queue_time_seconds"), "s", 8, 9,
              description="From arrival at the scheduler to the first prefill"),
        panel(7, "Requests finished / aborted", [
            (f"sum(rate(sglang:num_requests_total{SEL}[{RATE}]))", "finished"),
            (f"sum(rate(sglang:num_aborted_requests_total{SEL}[{RATE}]))", "aborted")],
            "reqps", 16, 9),
        row(8, "Load", 17),
        panel(9, "Running and queued requests", [
            (f"sum(sglang:num_running_reqs{SEL})", "running"),
            (f"sum(sglang:num_queue_reqs{SEL})", "queued"),
            (f"sum(sglang:num_grammar_queue_reqs{SEL})", "waiting for a grammar")],
            "short", 0, 18),
        panel(10, "KV cache token usage", [
            (f"max(sglang:token_usage{SEL})", "token usage"),
            ("max(radixlm:kv_cache_usage_perc)", "radixlm kv_cache_usage_perc")],
            "percentunit", 8, 18),
        panel(11, "Throughput", [
            (f"sum(sglang:gen_throughput{SEL})", "generation (server's estimate)"),
            (f"sum(rate(sglang:generation_tokens_total{SEL}[{RATE}]))", "generated tokens/s"),
            (f"sum(rate(sglang:prompt_tokens_total{SEL}[{RATE}]))", "prompt tokens/s")],
            "short", 16, 18),
        row(12, "Prefix cache", 26),
        panel(13, "Cache hit rate", [
            (f"max(sglang:cache_hit_rate{SEL})", "since start"),
            (hit_window, "over the rate interval")], "percentunit", 0, 27),
        panel(14, "Cache hit rate by namespace", [(hit_ns, "{{namespace}}")],
              "percentunit", 8, 27,
              description="Tenants by name; 'salted' = requests with extra_key/cache_salt"),
        panel(15, "Evictions and retractions", [
            (f"sum(rate(sglang:evicted_tokens_total{SEL}[{RATE}]))", "evicted tokens/s"),
            (f"sum(increase(sglang:num_retracted_requests_total{SEL}[{RATE}]))",
             "retracted requests")], "short", 16, 27),
        row(16, "Structured output", 35),
        panel(17, "Grammar compile time",
              quantiles("sglang:grammar_compilation_time_seconds"), "s", 0, 36),
        panel(18, "Grammar compiles and cache hits", [
            (f"sum(rate(sglang:grammar_compilation_time_seconds_count{SEL}[{RATE}]))",
             "compiles/s"),
            (f"sum(rate(sglang:num_grammar_cache_hit_total{SEL}[{RATE}]))", "cache hits/s")],
            "short", 8, 36),
    ]


def dashboard() -> dict[str, Any]:
    return {
        "uid": "radixlm", "title": "radixlm", "tags": ["radixlm", "sglang"],
        "schemaVersion": 39, "version": 1, "editable": True, "graphTooltip": 1,
        "time": {"from": "now-1h", "to": "now"}, "refresh": "30s", "timezone": "",
        "annotations": {"list": []},
        "templating": {"list": [
            {"name": "datasource", "label": "Data source", "type": "datasource",
             "query": "prometheus", "current": {}, "hide": 0},
            {"name": "model_name", "label": "Model", "type": "query", "datasource": DS,
             "query": {"query": "label_values(sglang:num_running_reqs, model_name)",
                       "refId": "model_name"},
             "definition": "label_values(sglang:num_running_reqs, model_name)",
             "includeAll": True, "multi": True, "allValue": ".*", "refresh": 2,
             "current": {}, "hide": 0},
        ]},
        "panels": panels(),
    }


if __name__ == "__main__":
    out = Path(__file__).with_name("radixlm.json")
    out.write_text(json.dumps(dashboard(), indent=2) + "\n")
    print(out)
