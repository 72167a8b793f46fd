"""SGLang's router in PD mode (``--pd-disaggregation``) in front of one radixlm prefill and
one radixlm decode server: it fills in the bootstrap fields and sends each request to both;
native and OpenAI requests give what a single radixlm server gives."""

from __future__ import annotations

import subprocess
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from radixlm.runtime.entrypoints.server_process import ServerProcess, free_port
from tests.compat.test_sglang_router import router_python
from tests.runtime.disaggregation.pd_client import secret_flags

FLAGS = ["--max-total-tokens", "4096", "--log-level", "warning", "--page-size", "4",
         "--cpu-threads", "1"]
GREEDY = {"max_new_tokens": 8, "temperature": 0}


@pytest.fixture(scope="module", params=[1, 2], ids=["dp1", "dp2"])
def pd(tmp_path_factory, request):
    """--dp-size 2: both PD servers run two replicas (the prefill's share one bootstrap
    port; the router knows nothing of them)."""
    d = tmp_path_factory.mktemp("router-pd")
    bport = free_port()
    mode = ["--dp-size", str(request.param), "--disaggregation-bootstrap-port", str(bport),
            *secret_flags(d), "--disaggregation-mode"]
    servers = [ServerProcess(FLAGS, d / "mono.log"),
               ServerProcess(FLAGS + mode + ["prefill"], d / "prefill.log"),
               ServerProcess(FLAGS + mode + ["decode"], d / "decode.log")]
    proc = None
    log = open(d / "router.log", "w")
    try:
        for s in servers:
            s.wait_healthy()
        port = free_port()
        proc = subprocess.Popen([str(router_python()), "-m", "sglang_router.launch_router",
                                 "--host", "127.0.0.1", "--port", str(port),
                                 "--prometheus-host", "127.0.0.1",
                                 "--prometheus-port", str(free_port()),
                                 "--pd-disaggregation", "--prefill", servers[1].url, str(bport),
                                 "--decode", servers[2].url], stdout=log,
                                stderr=subprocess.STDOUT)
        url = f"http://127.0.0.1:{port}"
        _wait(url, proc)
        yield servers, url
    finally:
        if proc is not None:
            proc.terminate()
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        log.close()
        for s in servers:
            s.stop()


def _wait(url: str, proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        assert proc.poll() is None, "the router exited"
        try:
            r = httpx.post(url + "/generate", timeout=60,
                           json={"text": "warm", "sampling_params": {"max_new_tokens": 1}})
            if r.status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise AssertionError("the router never served a request")


def test_native_generate_through_pd_router(pd):
    (mono, prefill, dec), router = pd
    body = {"text": "The capital of France is", "sampling_params": GREEDY}
    got = httpx.post(router + "/generate", json=body, timeout=120)
    assert got.status_code == 200, got.text
    want = httpx.post(mono.url + "/generate", json=body, timeout=120).json()
    assert got.json()["output_ids"] == want["output_ids"]
    # it went through both servers: each moved the prompt's KV
    assert httpx.get(prefill.url + "/server_info").json()["kv_transfer_sent_tokens"] > 0
    assert httpx.get(dec.url + "/server_info").json()["kv_transfer_received_tokens"] > 0


def test_openai_chat_through_pd_router(pd):
    (mono, _, _), router = pd
    model = httpx.get(mono.url + "/v1/models").json()["data"][0]["id"]
    body = {"model": model, "messages": [{"role": "user", "content": "Say something."}],
            "max_tokens": 6, "temperature": 0}
    got = httpx.post(router + "/v1/chat/completions", json=body, timeout=120)
    assert got.status_code == 200, got.text
    want = httpx.post(mono.url + "/v1/chat/completions", json=body, timeout=120).json()
    assert got.json()["choices"][0]["message"] == want["choices"][0]["message"]
    assert got.json()["usage"]["completion_tokens"] == 6


def test_concurrent_requests_through_pd_router(pd):
    """Each request gets its own room from the router (with --dp-size 2, the rooms land on
    both prefill replicas); every answer equals a single server's. (The router's PD mode
    takes no batch: a list ``text`` is its 422.)"""
    (mono, _, _), router = pd
    prompts = [f"Item {i}: the {'very ' * i}long road" for i in range(6)]
    with ThreadPoolExecutor(len(prompts)) as pool:
        got = list(pool.map(lambda p: httpx.post(router + "/generate", timeout=120, json={
            "text": p, "sampling_params": GREEDY}), prompts))
    assert all(g.status_code == 200 for g in got), [g.text for g in got]
    want = httpx.post(mono.url + "/generate", timeout=120,
                      json={"text": prompts, "sampling_params": GREEDY}).json()
    assert [g.json()["output_ids"] for g in got] == [w["output_ids"] for w in want]
