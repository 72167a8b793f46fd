"""The HTTP connection guard (``connections.py``) on an in-process uvicorn with a small
ASGI app: silent and half-sent connections are closed by the header-read timeout,
connections beyond ``--max-connections`` get 503 while the open ones are served,
pipelined requests are answered in order, and no file descriptor is left behind."""

from __future__ import annotations

import asyncio
import os
import socket
import threading
from collections.abc import Iterator

import pytest
import uvicorn

from radixlm.runtime.entrypoints.connections import bounded_protocol, default_max_connections
from radixlm.runtime.entrypoints.server_process import free_port
from tests.runtime.entrypoints.http_client import (
    closed_by_peer,
    fd_count,
    open_connections,
    post,
    read_responses,
    wait_fd_count,
)

RELEASE = threading.Event()  # /slow answers once it is set


async def app(scope, receive, send) -> None:  # noqa: ANN001 - the ASGI signature
    body = b""
    while True:
        message = await receive()
        body += message.get("body", b"")
        if not message.get("more_body"):
            break
    if scope["path"] == "/slow":
        while not RELEASE.is_set():
            await asyncio.sleep(0.01)
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


@pytest.fixture
def serve() -> Iterator:
    servers = []

    def start(header_timeout: float, max_connections: int) -> int:
        port = free_port()
        config = uvicorn.Config(app, host="127.0.0.1", port=port, lifespan="off",
                                log_level="error",
                                http=bounded_protocol(header_timeout, max_connections))
        server = uvicorn.Server(config)
        thread = threading.Thread(target=server.run, daemon=True)
        thread.start()
        servers.append((server, thread))
        while not server.started:
            assert thread.is_alive()
            threading.Event().wait(0.02)
        return port

    yield start
    RELEASE.clear()
    for server, thread in servers:
        server.should_exit = True
        thread.join(30)


def _echo(port: int, payload: bytes) -> tuple[int, bytes]:
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        s.sendall(post("/echo", payload))
        return read_responses(s, 1)[0]


def test_silent_and_half_sent_connections_are_closed(serve):
    """A connection silent from its first byte, one that stops in its request head, and
    one that does so on its second request are closed by the header timeout, while a
    normal client is served; their descriptors are all released."""
    port = serve(0.5, 1000)
    base = fd_count(os.getpid())
    silent = open_connections(port, 300)
    half = open_connections(port, 30)
    for s in half:
        s.sendall(b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Le")
    second = open_connections(port, 1)[0]
    second.sendall(post("/echo", b"one"))
    assert read_responses(second, 1) == [(200, b"one")]
    second.sendall(b"GET /echo HTTP/1.1\r\n")
    assert _echo(port, b"served") == (200, b"served")
    for s in [*silent, *half, second]:
        assert closed_by_peer(s, 30.0)
        s.close()
    assert wait_fd_count(os.getpid(), base) <= base


def test_connections_beyond_the_cap_get_503(serve):
    port = serve(60.0, 8)
    slow = socket.create_connection(("127.0.0.1", port), timeout=30)
    slow.sendall(post("/slow", b"slow"))
    idle = open_connections(port, 7)
    extra = socket.create_connection(("127.0.0.1", port), timeout=30)
    status, body = read_responses(extra, 1)[0]
    assert status == 503 and b"--max-connections" in body
    assert closed_by_peer(extra, 30.0)
    RELEASE.set()
    assert read_responses(slow, 1) == [(200, b"slow")]  # the open ones are still served
    for s in [*idle, extra, slow]:
        s.close()
    deadline = threading.Event()
    for _ in range(100):  # the server sees the closes
        try:
            assert _echo(port, b"again") == (200, b"again")
            break
        except (ConnectionError, AssertionError):
            deadline.wait(0.1)
    else:
        pytest.fail("no connection served after the others closed")


def test_pipelined_requests_are_answered_in_order(serve):
    port = serve(5.0, 100)
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        s.sendall(post("/echo", b"1") + post("/slow", b"2") + post("/echo", b"3"))
        RELEASE.set()
        assert read_responses(s, 3) == [(200, b"1"), (200, b"2"), (200, b"3")]


def test_default_cap_is_under_the_fd_limit():
    import resource

    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    assert 1 <= default_max_connections() <= soft // 2 or soft == resource.RLIM_INFINITY
