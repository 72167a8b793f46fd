"""SGLang's metric names on /metrics beside radixlm's, each moving when it should (requests,
eviction and retraction with a tiny KV pool, a JSON-schema compile), and the Grafana
dashboard in docs/grafana querying only metrics the server exposes."""

from __future__ import annotations

import json
import re
import threading
import time
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from radixlm.runtime.entrypoints.server_process import ServerProcess

DASHBOARD = Path(__file__).resolve().parents[2] / "docs" / "grafana" / "radixlm.json"
POOL = 512
SGLANG_GAUGES = ["num_running_reqs", "num_queue_reqs", "num_grammar_queue_reqs", "token_usage",
                 "cache_hit_rate", "gen_throughput", "num_used_tokens", "max_total_num_tokens"]
SGLANG_COUNTERS = ["num_retracted_requests", "evicted_tokens", "prompt_tokens",
                   "generation_tokens", "cached_tokens", "num_requests", "num_aborted_requests",
                   "num_grammar_cache_hit"]
SGLANG_HISTOGRAMS = ["time_to_first_token_seconds", "inter_token_latency_seconds",
                     "request_time_per_output_token_seconds", "e2e_request_latency_seconds",
                     "queue_time_seconds", "grammar_compilation_time_seconds"]
STORY = "tell me a long story about cats and their many adventures " * 3


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    d = tmp_path_factory.mktemp("metrics")
    srv = ServerProcess(["--enable-metrics", "--max-total-tokens", str(POOL),
                         "--decode-log-interval", "5", "--log-level", "warning"],
                        d / "server.log")
    srv.wait_healthy()
    yield srv
    srv.stop()


def scrape(srv: ServerProcess) -> dict[str, float]:
    """Sample name -> value summed over label sets; TYPE lines as ``#type name``."""
    text = httpx.get(srv.url + "/metrics", timeout=30).text
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        out[f"#{fam.type} {fam.name}"] = 1.0
        for s in fam.samples:
            if s.name.endswith("_bucket"):
                continue
            out[s.name] = out.get(s.name, 0.0) + s.value
    return out


def generate(srv: ServerProcess, body: dict) -> dict:
    resp = httpx.post(srv.url + "/generate", json=body, timeout=300)
    assert resp.status_code == 200, resp.text
    return resp.json()


def test_every_sglang_name_is_exposed_with_its_type(server):
    m = scrape(server)
    for name in SGLANG_GAUGES:
        assert f"#gauge sglang:{name}" in m, name
    for name in SGLANG_COUNTERS:
        assert f"#counter sglang:{name}" in m, name
    for name in SGLANG_HISTOGRAMS:
        assert f"#histogram sglang:{name}" in m, name
    assert m["sglang:max_total_num_tokens"] == POOL
    text = httpx.get(server.url + "/metrics").text
    assert re.search(r'sglang:num_running_reqs\{engine_type="unified",model_name="[^"]+"\}',
                     text)


def test_request_metrics_move_after_requests(server):
    before = scrape(server)
    prompt = "The history of the printing press " * 4
    for _ in range(2):  # the second finds the first's prefix in the cache
        generate(server, {"text": prompt, "sampling_params": {"max_new_tokens": 12,
                                                              "temperature": 0,
                                                              "ignore_eos": True}})
    after = scrape(server)
    for name in ("time_to_first_token_seconds", "e2e_request_latency_seconds",
                 "request_time_per_output_token_seconds", "queue_time_seconds"):
        assert after[f"sglang:{name}_count"] >= before.get(f"sglang:{name}_count", 0) + 2, name
    itl = "sglang:inter_token_latency_seconds_count"
    assert after[itl] >= before.get(itl, 0) + 2 * 11
    assert after["sglang:num_requests_total"] == before.get("sglang:num_requests_total", 0) + 2
    assert after["sglang:generation_tokens_total"] - before.get(
        "sglang:generation_tokens_total", 0) == 24
    assert after["sglang:cached_tokens_total"] > before.get("sglang:cached_tokens_total", 0)
    assert after["sglang:prompt_tokens_total"] > before.get("sglang:prompt_tokens_total", 0)
    assert 0 < after["sglang:cache_hit_rate"] <= 1
    assert after["sglang:gen_throughput"] > 0  # decode log interval 5 < 12 steps
    assert after["radixlm:time_to_first_token_seconds_count"] >= 2  # radixlm's own still there


def test_evictions_retractions_and_queue_gauges_with_a_tiny_pool(server):
    before = scrape(server)
    seen = {"running": 0.0, "queued": 0.0, "usage": 0.0}
    done = threading.Event()

    def watch() -> None:
        while not done.is_set():
            m = scrape(server)
            seen["running"] = max(seen["running"], m["sglang:num_running_reqs"])
            seen["queued"] = max(seen["queued"], m["sglang:num_queue_reqs"])
            seen["usage"] = max(seen["usage"], m["sglang:token_usage"])
            time.sleep(0.05)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        # 4 x (73 + 200) tokens cannot fit in 512: two are admitted, and together they
        # outgrow the pool, so one is retracted; the rest queue; new prompts evict old ones
        generate(server, {"text": [f"Request {i}: {STORY}" for i in range(4)],
                          "sampling_params": {"max_new_tokens": 200, "temperature": 0,
                                              "ignore_eos": True}})
    finally:
        done.set()
        watcher.join()
    after = scrape(server)
    assert after["sglang:num_retracted_requests_total"] > before[
        "sglang:num_retracted_requests_total"]
    assert after["sglang:evicted_tokens_total"] > before["sglang:evicted_tokens_total"]
    assert after["radixlm:evicted_tokens_total"] == after["sglang:evicted_tokens_total"]
    assert seen["running"] >= 1 and seen["queued"] >= 1 and 0 < seen["usage"] <= 1
    assert after["sglang:num_running_reqs"] == after["sglang:num_queue_reqs"] == 0


def test_grammar_compile_time_is_observed(server):
    name = "sglang:grammar_compilation_time_seconds_count"
    before = scrape(server)
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    for _ in range(2):  # the second is a grammar cache hit: compiled once
        generate(server, {"text": "JSON:", "sampling_params": {
            "max_new_tokens": 16, "temperature": 0, "json_schema": json.dumps(schema)}})
    after = scrape(server)
    assert after[name] == before.get(name, 0) + 1
    assert after["radixlm:grammar_compile_time_seconds_count"] == after[name]
    assert after["sglang:grammar_compilation_time_seconds_sum"] > 0
    assert after["sglang:num_grammar_cache_hit_total"] >= 1


def dashboard_metrics() -> set[str]:
    board = json.loads(DASHBOARD.read_text())
    assert board["uid"] == "radixlm" and board["schemaVersion"] >= 36
    exprs = [t["expr"] for p in board["panels"] for t in p.get("targets", [])]
    assert len(exprs) >= 20
    variables = [v["definition"] for v in board["templating"]["list"] if "definition" in v]
    return {m for e in exprs + variables for m in re.findall(r"(?:sglang|radixlm):\w+", e)}


def test_dashboard_queries_only_exposed_metrics(server):
    generate(server, {"text": "warm up the histograms", "sampling_params": {
        "max_new_tokens": 3, "temperature": 0}})
    text = httpx.get(server.url + "/metrics").text
    samples = {s.name for fam in text_string_to_metric_families(text) for s in fam.samples}
    wanted = dashboard_metrics()
    for q in ("time_to_first_token_seconds", "request_time_per_output_token_seconds",
              "inter_token_latency_seconds", "e2e_request_latency_seconds",
              "queue_time_seconds", "grammar_compilation_time_seconds"):
        assert f"sglang:{q}_bucket" in wanted, q
    assert {"sglang:num_running_reqs", "sglang:num_queue_reqs", "sglang:token_usage",
            "sglang:cache_hit_rate", "sglang:evicted_tokens_total",
            "sglang:num_retracted_requests_total",
            "radixlm:namespace_cached_prompt_tokens_total"} <= wanted
    missing = sorted(wanted - samples)
    assert not missing, missing
