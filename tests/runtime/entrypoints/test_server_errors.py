"""Server limits and lifecycle: API keys (401), --max-queued-requests (503), graceful
SIGTERM (503 for new requests, running ones finish, exit code 0) and a crashed child
(the server exits non-zero, no process left)."""

from __future__ import annotations

import os
import signal
import threading
import time

import httpx
import openai
import pytest

from radixlm.runtime.entrypoints.server_process import ServerProcess, child_pids, pid_alive

KEY = "sk-test-123"
AUTH = {"Authorization": f"Bearer {KEY}"}
FLAGS = [
    "--max-total-tokens",
    "8192",
    "--log-level",
    "warning",
    "--api-key",
    KEY,
    "--max-running-requests",
    "1",
    "--max-queued-requests",
    "1",
    "--shutdown-timeout",
    "30",
]
LONG = {"text": "a long one", "sampling_params": {"max_new_tokens": 600, "ignore_eos": True}}


@pytest.fixture(scope="module")
def server(module_server) -> ServerProcess:
    return module_server(FLAGS)


def _wait_running(srv: ServerProcess, n: int) -> None:
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        info = httpx.get(srv.url + "/get_server_info", headers=AUTH).json()
        if info["num_inflight_requests"] >= n:
            return
        time.sleep(0.02)
    raise AssertionError("requests did not start")


def _in_thread(fn, *args) -> tuple[threading.Thread, dict]:
    out: dict = {}
    t = threading.Thread(target=lambda: out.setdefault("r", fn(*args)))
    t.start()
    return t, out


def _generate(srv: ServerProcess, body: dict) -> httpx.Response:
    return httpx.post(srv.url + "/generate", json=body, headers=AUTH, timeout=120)


def test_api_key(server):
    assert httpx.get(server.url + "/health").status_code == 200
    # /metrics takes the admin's key: here the one --api-key key (no --admin-api-key)
    assert httpx.get(server.url + "/metrics").status_code == 401
    assert httpx.get(server.url + "/metrics", headers=AUTH).status_code == 200
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        resp = httpx.get(server.url + "/v1/models", headers=headers)
        assert resp.status_code == 401
        assert resp.json()["error"]["code"] == "invalid_api_key"
    assert httpx.post(server.url + "/generate", json={"text": "x"}).status_code == 401
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.url + "/v1", api_key="bad").models.list()
    good = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY)
    out = good.completions.create(
        model="default", prompt="hi", max_tokens=3, extra_body={"ignore_eos": True}
    )
    assert out.usage.completion_tokens == 3


def test_queue_limit_503(server):
    """1 running + 1 queued fill the server; the third request gets 503."""
    threads = [_in_thread(_generate, server, {**LONG, "rid": f"long-{i}"}) for i in range(2)]
    _wait_running(server, 2)
    resp = _generate(server, {"text": "one too many"})
    assert resp.status_code == 503, resp.text
    assert "max-queued-requests" in resp.json()["error"]["message"]
    httpx.post(server.url + "/abort_request", json={"abort_all": True}, headers=AUTH)
    for t, out in threads:
        t.join(60)
        assert out["r"].json()["meta_info"]["finish_reason"]["type"] == "abort"
    assert _generate(server, {"text": "room again"}).status_code == 200


def test_sigterm_drains_then_exits_zero(server):
    pids = child_pids(server.proc.pid)
    t, out = _in_thread(
        _generate, server, {**LONG, "sampling_params": {"max_new_tokens": 300, "ignore_eos": True}}
    )
    _wait_running(server, 1)
    server.signal(signal.SIGTERM)
    time.sleep(0.2)
    late = _generate(server, {"text": "too late"})
    assert late.status_code == 503 and "shutting down" in late.json()["error"]["message"]
    assert httpx.get(server.url + "/health").status_code == 503
    t.join(60)
    assert out["r"].json()["meta_info"]["completion_tokens"] == 300
    assert server.wait(60) == 0, server.log()
    time.sleep(0.2)
    assert [p for p in pids if pid_alive(p)] == []


def test_child_crash_takes_server_down(tmp_path):
    srv = ServerProcess(
        ["--max-total-tokens", "4096", "--log-level", "warning"], tmp_path / "crash.log"
    )
    try:
        srv.wait_healthy()
        info = httpx.get(srv.url + "/get_server_info").json()
        pids = child_pids(srv.proc.pid)
        os.kill(info["pids"]["scheduler"], signal.SIGKILL)
        assert srv.wait(30) != 0
        time.sleep(0.3)
        assert [p for p in pids if pid_alive(p)] == [], srv.log()
        assert "scheduler process exited" in srv.log()
    finally:
        srv.stop()
