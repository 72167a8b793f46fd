"""``radixlm serve``'s HTTP transport: a streamed request that fails before its first
output gets its error status (not 200 and an error event) on every route, silent and
half-sent connections are closed while others are served, pipelined requests are all
answered in order, and no file descriptor is left behind."""

from __future__ import annotations

import json
import os
import resource
import socket

import httpx
import openai
import pytest

from tests.runtime.entrypoints.http_client import (
    closed_by_peer,
    fd_count,
    open_connections,
    post,
    read_responses,
    wait_fd_count,
)

SILENT, HALF_SENT = 2000, 50
FLAGS = ["--max-total-tokens", "16384", "--random-seed", "0", "--log-level", "warning",
         "--timeout-header-read", "2", "--max-connections", str(SILENT + HALF_SENT + 500)]
# a keyword the grammar backend refuses when the scheduler compiles the grammar
UNSUPPORTED = json.dumps({"type": "array", "uniqueItems": True})
SP = {"max_new_tokens": 4}


@pytest.fixture(scope="module")
def server(module_server):
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = 2 * (SILENT + HALF_SENT) + 1000  # these sockets, in this process and the server's
    if soft < need:
        if hard != resource.RLIM_INFINITY and hard < need:
            pytest.skip(f"needs {need} file descriptors, ulimit -Hn is {hard}")
        resource.setrlimit(resource.RLIMIT_NOFILE, (need, hard))  # the server inherits it
    return module_server(FLAGS, "transport")


def _error(resp: httpx.Response, status: int) -> str:
    assert resp.status_code == status, resp.text
    assert resp.headers["content-type"] == "application/json"
    return resp.json()["error"]["message"]


@pytest.mark.parametrize("path, body", [
    ("/generate", {"text": "x", "sampling_params": {**SP, "json_schema": UNSUPPORTED}}),
    ("/generate", {"text": ["x", "y"], "sampling_params": [SP, {**SP,
                                                              "json_schema": UNSUPPORTED}]}),
    ("/generate", {"text": "x", "sampling_params": {**SP, "n": 3, "json_schema": UNSUPPORTED}}),
    ("/v1/completions", {"prompt": ["x", "y"], "max_tokens": 4, "n": 2,
                         "json_schema": UNSUPPORTED}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_tokens": 4,
                              "response_format": {"type": "json_schema", "json_schema": {
                                  "name": "s", "schema": json.loads(UNSUPPORTED)}}}),
])
def test_streamed_scheduler_error_is_a_status(server, path, body):
    resp = httpx.post(server.url + path, json={**body, "stream": True}, timeout=120)
    assert "uniqueitems" in _error(resp, 400).lower()


def test_openai_client_raises_bad_request(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    fmt = {"type": "json_schema", "json_schema": {"name": "s",
                                                  "schema": json.loads(UNSUPPORTED)}}
    with pytest.raises(openai.BadRequestError, match="uniqueItems"):
        client.chat.completions.create(model="default", stream=True, max_tokens=4,
                                       messages=[{"role": "user", "content": "x"}],
                                       response_format=fmt)
    with pytest.raises(openai.BadRequestError, match="uniqueItems"):
        client.completions.create(model="default", prompt="x", stream=True, max_tokens=4,
                                  extra_body={"json_schema": UNSUPPORTED})
    chunks = list(client.completions.create(model="default", prompt=["x", "y"], n=2,
                                            stream=True, max_tokens=4))
    assert {c.choices[0].index for c in chunks if c.choices} == {0, 1, 2, 3}


def test_streams_of_many_requests_still_stream(server):
    body = {"text": ["a", "b"], "stream": True,
            "sampling_params": {"max_new_tokens": 6, "ignore_eos": True}}
    with httpx.stream("POST", server.url + "/generate", json=body, timeout=120) as resp:
        assert resp.status_code == 200
        events = [line[6:] for line in resp.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert {c["index"] for c in chunks} == {0, 1}
    for i in (0, 1):
        last = [c for c in chunks if c["index"] == i][-1]
        assert len(last["output_ids"]) == 6


def test_silent_connections_are_closed_while_serving(server):
    pid = server.proc.pid
    base = fd_count(pid)
    silent = open_connections(server.port, SILENT)
    half = open_connections(server.port, HALF_SENT)
    for s in half:
        s.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: appl")
    resp = httpx.post(server.url + "/generate", json={"text": "hi", "sampling_params": SP},
                      timeout=120)
    assert resp.status_code == 200
    for s in [*silent, *half]:
        assert closed_by_peer(s, 60.0), "a silent connection was left open"
        s.close()
    assert wait_fd_count(pid, base) <= base
    assert httpx.get(server.url + "/health", timeout=30).status_code == 200


def test_pipelined_generates_are_answered_in_order(server):
    reqs = [post("/generate", {"text": "hi", "rid": f"pipe-{i}", "sampling_params": SP})
            for i in range(3)]
    with socket.create_connection(("127.0.0.1", server.port), timeout=60) as s:
        s.sendall(b"".join(reqs))
        answers = read_responses(s, 3)
    assert [status for status, _ in answers] == [200] * 3
    assert [json.loads(body)["meta_info"]["id"] for _, body in answers] == [
        "pipe-0", "pipe-1", "pipe-2"]


def _listening_addresses(pid: int) -> list[str]:
    """The local addresses (hex, as /proc/net prints them) of ``pid``'s listening TCP
    sockets."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:["):
            inodes.add(link[len("socket:["):-1])
    found = []
    for table in ("tcp", "tcp6"):
        with open(f"/proc/{pid}/net/{table}") as f:
            for line in f.readlines()[1:]:
                cols = line.split()
                if cols[3] == "0A" and cols[9] in inodes:  # 0A: LISTEN
                    found.append(cols[1].rsplit(":", 1)[0])
    return found


def test_every_listening_socket_is_on_loopback(server):
    """Default flags bind nothing but loopback: the HTTP port, and no other TCP listener
    in the server or its children (they talk over ipc sockets in a 0700 directory)."""
    pids = [p for p in httpx.get(server.url + "/get_server_info").json()["pids"].values() if p]
    addresses = [a for pid in pids for a in _listening_addresses(pid)]
    loopback = {"0100007F", "00000000000000000000000001000000"}  # 127.0.0.1, ::1
    assert addresses and set(addresses) <= loopback, addresses


def test_ipc_directory_is_private_and_messages_are_not_pickle(server):
    """The processes talk over ipc sockets in a 0700 directory of the server's uid, and a
    message is msgspec's closed union: a pickle (or anything else) does not decode."""
    import pickle
    import tempfile
    from pathlib import Path

    import msgspec

    from radixlm.runtime.managers.messages import AbortReq, decode, encode

    main = httpx.get(server.url + "/get_server_info").json()["pids"]["main"]
    dirs = list(Path(tempfile.gettempdir()).glob(f"radixlm-{main}-*"))
    assert len(dirs) == 1 and dirs[0].stat().st_mode & 0o777 == 0o700
    assert dirs[0].stat().st_uid == os.getuid() and any(dirs[0].iterdir())
    assert decode(encode(AbortReq("r"))) == AbortReq("r")
    with pytest.raises(msgspec.DecodeError):
        decode(pickle.dumps(AbortReq("r")))
