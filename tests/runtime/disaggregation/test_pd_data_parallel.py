"""Prefill and decode servers with ``--dp-size 2`` each: replica 0 of the prefill server
runs the bootstrap service for both replicas, room r is prefilled on replica r mod 2, and
every output equals a single server's."""

from __future__ import annotations

import json
import time

import httpx
import pytest

from tests.runtime.disaggregation.pd_client import both, post

FLAGS = ["--max-total-tokens", "4096", "--log-level", "warning", "--page-size", "4",
         "--chunked-prefill-size", "64", "--cpu-threads", "1", "--random-seed", "0"]
GREEDY = {"max_new_tokens": 8, "temperature": 0.0, "ignore_eos": True}
PROMPTS = [f"Question {i}: what is {' '.join(['seven'] * (3 + 5 * i))}?" for i in range(4)]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, pd_cluster):
    pd = ["--disaggregation-bootstrap-timeout", "10", "--disaggregation-waiting-timeout", "20",
          "--dp-size", "2"]
    with pd_cluster(tmp_path_factory.mktemp("pd-dp"), FLAGS, pd,
                    ["--load-balance-method", "round_robin"]) as servers:
        yield servers


def replica_infos(url: str) -> list[dict]:
    return httpx.get(url + "/server_info", timeout=10).json()["internal_states"]


def test_rooms_on_both_prefill_replicas_match_a_single_server(cluster):
    mono, prefill, dec, _, bport = cluster
    want = post(mono.url, {"text": PROMPTS, "sampling_params": GREEDY}).json()
    body = {"text": PROMPTS, "sampling_params": GREEDY, "bootstrap_host": "127.0.0.1",
            "bootstrap_port": bport, "bootstrap_room": [100, 101, 102, 103]}
    got = both(prefill.url, dec.url, body)
    assert got.status_code == 200, got.text
    assert [g["output_ids"] for g in got.json()] == [w["output_ids"] for w in want]
    sent = [info["kv_transfer_sent_tokens"] for info in replica_infos(prefill.url)]
    received = [info["kv_transfer_received_tokens"] for info in replica_infos(dec.url)]
    assert all(s > 0 for s in sent), sent  # rooms 100, 102 on replica 0; 101, 103 on 1
    assert sum(received) == sum(sent) and all(r > 0 for r in received), received


def test_router_n_samples_and_stream(cluster):
    """Through the PD router (random rooms): n = 3 samples, whose rooms r, r+1, r+2 span
    both prefill replicas, and a stream; greedy samples all equal the single server's."""
    mono, prefill, dec, router, _ = cluster
    want = post(mono.url, {"text": PROMPTS[1], "sampling_params": GREEDY}).json()
    got = post(router, {"text": PROMPTS[1], "sampling_params": {**GREEDY, "n": 3}})
    assert [g["output_ids"] for g in got.json()] == [want["output_ids"]] * 3
    with httpx.stream("POST", router + "/generate", timeout=120,
                      json={"text": PROMPTS[2], "sampling_params": GREEDY,
                            "stream": True}) as r:
        chunks = [json.loads(line[5:]) for line in r.iter_lines()
                  if line.startswith("data: {")]
    want = post(mono.url, {"text": PROMPTS[2], "sampling_params": GREEDY}).json()
    assert len(chunks) > 1 and chunks[-1]["output_ids"] == want["output_ids"]
    assert chunks[-1]["text"] == want["text"]


def test_disagg_prefill_dp_rank_names_the_replica(cluster):
    """disagg_prefill_dp_rank 1 for even rooms: the prefill server places them on replica
    1 (not room mod 2) and the decode server claims them there; with routed_dp_rank 1 too
    (SGLang's router sends both), the same."""
    mono, prefill, dec, _, bport = cluster
    want = post(mono.url, {"text": PROMPTS[:2], "sampling_params": GREEDY}).json()
    for extra in ({}, {"routed_dp_rank": 1}):
        before = [i["kv_transfer_sent_tokens"] for i in replica_infos(prefill.url)]
        body = {"text": PROMPTS[:2], "sampling_params": GREEDY, "bootstrap_host": "127.0.0.1",
                "bootstrap_port": bport, "bootstrap_room": [300, 302],
                "disagg_prefill_dp_rank": 1, **extra}
        got = both(prefill.url, dec.url, body)
        assert got.status_code == 200, got.text
        assert [g["output_ids"] for g in got.json()] == [w["output_ids"] for w in want]
        after = [i["kv_transfer_sent_tokens"] for i in replica_infos(prefill.url)]
        assert after[0] == before[0] and after[1] > before[1], (before, after)


def test_bad_replica_fields_are_400_on_the_prefill_server(cluster):
    """routed_dp_rank that disagrees with where the decode server claims the room, and a
    disagg_prefill_dp_rank past --dp-size, are refused before anything waits."""
    _, prefill, _, _, bport = cluster
    pd = {"text": "hi", "bootstrap_host": "127.0.0.1", "bootstrap_port": bport,
          "bootstrap_room": 4}
    for bad, field in (({"routed_dp_rank": 1}, "routed_dp_rank"),
                       ({"routed_dp_rank": 0, "disagg_prefill_dp_rank": 1}, "routed_dp_rank"),
                       ({"disagg_prefill_dp_rank": 2}, "disagg_prefill_dp_rank"),
                       ({"disagg_prefill_dp_rank": -1}, "disagg_prefill_dp_rank")):
        r = post(prefill.url, {**pd, **bad})
        assert r.status_code == 400 and field in r.text, r.text
    r = post(prefill.url, {"text": "hi", "disagg_prefill_dp_rank": 0})
    assert r.status_code == 400 and "bootstrap_room" in r.text, r.text


def test_a_replica_the_prefill_lacks_fails_on_the_decode_server(cluster):
    """The decode server cannot know the prefill's --dp-size in advance: a
    disagg_prefill_dp_rank past it is a 503 naming the sizes once the route is known."""
    _, _, dec, _, bport = cluster
    r = post(dec.url, {"text": "hi", "bootstrap_host": "127.0.0.1", "bootstrap_port": bport,
                       "bootstrap_room": 9, "disagg_prefill_dp_rank": 3})
    assert r.status_code == 503 and "runs 2 replica(s)" in r.text, r.text


def test_both_servers_end_clean(cluster):
    _, prefill, dec, router, _ = cluster
    assert post(router, {"text": PROMPTS[3], "sampling_params": GREEDY}).status_code == 200
    for url in (prefill.url, dec.url):
        deadline = time.monotonic() + 30
        while True:
            infos = replica_infos(url)
            busy = [i for i in infos if i["num_running_reqs"] or i["used_tokens"]
                    or any(v for k, v in i.items() if k.endswith("_queue_reqs"))]
            if not busy or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        assert not busy, busy
        assert httpx.get(url + "/health").status_code == 200
