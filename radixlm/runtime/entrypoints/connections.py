"""Bounded HTTP connections: uvicorn's h11 protocol with a header-read timeout and a cap
on open connections.

uvicorn closes idle keep-alive connections (``timeout_keep_alive``) but never one that
is silent from its first byte or stops in the middle of a request head, so such
connections pile up until the process runs out of file descriptors. Here:

- a connection must send a complete request head within ``--timeout-header-read``
  seconds of being accepted (or of the first byte of a later request on it), else it is
  closed; the body then has ``--request-read-timeout`` (``BodyLimitMiddleware``);
- at most ``--max-connections`` connections are open at once; one accepted beyond that
  gets a 503 and is closed at once, so the server keeps file descriptors for the
  connections it serves.
"""

from __future__ import annotations

import asyncio
import json
import logging
import resource
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

logger = logging.getLogger(__name__)

MAX_CONNECTIONS_CEILING = 10_000  # the default cap: half of ulimit -n, at most this


def default_max_connections() -> int:
    """Half the process's file-descriptor limit (``ulimit -n``), at most 10,000: the
    other half is left to the server's own files, sockets and refused connections."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return MAX_CONNECTIONS_CEILING
    return max(1, min(soft // 2, MAX_CONNECTIONS_CEILING))


def _refusal(max_connections: int) -> bytes:
    body = json.dumps({"error": {
        "message": f"the server has {max_connections} open connections, its limit "
                   "(--max-connections); retry later",
        "type": "service_unavailable", "param": None, "code": "503"}}).encode()
    head = ("HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\nretry-after: 1\r\nconnection: close\r\n\r\n")
    return head.encode() + body


class BoundedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with ``header_timeout`` and ``max_connections`` (set by
    ``bounded_protocol``)."""

    header_timeout = 10.0
    max_connections = MAX_CONNECTIONS_CEILING

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.header_timer: asyncio.TimerHandle | None = None
        self.refused = False

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        if len(self.connections) >= self.max_connections:
            self.refused = True
            logger.warning("refused a connection: %d open (--max-connections)",
                           len(self.connections))
            transport.write(_refusal(self.max_connections))
            transport.close()
            return
        super().connection_made(transport)
        self._arm_header_timer()

    def data_received(self, data: bytes) -> None:
        if self.refused:
            return
        if self.conn.their_state is h11.IDLE:
            self._arm_header_timer()  # a request head starts (or goes on)
        super().data_received(data)
        if self.conn.their_state is not h11.IDLE:
            self._cancel_header_timer()  # its head is complete

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_header_timer()
        if self.refused:
            return
        super().connection_lost(exc)

    def _arm_header_timer(self) -> None:
        if self.header_timer is None:
            self.header_timer = self.loop.call_later(self.header_timeout, self._header_timed_out)

    def _cancel_header_timer(self) -> None:
        if self.header_timer is not None:
            self.header_timer.cancel()
            self.header_timer = None

    def _header_timed_out(self) -> None:
        self.header_timer = None
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            logger.debug("closed a connection that sent no request head in %g s "
                         "(--timeout-header-read)", self.header_timeout)
            self.transport.close()


def bounded_protocol(header_timeout: float, max_connections: int) -> type[BoundedH11Protocol]:
    """The protocol class for ``uvicorn.Config(http=...)`` with these limits."""
    return type("BoundedH11Protocol", (BoundedH11Protocol,),
                {"header_timeout": header_timeout, "max_connections": max_connections})
