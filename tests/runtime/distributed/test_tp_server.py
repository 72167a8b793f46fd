"""``radixlm serve --tp-size 2``: the same greedy tokens as one rank; a rank that dies (or
hangs past ``--dist-timeout``) ends the server with an error naming it, and no process
of it is left behind."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from radixlm.runtime.entrypoints.server_process import (
    ServerProcess,
    child_pids,
    free_port,
    pid_alive,
)

PROMPTS = ["Once upon a time", "The capital of France is", "one two three four five"]
# bounds for a server to notice a rank's end: the scheduler's watch polls every 0.2 s and
# the server's every 0.2 s (dead rank), or --dist-timeout (hung rank), plus exit time
DEAD_BOUND_S = 30.0


def _follower_pids(server: ServerProcess) -> list[int]:
    out = []
    for pid in child_pids(server.proc.pid):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if b"tp_ranks import main" in cmdline:
            out.append(pid)
    return out


def _assert_all_gone(pids: list[int], bound_s: float = 10.0) -> None:
    """Children killed by their parent's death signal go within moments of it."""
    deadline = time.monotonic() + bound_s
    while any(pid_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(pid_alive(p) for p in pids), [p for p in pids if pid_alive(p)]


def _generate(url: str) -> list[list[int]]:
    body = {"text": PROMPTS, "sampling_params": {"max_new_tokens": 12, "temperature": 0}}
    r = httpx.post(url + "/generate", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return [o["output_ids"] for o in r.json()]


@pytest.fixture
def start_server(make_server, tiny_llama_dir):
    def start(*flags: str) -> ServerProcess:
        return make_server(["--model-path", str(tiny_llama_dir), "--dtype", "float32",
                            "--cpu-threads", "1", *flags], "tp_server")

    return start


def test_tp2_server_matches_one_rank(start_server, make_engine, tiny_llama_dir):
    server = start_server("--tp-size", "2")
    assert len(_follower_pids(server)) == 1
    got = _generate(server.url)
    eng = make_engine(model_path=str(tiny_llama_dir), dtype="float32")
    expected = [o["output_ids"] for o in eng.generate(
        PROMPTS, {"max_new_tokens": 12, "temperature": 0})]
    assert got == expected
    family = [server.proc.pid, *child_pids(server.proc.pid)]
    assert server.stop() == 0
    _assert_all_gone(family)


@pytest.mark.parametrize("how", ["killed", "hung"])
def test_a_lost_rank_ends_the_server(start_server, how):
    server = start_server("--tp-size", "2", "--dist-timeout", "5")
    _generate(server.url)
    family = [server.proc.pid, *child_pids(server.proc.pid)]
    (rank,) = _follower_pids(server)
    if how == "killed":
        os.kill(rank, signal.SIGKILL)
    else:  # stopped: alive but never answers; the next forward's collective times out
        os.kill(rank, signal.SIGSTOP)
        try:
            r = httpx.post(server.url + "/generate", timeout=DEAD_BOUND_S,
                           json={"text": "Hello", "sampling_params": {"max_new_tokens": 4}})
            assert r.status_code != 200, r.text
        except httpx.HTTPError:
            pass  # the server went away under the request
    try:
        code = server.wait(DEAD_BOUND_S)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the server outlived its {how} rank:\n{server.log()}")
    assert code != 0
    log = server.log()
    if how == "killed":
        assert "tensor-parallel rank 1" in log and "exited with code -9" in log, log
    else:
        assert "did not answer within --dist-timeout (5 s)" in log, log
    _assert_all_gone(family)


def test_dp2_tp2_server_runs_four_ranks(start_server, make_engine, tiny_llama_dir):
    """Each data-parallel replica's scheduler leads its own tensor-parallel group."""
    server = start_server("--dp-size", "2", "--tp-size", "2", "--load-balance-method",
                          "round_robin")
    assert len(_follower_pids(server)) == 2
    eng = make_engine(model_path=str(tiny_llama_dir), dtype="float32")
    expected = [o["output_ids"] for o in eng.generate(
        PROMPTS, {"max_new_tokens": 12, "temperature": 0})]
    for _ in range(2):  # round robin: both replicas serve
        assert _generate(server.url) == expected


@pytest.mark.parametrize("dp", [1, 2])
def test_two_nodes_on_loopback(start_server, make_engine, tiny_llama_dir, tmp_path, dp):
    """--nnodes 2: node 1 (``radixlm serve --node-rank 1``) runs only rank 1 of each
    replica, node 0 serves; with --dp-size 2 replica r meets at the address's port + r.
    Stopping node 0 ends node 1 cleanly."""
    addr = f"127.0.0.1:{free_port()}"
    flags = ["--tp-size", "2", "--nnodes", "2", "--dist-init-addr", addr, "--dp-size", str(dp),
             "--load-balance-method", "round_robin"]
    common = ["--model-path", str(tiny_llama_dir), "--dtype", "float32", "--cpu-threads", "1",
              *flags]
    with open(tmp_path / "node1.log", "w") as log:
        node1 = subprocess.Popen([sys.executable, "-m", "radixlm.launch_server", *common,
                                  "--node-rank", "1"], stdout=log, stderr=subprocess.STDOUT)
    try:
        server = start_server(*flags, "--node-rank", "0")
        assert _follower_pids(server) == []  # rank 1 of each replica is node 1's
        eng = make_engine(model_path=str(tiny_llama_dir), dtype="float32")
        expected = [o["output_ids"] for o in eng.generate(
            PROMPTS, {"max_new_tokens": 12, "temperature": 0})]
        for _ in range(dp):  # round robin: every replica serves
            assert _generate(server.url) == expected
        assert server.stop() == 0
        assert node1.wait(DEAD_BOUND_S) == 0, (tmp_path / "node1.log").read_text()
        if dp > 1:
            text = (tmp_path / "node1.log").read_text()
            port = int(addr.rsplit(":", 1)[1])
            assert f"meeting at 127.0.0.1:{port + 1}" in text, text
    finally:
        if node1.poll() is None:
            node1.kill()
            node1.wait()
