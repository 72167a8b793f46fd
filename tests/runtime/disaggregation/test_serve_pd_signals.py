"""``radixlm serve-pd`` under SIGTERM, what supervisors send: it stops its prefill and
decode servers (and theirs) as on SIGINT and exits 0, both while the router serves and
while it still waits for the servers; no child is left answering."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from radixlm.runtime.entrypoints.server_process import child_pids, free_port, pid_alive

FLAGS = ["--max-total-tokens", "2048", "--log-level", "warning", "--cpu-threads", "1"]
STOP_S = 150  # two servers draining (60 s each at most) and the launcher's own exit


def _until(done: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not done():
        if time.monotonic() > deadline:
            raise TimeoutError(what)
        time.sleep(0.2)


def _answers(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(1.0)
        return s.connect_ex(("127.0.0.1", port)) == 0


def _healthy(url: str) -> bool:
    try:
        return httpx.get(url + "/health", timeout=2.0).status_code == 200
    except httpx.HTTPError:
        return False


@pytest.fixture
def serve_pd(tmp_path: Path, tiny_llama_dir: Path):
    """Start ``radixlm serve-pd`` on free ports; yields (process, ports, log); whatever it
    left behind (the pids seen under it) is killed afterwards."""
    ports = {name: free_port() for name in ("router", "prefill", "decode", "bootstrap")}
    log = open(tmp_path / "serve-pd.log", "w")  # noqa: SIM115 - closed below
    proc = subprocess.Popen(
        [sys.executable, "-m", "radixlm.cli", "serve-pd", "--port", str(ports["router"]),
         "--prefill-port", str(ports["prefill"]), "--decode-port", str(ports["decode"]),
         "--disaggregation-bootstrap-port", str(ports["bootstrap"]), "--",
         "--model-path", str(tiny_llama_dir), *FLAGS],
        stdout=log, stderr=subprocess.STDOUT)
    seen: set[int] = set()
    try:
        yield proc, ports, seen, tmp_path / "serve-pd.log"
    finally:
        for pid in [proc.pid, *seen, *child_pids(proc.pid)]:
            if pid_alive(pid):
                os.kill(pid, signal.SIGKILL)
        proc.wait(30)
        log.close()


def _term_and_check(proc: subprocess.Popen, ports: dict[str, int], seen: set[int],
                    log: Path) -> None:
    seen.update(child_pids(proc.pid))
    proc.send_signal(signal.SIGTERM)
    try:
        code = proc.wait(STOP_S)
    except subprocess.TimeoutExpired:
        pytest.fail(f"serve-pd still running {STOP_S} s after SIGTERM:\n{log.read_text()}")
    _until(lambda: not any(pid_alive(p) for p in seen), 30,
           f"serve-pd exited ({code}) leaving children running: "
           f"{[p for p in seen if pid_alive(p)]}")
    assert not any(_answers(port) for port in ports.values()), ports
    assert code == 0, log.read_text()


def test_sigterm_stops_every_child_while_serving(serve_pd):
    proc, ports, seen, log = serve_pd
    router = f"http://127.0.0.1:{ports['router']}"
    _until(lambda: proc.poll() is not None or _healthy(router), 300, "router not healthy")
    assert proc.poll() is None, log.read_text()
    assert all(_healthy(f"http://127.0.0.1:{ports[s]}") for s in ("prefill", "decode"))
    assert len(child_pids(proc.pid)) >= 4  # both servers, each with its scheduler etc.
    _term_and_check(proc, ports, seen, log)


def test_sigterm_during_startup_stops_the_servers(serve_pd):
    """TERM while serve-pd waits for the servers to become healthy (they are importing)."""
    proc, ports, seen, log = serve_pd
    _until(lambda: len(child_pids(proc.pid)) >= 2, 60, "the servers never started")
    assert not _healthy(f"http://127.0.0.1:{ports['router']}")
    _term_and_check(proc, ports, seen, log)
