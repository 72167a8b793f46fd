"""``radixlm serve`` in prefill and decode mode behind the built-in PD router (what
``radixlm serve-pd`` runs): outputs equal a single server's; faults leave both healthy with
every page free or evictable."""

from __future__ import annotations

import json
import threading
import time

import httpx
import jsonschema
import pytest

from radixlm.runtime.entrypoints.server_process import free_port

FLAGS = ["--max-total-tokens", "4096", "--log-level", "warning", "--page-size", "4",
         "--chunked-prefill-size", "64", "--cpu-threads", "1", "--random-seed", "0"]
GREEDY = {"max_new_tokens": 10, "temperature": 0.0, "ignore_eos": True}
LONG = " ".join(f"word{i % 37}" for i in range(180))


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, pd_cluster):
    pd = ["--disaggregation-bootstrap-timeout", "4", "--disaggregation-waiting-timeout", "8"]
    with pd_cluster(tmp_path_factory.mktemp("pd"), FLAGS, pd) as servers:
        yield servers


def generate(url: str, **body) -> httpx.Response:
    return httpx.post(url + "/generate", json=body, timeout=120)


def assert_clean(*urls: str) -> None:
    """Idle, nothing owned or locked, no room left in a queue."""
    for url in urls:
        deadline = time.monotonic() + 30
        while True:
            info = httpx.get(url + "/server_info", timeout=10).json()
            queues = [v for k, v in info.items() if k.endswith("_queue_reqs")]
            if info["num_running_reqs"] == 0 and not any(queues) or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        assert info["num_running_reqs"] == 0 and not any(queues), info
        assert info["used_tokens"] == 0 and info["protected_tokens"] == 0, info
        assert httpx.get(url + "/health").status_code == 200


@pytest.mark.parametrize("text", ["The capital of France is", LONG])
def test_greedy_matches_single_server(cluster, text):
    mono, prefill, dec, router, _ = cluster
    want = generate(mono.url, text=text, sampling_params=GREEDY).json()
    got = generate(router, text=text, sampling_params=GREEDY).json()
    assert got["output_ids"] == want["output_ids"] and got["text"] == want["text"]
    assert got["meta_info"]["prompt_tokens"] == want["meta_info"]["prompt_tokens"]
    assert_clean(prefill.url, dec.url)


def test_v1_loads_of_both_servers(cluster):
    """/v1/loads on each side: its mode, a prefill server's transfers (speed and latency
    from the acked rooms; utilization -1, as SGLang), nothing left queued."""
    mono, prefill, dec, router, _ = cluster
    assert generate(router, text=LONG, sampling_params=GREEDY).status_code == 200
    assert_clean(prefill.url, dec.url)
    pre = httpx.get(prefill.url + "/v1/loads").json()["loads"][0]
    post = httpx.get(dec.url + "/v1/loads").json()["loads"][0]
    assert pre["disaggregation"]["mode"] == "prefill" and pre["utilization"] == -1
    assert pre["disaggregation"]["kv_transfer_latency_ms"] > 0
    assert pre["disaggregation"]["kv_transfer_speed_gb_s"] > 0
    assert pre["total_prefill_uncached_tokens"] > 0
    assert post["disaggregation"]["mode"] == "decode" and post["decode_moments"][0] > 0
    for load in (pre, post):
        assert load["num_waiting_reqs"] == 0 and load["num_total_tokens"] == 0
        assert all(v == 0 for k, v in load["disaggregation"].items() if k.endswith("_reqs"))


def test_json_schema_through_pd_matches_single_server(cluster):
    """Constrained decoding across the split: the prefill masks the first token, the
    decode server goes on from it; the JSON is valid and equals one server's."""
    mono, prefill, dec, router, _ = cluster
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                               "rank": {"type": "integer"}},
              "required": ["city", "rank"]}
    params = {"max_new_tokens": 64, "temperature": 0.0, "json_schema": json.dumps(schema)}
    want = generate(mono.url, text="A city as JSON:", sampling_params=params).json()
    got = generate(router, text="A city as JSON:", sampling_params=params).json()
    assert got["output_ids"] == want["output_ids"] and got["text"] == want["text"]
    assert got["meta_info"]["finish_reason"]["type"] == "stop"  # the object closed
    jsonschema.validate(json.loads(got["text"]), schema)
    assert_clean(prefill.url, dec.url)


def _close(got, want) -> bool:
    """Equal structure and ids; logprobs within float32 noise (the two sides may batch the
    prompts differently)."""
    if isinstance(want, list):
        return (isinstance(got, list) and len(got) == len(want)
                and all(_close(g, w) for g, w in zip(got, want)))
    if isinstance(want, float):
        return isinstance(got, float) and abs(got - want) <= 1e-4 * max(1.0, abs(want))
    return got == want


OUTPUT_KEYS = ("output_token_logprobs", "output_top_logprobs", "output_token_ids_logprobs")
PROMPT_KEYS = ("input_token_logprobs", "input_top_logprobs", "input_token_ids_logprobs")


def _streamed(url: str, body: dict) -> list[dict]:
    """Each index of a /generate stream as one result: the last chunk's ids and prompt
    logprobs (every chunk carries them), the output logprobs of all chunks joined (each
    chunk carries its new tokens')."""
    results: dict[int, dict] = {}
    with httpx.stream("POST", url + "/generate", timeout=120, json={**body, "stream": True}) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data:") and line != "data: [DONE]":
                chunk = json.loads(line[5:])
                i = chunk.get("index", 0)
                joined = {k: results[i]["meta_info"][k] + chunk["meta_info"][k]
                          for k in OUTPUT_KEYS if i in results}
                chunk["meta_info"].update(joined)
                results[i] = chunk
    assert sorted(results) == list(range(len(results)))
    return [results[i] for i in range(len(results))]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("batch", [False, True])
def test_logprobs_through_pd_match_single_server(cluster, batch, stream):
    """return_logprob across the split: output logprobs from the decode server (the first
    token's came with the KV), prompt logprobs merged in from the prefill's answer; in a
    stream, into every chunk, so the stream adds up to a single server's answer."""
    mono, prefill, dec, router, _ = cluster
    text = ["The capital of France is", LONG] if batch else LONG
    body = dict(text=text, sampling_params=GREEDY, return_logprob=True, top_logprobs_num=2,
                logprob_start_len=3, token_ids_logprob=[5, 9])
    want = generate(mono.url, **body).json()
    got = _streamed(router, body) if stream else generate(router, **body).json()
    want, got = (want, got) if batch else ([want], got if stream else [got])
    assert len(got) == len(want)
    for w, g in zip(want, got):
        assert g["output_ids"] == w["output_ids"]
        for key in PROMPT_KEYS + OUTPUT_KEYS:
            assert _close(g["meta_info"][key], w["meta_info"][key]), key
        assert len(w["meta_info"]["input_token_logprobs"]) > 1
    assert_clean(prefill.url, dec.url)


def test_n_samples_and_streaming(cluster):
    mono, prefill, dec, router, _ = cluster
    want = generate(mono.url, text=LONG, sampling_params=GREEDY).json()["output_ids"]
    got = generate(router, text=LONG, sampling_params={**GREEDY, "n": 2}).json()
    assert [g["output_ids"] for g in got] == [want, want]
    with httpx.stream("POST", router + "/generate", timeout=120,
                      json={"text": LONG, "sampling_params": GREEDY, "stream": True}) as r:
        chunks = [line for line in r.iter_lines() if line.startswith("data:")]
    assert chunks[-1] == "data: [DONE]" and len(chunks) > 2
    assert_clean(prefill.url, dec.url)


def test_openai_chat_matches_single_server(cluster):
    mono, prefill, dec, router, _ = cluster
    body = {"messages": [{"role": "user", "content": "Tell me a story"}], "max_tokens": 8,
            "temperature": 0}
    want = httpx.post(mono.url + "/v1/chat/completions", json=body, timeout=120).json()
    got = httpx.post(router + "/v1/chat/completions", json=body, timeout=120).json()
    assert got["choices"][0]["message"] == want["choices"][0]["message"]
    assert_clean(prefill.url, dec.url)


def test_bootstrap_fields_refused_without_a_mode(cluster):
    mono = cluster[0]
    r = generate(mono.url, text="hi", bootstrap_host="127.0.0.1", bootstrap_room=5)
    assert r.status_code == 400 and "--disaggregation-mode null" in r.text
    r = generate(mono.url, text="hi", disagg_prefill_dp_rank=0)
    assert r.status_code == 400 and "disagg_prefill_dp_rank" in r.text
    assert generate(mono.url, text="hi", bootstrap_room=None).status_code == 200  # neutral


def test_bad_bootstrap_values_are_400(cluster):
    dec = cluster[2]
    for bad in ({"bootstrap_room": -1}, {"bootstrap_room": [1, 2, 3]},
                {"bootstrap_port": 70000}):
        r = generate(dec.url, text="hi", **{"bootstrap_host": "x", "bootstrap_room": 1, **bad})
        assert r.status_code == 400 and "bootstrap_" in r.text, r.text


def test_faults_leave_both_servers_clean(cluster):
    _, prefill, dec, _, bport = cluster
    body = {"text": LONG, "sampling_params": GREEDY, "bootstrap_host": "127.0.0.1",
            "bootstrap_port": bport}
    # a room no decode server claims
    r = generate(prefill.url, **body, bootstrap_room=11)
    assert r.status_code == 503 and "no decode server claimed" in r.text
    # a room whose request never reaches the prefill server
    r = generate(dec.url, **body, bootstrap_room=12)
    assert r.status_code == 503 and "bootstrap_room" in r.text
    # a prefill server that does not exist
    r = generate(dec.url, **{**body, "bootstrap_port": free_port()}, bootstrap_room=13)
    assert r.status_code == 503 and "bootstrap" in r.text
    assert_clean(prefill.url, dec.url)


def test_abort_on_the_decode_server(cluster):
    """A claimed room aborted on the decode server: the claim is withdrawn, so the prefill's
    copy of the request fails (nobody claims it) and both servers free everything."""
    _, prefill, dec, _, bport = cluster
    body = {"text": LONG, "sampling_params": GREEDY, "bootstrap_host": "127.0.0.1",
            "bootstrap_port": bport, "bootstrap_room": 21, "rid": "leaving"}
    result: dict = {}
    thread = threading.Thread(target=lambda: result.update(r=generate(dec.url, **body)))
    thread.start()
    deadline = time.monotonic() + 60
    while httpx.get(dec.url + "/server_info").json()["num_decode_transfer_queue_reqs"] == 0:
        assert time.monotonic() < deadline and thread.is_alive(), result
        time.sleep(0.05)
    assert httpx.post(dec.url + "/abort_request", json={"rid": "leaving"}).status_code == 200
    thread.join(timeout=60)
    assert result["r"].json()["meta_info"]["finish_reason"]["type"] == "abort"
    r = generate(prefill.url, **body)
    # the withdrawn claim is seen before the request arrives (or, on a slow day, after it)
    assert r.status_code == 503 and ("no decode server claimed" in r.text
                                     or "decode server aborted" in r.text), r.text
    assert_clean(prefill.url, dec.url)
