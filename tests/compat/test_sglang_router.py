"""SGLang's router (the ``sglang-router`` package, its own Rust binary) in front of two
radixlm workers: it registers them (``/server_info``, ``/model_info``), routes a native
``/generate`` and an OpenAI chat request, and reads their load from ``/get_load``.

The router is installed once per machine in its own virtual environment under
``~/.cache/radixlm`` (``router_python``); nothing of it is imported here.
"""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from radixlm.runtime.entrypoints.server_process import ServerProcess, free_port

ROUTER_VERSION = os.environ.get("RADIXLM_SGLANG_ROUTER_VERSION", "0.3.2")
CACHE = Path(os.environ.get("RADIXLM_CACHE_DIR", Path.home() / ".cache" / "radixlm"))
FLAGS = ["--max-total-tokens", "4096", "--log-level", "warning"]


def router_python() -> Path:
    """The Python of a virtual environment with sglang-router installed (built once)."""
    venv = CACHE / f"sglang-router-{ROUTER_VERSION}-venv"
    python, done = venv / "bin" / "python", venv / ".installed"
    CACHE.mkdir(parents=True, exist_ok=True)
    with open(CACHE / f"sglang-router-{ROUTER_VERSION}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one build per machine, even with parallel tests
        if not done.exists():
            subprocess.run([sys.executable, "-m", "venv", "--clear", str(venv)], check=True)
            subprocess.run([str(python), "-m", "pip", "install", "-q",
                            f"sglang-router=={ROUTER_VERSION}"], check=True)
            done.touch()
    return python


# --- /get_load: the shape the router parses, checked on one server ---------------------------
@pytest.fixture(scope="module")
def workers(tmp_path_factory):
    d = tmp_path_factory.mktemp("router")
    servers = [ServerProcess(FLAGS, d / f"worker{i}.log") for i in range(2)]
    try:
        for srv in servers:
            srv.wait_healthy()
        yield servers
    finally:
        for srv in servers:
            srv.stop()


def test_get_load_shape(workers):
    load = httpx.get(workers[0].url + "/get_load").json()
    assert isinstance(load, list) and len(load) == 1
    entry = load[0]
    assert set(entry) == {"dp_rank", "num_reqs", "num_waiting_reqs", "num_tokens",
                          "num_pending_tokens", "ts_tic"}
    assert entry["dp_rank"] == 0 and entry["num_reqs"] == 0 and entry["num_tokens"] == 0
    v1 = httpx.get(workers[0].url + "/v1/loads").json()
    assert set(v1) == {"timestamp", "version", "accelerator", "num_accelerators", "loads"}
    core = v1["loads"][0]
    assert core["num_running_reqs"] == 0 and core["max_total_num_tokens"] == 4096
    assert core["num_used_tokens"] == 0 and core["dp_rank"] == 0
    text = httpx.get(workers[0].url + "/v1/loads", params={"format": "prometheus"}).text
    assert 'sglang_max_total_num_tokens{dp_rank="0"} 4096' in text
    for query in ({"include": "nonsense"}, {"dp_rank": "1"}, {"format": "xml"}):
        assert httpx.get(workers[0].url + "/v1/loads", params=query).status_code == 400


def test_get_load_counts_a_running_request(workers):
    """While a long request decodes, /get_load reports it and its KV tokens."""
    url = workers[1].url
    body = {"text": "count " * 40, "sampling_params": {"max_new_tokens": 400,
                                                       "ignore_eos": True}}
    with httpx.Client(timeout=120) as client:
        with client.stream("POST", url + "/generate", json={**body, "stream": True}) as resp:
            lines = resp.iter_lines()
            next(line for line in lines if line.startswith("data:"))  # it is running
            entry = client.get(url + "/get_load").json()[0]
            assert entry["num_reqs"] == 1 and entry["num_waiting_reqs"] == 0
            assert entry["num_tokens"] >= 40
            for _ in lines:
                pass
    assert httpx.get(url + "/get_load").json()[0]["num_reqs"] == 0


# --- the real router ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def router(workers, tmp_path_factory):
    python = router_python()
    port = free_port()
    log = open(tmp_path_factory.mktemp("router-log") / "router.log", "w")
    cmd = [str(python), "-m", "sglang_router.launch_router", "--host", "127.0.0.1",
           "--port", str(port), "--policy", "power_of_two",
           # its metrics exporter on a free port too (default 29000: two routers collide)
           "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()),
           "--worker-urls", *[w.url for w in workers]]
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_router(url, proc, len(workers))
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


def _wait_router(url: str, proc: subprocess.Popen, n_workers: int) -> None:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        assert proc.poll() is None, "the router exited"
        try:
            loads = httpx.get(url + "/get_loads", timeout=5).json()
            if len(loads.get("workers", [])) == n_workers:
                return
        except (httpx.HTTPError, ValueError):
            pass
        time.sleep(0.5)
    raise AssertionError("the router did not register the workers")


def test_router_routes_native_and_openai(router, workers):
    native = httpx.post(router + "/generate", timeout=120, json={
        "text": "The capital of France is",
        "sampling_params": {"max_new_tokens": 8, "temperature": 0}})
    assert native.status_code == 200, native.text
    out = native.json()
    assert out["meta_info"]["completion_tokens"] == 8 and isinstance(out["text"], str)
    direct = httpx.post(workers[0].url + "/generate", timeout=120, json={
        "text": "The capital of France is",
        "sampling_params": {"max_new_tokens": 8, "temperature": 0}}).json()
    assert out["text"] == direct["text"]  # same model behind the router: same greedy text

    model = httpx.get(workers[0].url + "/v1/models").json()["data"][0]["id"]
    chat = httpx.post(router + "/v1/chat/completions", timeout=120, json={
        "model": model, "messages": [{"role": "user", "content": "Say something."}],
        "max_tokens": 6, "temperature": 0})
    assert chat.status_code == 200, chat.text
    body = chat.json()
    assert body["object"] == "chat.completion" and body["usage"]["completion_tokens"] == 6
    # no model named: the router fills in "unknown", which the worker takes as no name
    chat = httpx.post(router + "/v1/chat/completions", timeout=120, json={
        "messages": [{"role": "user", "content": "Hi."}], "max_tokens": 4, "temperature": 0})
    assert chat.status_code == 200, chat.text
    assert chat.json()["usage"]["completion_tokens"] == 4


def test_router_reads_worker_loads(router, workers):
    """The router's view of each worker's load is the ``num_tokens`` of its /get_load:
    the busy worker shows its running request's tokens, the idle one none."""
    loads = httpx.get(router + "/get_loads", timeout=30).json()["workers"]
    assert sorted(w["worker"] for w in loads) == sorted(w.url for w in workers)
    busy, idle = workers[1].url, workers[0].url
    body = {"text": "count " * 40, "stream": True,
            "sampling_params": {"max_new_tokens": 1000, "ignore_eos": True}}
    with httpx.Client(timeout=120) as client:
        with client.stream("POST", busy + "/generate", json=body) as resp:
            lines = resp.iter_lines()
            next(line for line in lines if line.startswith("data:"))
            seen = {w["worker"]: w["load"]
                    for w in client.get(router + "/get_loads").json()["workers"]}
            for _ in lines:
                pass
    assert seen[idle] == 0 and seen[busy] >= 40
