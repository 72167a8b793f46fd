"""The server's port listens before the server starts (``entrypoints/listener.py``): no
other socket can take it while the model loads (not even with SO_REUSEADDR, as zmq binds),
a client that connects early is answered once the server is ready, and a port in use ends
the launch at once with a message naming it."""

from __future__ import annotations

import socket
import subprocess
import sys
import time

import httpx
import pytest

from radixlm.runtime.entrypoints.listener import bind_listener
from radixlm.runtime.entrypoints.server_process import free_port


def test_the_port_is_held_from_the_start():
    port = free_port()
    sock = bind_listener("127.0.0.1", port)
    try:
        other = socket.socket()
        other.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        with pytest.raises(OSError):
            other.bind(("127.0.0.1", port))
        other.close()
        with socket.socket() as client:  # queued until the server accepts
            client.connect(("127.0.0.1", port))
    finally:
        sock.close()


def test_an_early_client_is_answered_once_the_server_is_ready(tiny_llama_dir, tmp_path):
    port = free_port()
    log = open(tmp_path / "server.log", "w")  # noqa: SIM115 - closed below
    proc = subprocess.Popen(
        [sys.executable, "-m", "radixlm.launch_server", "--host", "127.0.0.1", "--port",
         str(port), "--model-path", str(tiny_llama_dir)], stdout=log, stderr=subprocess.STDOUT)
    try:
        for _ in range(600):  # the port listens long before the model is loaded
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=1):
                    break
            except OSError:
                time.sleep(0.05)
        else:
            raise AssertionError("the port never listened")
        log.flush()
        assert "ready: http" not in (tmp_path / "server.log").read_text()  # still loading
        resp = httpx.get(f"http://127.0.0.1:{port}/health", timeout=180)
        assert resp.status_code == 200
    finally:
        proc.terminate()
        proc.wait(60)
        log.close()


def test_a_port_in_use_ends_the_launch_at_once(tiny_llama_dir):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(SystemExit, match=f"cannot bind 127.0.0.1:{port}"):
            bind_listener("127.0.0.1", port)
        proc = subprocess.run(
            [sys.executable, "-m", "radixlm.launch_server", "--host", "127.0.0.1", "--port",
             str(port), "--model-path", str(tiny_llama_dir)],
            capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    assert f"cannot bind 127.0.0.1:{port} (--host / --port)" in proc.stderr
    assert "scheduler" not in proc.stderr  # nothing was started


def test_a_free_port_is_not_one_the_kernel_hands_out_by_itself():
    """Between ``free_port`` and the caller's bind, a socket bound to port 0 (zmq's random
    port) or a connect's local port comes from the ephemeral range; the chosen port lies
    outside it, so none of those can take it (a CI run lost a PD test's bootstrap port to
    one)."""
    from radixlm.runtime.entrypoints.server_process import _ephemeral_range

    low, high = _ephemeral_range()
    ports = {free_port() for _ in range(32)}
    assert all(not low <= p <= high and p >= 10_000 for p in ports), sorted(ports)
    assert len(ports) > 1  # chosen at random, not one fixed port
    with socket.socket() as s:  # and the kernel's own choice is inside it
        s.bind(("127.0.0.1", 0))
        assert low <= s.getsockname()[1] <= high
    for port in list(ports)[:4]:  # and each is bindable
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))
