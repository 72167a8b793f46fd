"""The server's listening socket, opened before anything else starts.

A server takes seconds to import, load its model and start its compile worker before
uvicorn would bind its port; a port chosen free a moment earlier (a launcher's or a test's
``free_port``) could meanwhile become another process's (a zmq socket bound to a random
port, an outgoing connection's ephemeral port). Listening at once, the port is the
server's from its first second: nothing else can bind it, even with SO_REUSEADDR. A
client that connects before the server is ready waits in the backlog and is answered
once uvicorn serves this socket. Imports nothing heavy: the command line opens it before
it imports the server.
"""

from __future__ import annotations

import socket

BACKLOG = 2048  # uvicorn's default


def bind_listener(host: str, port: int) -> socket.socket:
    """A TCP socket listening on ``host:port`` (SO_REUSEADDR, as uvicorn sets it). A port
    that cannot be bound ends the process with a message naming it."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
        sock.listen(BACKLOG)
    except OSError as e:
        sock.close()
        raise SystemExit(f"cannot bind {host}:{port} (--host / --port): {e.strerror}") from None
    return sock
