"""``Engine(dp_size=N)``: the replicas are scheduler processes of their own.

Each has its own pid (a child of the caller's process) and its share of the cores; greedy
outputs are token-identical to one in-process replica's; the whole API (batch, stream,
async, abort, flush, weights, info) works through the processes; a replica that dies
fails the engine's requests instead of hanging them; nothing outlives ``shutdown`` or the
caller's process.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from radixlm.runtime.config import ServerArgs
from radixlm.runtime.entrypoints.engine.engine_loop import EngineError
from radixlm.runtime.entrypoints.engine.engine_processes import (
    ReplicaProcesses,
    replica_process_args,
)
from radixlm.runtime.entrypoints.server_process import pid_alive

PROMPTS = ["The quick brown fox", "Data parallel replicas", "One two three four", "hello",
           "Once upon a time", "A cat sat", "In the beginning", "Numbers: 1 2 3"]
GREEDY = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def dp2(make_module_engine):
    return make_module_engine(dp_size=2, max_total_tokens=4096, cpu_threads=2)


def _parent_of(pid: int) -> int:
    stat = Path(f"/proc/{pid}/stat").read_text()
    return int(stat[stat.rindex(")") + 2:].split()[1])


def _wait_gone(pids: list[int], timeout: float = 30.0) -> list[int]:
    deadline = time.monotonic() + timeout  # a bound for a hang, not a speed check
    while (alive := [p for p in pids if pid_alive(p)]) and time.monotonic() < deadline:
        time.sleep(0.05)
    return alive


def test_replicas_are_processes_with_one_replicas_outputs(dp2, make_engine) -> None:
    assert isinstance(dp2.loop, ReplicaProcesses) and dp2.scheduler is None
    pids = dp2.loop.pids
    assert len(set(pids)) == 2 and os.getpid() not in pids
    assert all(pid_alive(p) and _parent_of(p) == os.getpid() for p in pids)
    # cpu_threads=2 over two replicas: one torch thread each
    assert [info["torch_threads"] for info in dp2.loop.model_infos] == [1, 1]
    one = make_engine(max_total_tokens=4096)
    assert one.scheduler is not None  # dp_size 1 stays in-process
    expected = [out["output_ids"] for out in one.generate(PROMPTS, GREEDY)]
    got = dp2.generate(PROMPTS, GREEDY)
    assert [out["output_ids"] for out in got] == expected
    assert [out["text"] for out in got] == [out["text"] for out in one.generate(PROMPTS, GREEDY)]
    states = dp2.get_server_info()["internal_states"]
    assert all(s["prompt_tokens"] > 0 for s in states), states  # both replicas served


def test_replica_sockets_are_private_ipc_only_for_this_uid(dp2) -> None:
    """The Engine's replica sockets live in a 0700 directory of its own (threat model:
    the same uid only); no TCP port is opened for them."""
    ipc_dir = Path(dp2.loop.children.ipc_dir)
    assert stat.S_IMODE(ipc_dir.stat().st_mode) == 0o700
    assert ipc_dir.stat().st_uid == os.getuid()
    names = {p.name for p in ipc_dir.iterdir()}
    assert {"engine", "scheduler-dp0", "scheduler-dp1"} <= names, names
    assert all(stat.S_ISSOCK(p.stat().st_mode) for p in ipc_dir.iterdir()
               if p.name in {"engine", "scheduler-dp0", "scheduler-dp1"})


def test_each_replica_gets_its_share_of_the_cores() -> None:
    cores = len(os.sched_getaffinity(0))
    assert replica_process_args(ServerArgs(dp_size=2)).resolve_cpu_threads() == max(
        cores // 2, 1)
    assert replica_process_args(ServerArgs(dp_size=2, cpu_threads=6)).resolve_cpu_threads() == 3
    assert replica_process_args(ServerArgs(dp_size=4, cpu_threads=2)).resolve_cpu_threads() == 1


def test_replicas_log_what_the_caller_would_see() -> None:
    logger = logging.getLogger("radixlm")
    old = logger.level
    try:
        logger.setLevel(logging.WARNING)  # a script that configured no logging
        assert replica_process_args(ServerArgs(dp_size=2)).log_level == "warning"
        logger.setLevel(logging.DEBUG)
        assert replica_process_args(ServerArgs(dp_size=2)).log_level == "info"
        assert replica_process_args(ServerArgs(dp_size=2, log_level="error")).log_level == "error"
    finally:
        logger.setLevel(old)


def test_stream_async_and_placement(dp2) -> None:
    whole = dp2.generate("Once upon a time", GREEDY)
    chunks = list(dp2.generate("Once upon a time", GREEDY, stream=True))
    assert "".join(c["text"] for c in chunks) == whole["text"]
    assert chunks[-1]["meta_info"]["finish_reason"]["type"] == "length"

    async def run() -> tuple[list[dict], list[dict]]:
        batch = await dp2.async_generate(PROMPTS[:3], GREEDY)
        stream = await dp2.async_generate("Once upon a time", GREEDY, stream=True)
        return batch, [c async for c in stream]

    batch, streamed = asyncio.run(run())
    assert [b["text"] for b in batch] == [o["text"] for o in dp2.generate(PROMPTS[:3], GREEDY)]
    assert "".join(c["text"] for c in streamed) == whole["text"]
    for rank in (0, 1):  # the client's placement
        before = [s["prompt_tokens"] for s in dp2.get_server_info()["internal_states"]]
        dp2.generate(input_ids=list(range(300, 311)), sampling_params={"max_new_tokens": 1},
                     routed_dp_rank=rank)
        after = [s["prompt_tokens"] for s in dp2.get_server_info()["internal_states"]]
        assert after[rank] - before[rank] == 11 and after[1 - rank] == before[1 - rank]


def test_abort_flush_and_weight_update(dp2, tiny_llama_dir) -> None:
    results: dict = {}

    def run() -> None:
        results["out"] = dp2.generate("Abort me", {"max_new_tokens": 2000, "ignore_eos": True},
                                      rid="dp-abort")

    t = threading.Thread(target=run)
    t.start()
    deadline = time.monotonic() + 60
    while dp2.get_server_info()["num_running_reqs"] == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    dp2.abort("dp-abort")
    t.join(timeout=60)
    assert results["out"]["meta_info"]["finish_reason"]["type"] == "abort"
    dp2.wait_idle()
    assert dp2.flush_cache()
    assert dp2.get_server_info()["cached_tokens"] >= 0
    ok, message, paused = dp2.update_weights_from_disk(tiny_llama_dir, weight_version="v2")
    assert ok and paused == 0, message
    out = dp2.generate(PROMPTS[:2], GREEDY)
    assert [o["meta_info"]["weight_version"] for o in out] == ["v2", "v2"]
    info = dp2.get_server_info()
    assert [s["weight_version"] for s in info["internal_states"]] == ["v2", "v2"]


def test_a_dead_replica_fails_the_engine(make_engine) -> None:
    eng = make_engine(dp_size=2, max_total_tokens=4096)
    pids = list(eng.loop.pids)
    eng.generate(PROMPTS[:2], GREEDY)
    os.kill(pids[1], signal.SIGKILL)
    with pytest.raises(EngineError, match=f"replica 1 \\(pid {pids[1]}\\) exited"):
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:  # until the receive thread has seen it
            eng.generate(PROMPTS[:2], GREEDY)
            time.sleep(0.05)
    assert not eng.is_alive
    eng.shutdown()
    assert _wait_gone(pids) == []


def test_shutdown_and_the_callers_death_end_the_replicas(tmp_path) -> None:
    script = tmp_path / "engine_child.py"
    script.write_text(
        "import sys, time\n"
        "from radixlm.runtime.entrypoints.engine.engine import Engine\n"
        "if __name__ == '__main__':\n"
        "    eng = Engine(dp_size=2, max_total_tokens=2048, cpu_threads=2, log_level='warning')\n"
        "    print(*eng.loop.pids, flush=True)\n"
        "    time.sleep(600)\n")
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    try:
        pids = [int(p) for p in proc.stdout.readline().split()]
        assert len(pids) == 2 and all(pid_alive(p) for p in pids)
    finally:
        proc.kill()  # SIGKILL: no cleanup runs in the caller
        proc.wait()
    assert _wait_gone(pids) == []
