"""A hostile client against `radixlm serve`: every defect found by the first campaign as a
regression test (each a 4xx, never a 5xx or a dead server), bounded bodies, slow bodies,
the secrets and the auth scheme, the OpenAPI document, and, at the end, the server's
state: alive, nothing in flight, every KV slot free or evictable, no traceback logged."""

from __future__ import annotations

import json
import socket
import time
from pathlib import Path

import httpx
import pytest

from radixlm.runtime.entrypoints.server_process import ServerProcess

KEY = "sk-hostile-1"
AUTH = {"Authorization": f"Bearer {KEY}"}
POOL = 1024
LIMIT_BYTES = 1 << 20
FLAGS = ["--max-total-tokens", str(POOL), "--context-length", "2048", "--api-key", KEY,
         "--max-n", "4", "--max-request-bytes", str(LIMIT_BYTES), "--request-read-timeout", "2",
         "--grammar-compile-timeout", "2", "--log-level", "warning"]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = ServerProcess(FLAGS, tmp_path_factory.mktemp("hostile") / "server.log")
    srv.wait_healthy()
    yield srv
    code = srv.stop()
    log = srv.log()
    assert code == 0, log
    assert "still running" not in log  # SIGTERM found nothing in flight: no ghost request


def post(srv: ServerProcess, path: str, body: object = None, *, raw: bytes | None = None,
         headers: dict | None = None) -> httpx.Response:
    content = raw if raw is not None else json.dumps(body).encode()
    return httpx.post(srv.url + path, content=content, timeout=60,
                      headers={"Content-Type": "application/json", **AUTH, **(headers or {})})


def info(srv: ServerProcess) -> dict:
    return httpx.get(srv.url + "/get_server_info", headers=AUTH, timeout=30).json()


def error_of(resp: httpx.Response, status: int) -> dict:
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    return err


def assert_idle_and_whole(srv: ServerProcess, timeout: float = 20.0) -> dict:
    """Nothing running or queued, nothing in flight, every KV slot free or evictable."""
    deadline = time.monotonic() + timeout
    while True:
        now = info(srv)
        idle = (now["num_running_reqs"] == 0 and now["num_waiting_reqs"] == 0
                and now["num_inflight_requests"] == 0)
        if idle or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert idle, now
    assert now["protected_tokens"] == 0, now
    assert now["free_tokens"] + now["evictable_tokens"] == now["max_total_num_tokens"], now
    assert httpx.get(srv.url + "/health").status_code == 200
    return now


CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
GEN = {"text": "hello", "sampling_params": {"max_new_tokens": 2}}

# (route, body, words the 400's message must hold): each once killed the server or got 500
DEFECTS = [
    ("/generate", {"text": "x", "sampling_params": {"seed": "abc", "temperature": 1}},
     ["seed", "integer"]),
    ("/generate", {"text": "x", "sampling_params": {"stop": [1]}}, ["stop", "string"]),
    ("/generate", {"text": "x", "sampling_params": {"stop": [None]}}, ["stop", "string"]),
    ("/generate", {"input_ids": [None]}, ["input_ids", "integer"]),
    ("/generate", {"input_ids": [True, False]}, ["input_ids", "integer"]),
    ("/generate", {"text": "x", "top_logprobs_num": True}, ["top_logprobs_num", "integer"]),
    ("/generate", {"text": "x", "sampling_params": {"logit_bias": []}}, ["logit_bias"]),
    ("/generate", {"text": "x", "sampling_params": {"seed": 2**70}}, ["seed", "less than"]),
    ("/generate", {"input_ids": [2**65]}, ["input_ids", "less than"]),
    ("/generate", {"input_ids": [1999999]}, ["vocabulary"]),
    ("/generate", {"text": "x", "sampling_params": {"n": 5}}, ["n", "limit of 4", "--max-n"]),
    ("/generate", {"text": "x", "sampling_params": {"n": 1000000}}, ["n", "limit of 4"]),
    ("/generate", {"text": "x", "sampling_params": {"max_new_tokens": 1500}},
     ["could never run", str(POOL)]),
    ("/generate", {"text": "x", "sampling_params": {"stop": ["s"] * 65}}, ["stop strings", "64"]),
    ("/generate", {"text": "x", "sampling_params": {"logit_bias": {"x": 1}}}, ["logit_bias"]),
    ("/generate", {"text": "x", "sampling_params": {"bogus": 1}}, ["bogus"]),
    ("/generate", {"text": "x", "no_such_field": 1}, ["no_such_field"]),
    ("/v1/chat/completions", {**CHAT, "response_format": {"type": "json_schema",
                                                          "json_schema": "x"}},
     ["response_format.json_schema"]),
    ("/v1/chat/completions", {**CHAT, "model": ["x"]}, ["model", "string"]),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [
        {"type": "text", "text": 5}]}]}, ["messages.0.content.0.text", "string"]),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "x"}}]}]}, ["type", "'text'"]),
    ("/v1/chat/completions", {**CHAT, "top_logprobs": 21, "logprobs": True},
     ["top_logprobs", "20"]),
    ("/v1/completions", {"prompt": "x", "logprobs": 10**6}, ["logprobs is", "limit"]),
    ("/v1/completions", {"prompt": [], "max_tokens": 1}, ["prompt"]),
    ("/tokenize", {"text": 5}, ["text"]),
    ("/detokenize", {"tokens": [True]}, ["tokens"]),
    ("/abort_request", {"rid": 5}, ["rid"]),
]


@pytest.mark.parametrize("route,body,words", DEFECTS,
                         ids=[f"{r}:{json.dumps(b)[:40]}" for r, b, _ in DEFECTS])
def test_malformed_request_is_a_400_naming_the_field(server, route, body, words):
    err = error_of(post(server, route, body), 400)
    for word in words:
        assert word in err["message"], err


@pytest.mark.parametrize("route,raw,word", [
    ("/generate", b'{"text": "x", "sampling_params": {"temperature": NaN}}', "finite"),
    ("/generate", b'{"text": "x", "sampling_params": {"top_p": Infinity}}', "finite"),
    ("/generate", b'{"text": "x", "sampling_params": {"logit_bias": {"3": NaN}}}', "finite"),
    ("/generate", b'{"text": "\\ud800"}', "JSON"),  # a lone surrogate
    ("/generate", b'{"text": "\xff\xfe"}', "JSON"),  # not UTF-8
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "\\udfff"}]}', "JSON"),
    ("/generate", b"[" * 100_000, "deeply"),
])
def test_non_json_values_are_400(server, route, raw, word):
    assert word in error_of(post(server, route, raw=raw), 400)["message"]


def test_grammar_that_breaks_the_compiler_fails_alone(server):
    bad = {"text": "x", "sampling_params": {"max_new_tokens": 4,
                                            "json_schema": {"type": "object", "properties": [1]}}}
    error_of(post(server, "/generate", bad), 400)
    good = post(server, "/generate", {"text": "x", "sampling_params": {
        "max_new_tokens": 3, "ignore_eos": True}})
    assert good.json()["meta_info"]["completion_tokens"] == 3


def _raw_request(srv: ServerProcess, head: bytes, body: bytes, read_timeout: float = 30.0):
    with socket.create_connection(("127.0.0.1", srv.port), timeout=read_timeout) as sock:
        sock.sendall(head + body)
        data = b""
        while not _complete(data):
            chunk = sock.recv(65536)
            if not chunk:
                break
            data += chunk
    status = int(data.split(b" ", 2)[1])
    return status, data


def _complete(data: bytes) -> bool:
    """The whole response: headers, then Content-Length bytes of body."""
    head, sep, body = data.partition(b"\r\n\r\n")
    if not sep:
        return False
    for line in head.split(b"\r\n"):
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            return len(body) >= int(value)
    return True


def _rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


def test_huge_body_gets_413_before_it_is_read(server):
    before = _rss_kib(server.proc.pid)
    head = (f"POST /generate HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {100 << 20}\r\n\r\n").encode()
    status, data = _raw_request(server, head, b'{"text": "')
    assert status == 413 and b"--max-request-bytes" in data
    # chunked: no length declared, refused once the limit is passed
    head = (f"POST /generate HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
            "Transfer-Encoding: chunked\r\n\r\n").encode()
    piece = b"a" * (256 << 10)
    chunk = f"{len(piece):x}\r\n".encode() + piece + b"\r\n"
    status, _ = _raw_request(server, head, chunk * 6)
    assert status == 413
    assert _rss_kib(server.proc.pid) - before < 32 << 10  # flat: no copy of the body


def test_half_sent_body_times_out_with_408(server):
    head = (f"POST /generate HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
            "Content-Type: application/json\r\nContent-Length: 100\r\n\r\n").encode()
    status, data = _raw_request(server, head, b'{"text": "')
    assert status == 408 and b"--request-read-timeout" in data


def test_no_secret_in_any_response_and_auth_scheme_any_case(server):
    assert KEY not in httpx.get(server.url + "/get_server_info", headers=AUTH).text
    for scheme in ("bearer", "BEARER", "Bearer"):
        ok = httpx.get(server.url + "/v1/models", headers={"Authorization": f"{scheme} {KEY}"})
        assert ok.status_code == 200
    error_of(httpx.get(server.url + "/v1/models", headers={"Authorization": f"Basic {KEY}"}),
             401)


def test_openapi_document_comes_from_the_request_models(server):
    doc = httpx.get(server.url + "/openapi.json", headers=AUTH).json()
    body = doc["paths"]["/generate"]["post"]["requestBody"]["content"]["application/json"]
    assert body["schema"] == {"$ref": "#/components/schemas/GenerateRequest"}
    schemas = doc["components"]["schemas"]
    sp = schemas["SamplingParamsIn"]["properties"]
    assert {"temperature", "max_new_tokens", "stop", "json_schema"} <= set(sp)
    assert schemas["GenerateRequest"]["additionalProperties"] is False
    assert "ChatCompletionRequest" in schemas and "/v1/completions" in doc["paths"]


def test_disconnects_leave_no_traceback_and_no_kv(server):
    body = {"text": "story", "stream": True,
            "sampling_params": {"max_new_tokens": 600, "ignore_eos": True}}
    for _ in range(3):
        with httpx.stream("POST", server.url + "/generate", json=body, headers=AUTH,
                          timeout=60) as resp:
            next(line for line in resp.iter_lines() if line.startswith("data: "))
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(server.url + "/generate", json={**body, "stream": False}, headers=AUTH,
                       timeout=0.3)
    assert_idle_and_whole(server)
    log = server.log()
    assert "Traceback" not in log and "never retrieved" not in log, log


def test_state_after_everything(server):
    """Runs last in this module: the server is up, idle, and lost nothing."""
    assert_idle_and_whole(server)
    assert "Traceback" not in server.log()
