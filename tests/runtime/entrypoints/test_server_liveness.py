"""Liveness and clean exits: a frozen scheduler is found by the watchdog (in-flight
clients get an error, /health says 503, the server exits 1 and leaves no process and no
ipc directory), and an ipc directory left by a SIGKILLed server is removed by the next."""

from __future__ import annotations

import os
import signal
import tempfile
import threading
import time
from pathlib import Path

import httpx
import pytest

from radixlm.runtime.entrypoints.server_process import ServerProcess, child_pids, pid_alive


def _ipc_dirs(pid: int) -> list[Path]:
    return list(Path(tempfile.gettempdir()).glob(f"radixlm-{pid}-*"))


@pytest.fixture
def stale_ipc_dir():
    """An ipc directory whose owner is gone (pid 2**22 + 1 is above Linux's pid_max)."""
    path = Path(tempfile.mkdtemp(prefix=f"radixlm-{(1 << 22) + 1}-"))
    yield path
    if path.exists():
        path.rmdir()


def test_frozen_scheduler_is_detected_and_the_server_exits(tmp_path, stale_ipc_dir):
    srv = ServerProcess(["--max-total-tokens", "4096", "--watchdog-timeout", "2",
                         "--log-level", "warning"], tmp_path / "server.log")
    try:
        srv.wait_healthy()
        assert not stale_ipc_dir.exists()  # removed by the new server at startup
        assert len(_ipc_dirs(srv.proc.pid)) == 1
        kids = child_pids(srv.proc.pid)
        sched = httpx.get(srv.url + "/get_server_info").json()["pids"]["scheduler"]
        result: dict = {}
        body = {"text": "x", "sampling_params": {"max_new_tokens": 1500, "ignore_eos": True}}

        def client() -> None:
            result["resp"] = httpx.post(srv.url + "/generate", json=body, timeout=120)

        t = threading.Thread(target=client)
        t.start()
        os.kill(sched, signal.SIGSTOP)  # the scheduler stops, in the middle of the request
        code = srv.wait(timeout=120)
        t.join(120)
    finally:
        if srv.proc.poll() is None:
            srv.proc.kill()
            srv.wait()
    log = srv.log()
    assert code == 1, log
    assert "made no progress" in log
    resp = result["resp"]
    assert resp.status_code == 503, resp.text
    assert "made no progress" in resp.json()["error"]["message"]
    # multiprocessing's resource tracker leaves once it sees its parent gone: give the
    # descendants a moment (a bound for a hang, not a speed check)
    deadline = time.monotonic() + 10
    while [p for p in kids if pid_alive(p)] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not [p for p in kids if pid_alive(p)]
    assert not _ipc_dirs(srv.proc.pid)
