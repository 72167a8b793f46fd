"""PD servers with --tp-size 2: pages travel with every KV head (rank 0 gathers the
prefill's shards, and scatters them over the decode's ranks), so a tp-2 prefill server
pairs with a tp-1 or a tp-2 decode server and both give a single server's tokens."""

from __future__ import annotations

import time

import httpx
import pytest
import torch

from radixlm.runtime.entrypoints.server_process import ServerProcess, free_port
from radixlm.runtime.executor.tp_worker import whole_heads
from tests.runtime.disaggregation.pd_client import both, post, secret_flags

FLAGS = ["--max-total-tokens", "4096", "--log-level", "warning", "--page-size", "4",
         "--chunked-prefill-size", "64", "--cpu-threads", "1", "--dtype", "float32"]
GREEDY = {"max_new_tokens": 10, "temperature": 0.0, "ignore_eos": True}
LONG = " ".join(f"word{i % 37}" for i in range(180))


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    d = tmp_path_factory.mktemp("pd-tp")
    bport = free_port()
    pd = ["--disaggregation-bootstrap-port", str(bport), "--disaggregation-bootstrap-timeout",
          "10", "--disaggregation-waiting-timeout", "20", *secret_flags(d)]
    procs = {"mono": ServerProcess(FLAGS, d / "mono.log"),
             "prefill": ServerProcess(FLAGS + pd + ["--tp-size", "2", "--disaggregation-mode",
                                                    "prefill"], d / "p.log"),
             "decode1": ServerProcess(FLAGS + pd + ["--disaggregation-mode", "decode"],
                                      d / "d1.log"),
             "decode2": ServerProcess(FLAGS + pd + ["--tp-size", "2", "--disaggregation-mode",
                                                    "decode"], d / "d2.log")}
    try:
        for p in procs.values():
            p.wait_healthy()
        yield procs, bport
    finally:
        for p in procs.values():
            p.stop()


@pytest.mark.parametrize("decode", ["decode1", "decode2"])
def test_tp2_prefill_matches_a_single_server(servers, decode):
    procs, bport = servers
    texts = ["The capital of France is", LONG]
    want = post(procs["mono"].url, {"text": texts, "sampling_params": GREEDY}).json()
    room = 500 if decode == "decode1" else 600
    got = both(procs["prefill"].url, procs[decode].url, {
        "text": texts, "sampling_params": GREEDY, "bootstrap_host": "127.0.0.1",
        "bootstrap_port": bport, "bootstrap_room": [room, room + 1]})
    assert got.status_code == 200, got.text
    assert [g["output_ids"] for g in got.json()] == [w["output_ids"] for w in want]
    info = httpx.get(procs[decode].url + "/server_info").json()
    assert info["kv_transfer_received_tokens"] > 0
    for name in ("prefill", decode):
        deadline = time.monotonic() + 30
        while (info := httpx.get(procs[name].url + "/server_info").json())["used_tokens"] \
                and time.monotonic() < deadline:
            time.sleep(0.1)
        assert info["used_tokens"] == 0 and info["num_running_reqs"] == 0, info


def test_whole_heads_take_each_head_once():
    """Rank r's shard holds heads starts[r] ..; ranks that replicate a head (fewer KV heads
    than ranks) give it once."""
    parts = [torch.full((2, 3, 1, 4), r, dtype=torch.uint8) for r in range(4)]
    assert whole_heads(parts, [0, 0, 1, 1], 1)[0, 0, :, 0].tolist() == [0, 2]
    assert whole_heads(parts, [0, 1, 2, 3], 1)[0, 0, :, 0].tolist() == [0, 1, 2, 3]
    pairs = [torch.full((2, 3, 2, 4), r, dtype=torch.uint8) for r in range(2)]
    assert whole_heads(pairs, [0, 2], 2)[0, 0, :, 0].tolist() == [0, 0, 1, 1]
