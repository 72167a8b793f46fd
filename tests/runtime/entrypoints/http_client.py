"""Raw-socket HTTP/1.1 helpers for the connection tests: pipelined requests, silent and
half-sent connections, and reading content-length framed responses."""

from __future__ import annotations

import json
import os
import socket
import time


def post(path: str, body: dict | bytes, extra: str = "") -> bytes:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    return (f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n{extra}"
            f"Content-Length: {len(data)}\r\n\r\n").encode() + data


def read_responses(sock: socket.socket, count: int, timeout: float = 60.0
                   ) -> list[tuple[int, bytes]]:
    """``count`` content-length framed responses ``(status, body)`` read from ``sock``."""
    sock.settimeout(timeout)
    buf, out = b"", []
    while len(out) < count:
        head_end = buf.find(b"\r\n\r\n")
        if head_end >= 0:
            head = buf[:head_end].decode("latin-1").split("\r\n")
            fields = dict(line.split(": ", 1) for line in head[1:])
            length = int({k.lower(): v for k, v in fields.items()}["content-length"])
            end = head_end + 4 + length
            if len(buf) >= end:
                out.append((int(head[0].split()[1]), buf[head_end + 4:end]))
                buf = buf[end:]
                continue
        chunk = sock.recv(65536)
        if not chunk:
            raise ConnectionError(f"closed after {len(out)} of {count} responses")
        buf += chunk
    return out


def closed_by_peer(sock: socket.socket, timeout: float) -> bool:
    """Whether the peer closes ``sock`` (EOF or reset) within ``timeout`` seconds; any
    bytes it sends first are skipped."""
    sock.settimeout(timeout)
    try:
        while sock.recv(65536):
            pass
    except TimeoutError:
        return False
    except ConnectionResetError:
        pass
    return True


def open_connections(port: int, count: int) -> list[socket.socket]:
    return [socket.create_connection(("127.0.0.1", port), timeout=30) for _ in range(count)]


def fd_count(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def wait_fd_count(pid: int, at_most: int, timeout: float = 30.0) -> int:
    """The process's open fds once they are ``at_most`` (or after ``timeout``)."""
    deadline = time.monotonic() + timeout
    while (n := fd_count(pid)) > at_most and time.monotonic() < deadline:
        time.sleep(0.1)
    return n
