"""Who may talk to a PD server's sockets: the servers sharing ``--disaggregation-secret-file``.

Every PD socket (bootstrap, transfer, a prefill replica's Register) speaks CurveZMQ with
keys derived from the shared secret (HMAC-SHA256 of the secret and a label):

* the prefill's ROUTERs are CURVE servers with the *server* key pair; a ZAP handler (one
  thread per transport) admits only clients presenting the *client* public key, so a
  peer without the secret never completes the handshake and none of its bytes reach the
  transport (a claim, a chunk, a 4 GiB frame header: libzmq drops the connection);
* the decode's DEALERs are CURVE clients with the client key pair, pinned to the server
  public key, so a "prefill" without the secret cannot answer (the KV it would push never
  arrives, let alone enters the pool).

CurveZMQ authenticates and encrypts every message of a connection with per-connection
short-term keys and nonces (libsodium's crypto_box: constant-time verification, replays
and reordering refused), so the prompt KV on the wire is private too. What stays
trusted: every process that can read the secret file.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import stat
import threading
from dataclasses import dataclass

import zmq
import zmq.auth.thread
from zmq.utils import z85

logger = logging.getLogger(__name__)

MIN_SECRET_BYTES = 32  # 256 bits: `openssl rand -hex 32` gives 64 characters
MAX_SECRET_BYTES = 4096
SECRET_FLAG = "--disaggregation-secret-file"


def load_secret(path: str) -> bytes:
    """The key in ``path`` (its bytes, surrounding whitespace stripped). ValueError naming
    the flag if it is missing, readable by group or others, too short or too long."""
    try:
        info = os.stat(path)
        with open(path, "rb") as f:
            key = f.read(MAX_SECRET_BYTES + 1).strip()
    except OSError as e:
        raise ValueError(f"{SECRET_FLAG} {path!r}: {e.strerror}") from None
    if info.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise ValueError(f"{SECRET_FLAG} {path!r} is accessible to group or others (mode "
                         f"{stat.S_IMODE(info.st_mode):o}): chmod 600 it")
    if not MIN_SECRET_BYTES <= len(key) <= MAX_SECRET_BYTES:
        raise ValueError(f"{SECRET_FLAG} {path!r} holds {len(key)} bytes: the key must be "
                         f"{MIN_SECRET_BYTES}..{MAX_SECRET_BYTES} bytes (e.g. "
                         "`openssl rand -hex 32`)")
    return key


def write_secret(path: str) -> None:
    """A fresh random key in ``path`` (mode 0600), as ``load_secret`` reads it."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(os.urandom(32).hex())


def _keypair(secret: bytes, label: bytes) -> tuple[bytes, bytes]:
    private = z85.encode(hmac.new(secret, b"radixlm-pd-curve-" + label, hashlib.sha256).digest())
    return zmq.curve_public(private), private


@dataclass(frozen=True)
class PeerKeys:
    """The CURVE key pairs both sides derive from the secret (public, private; z85)."""

    server: tuple[bytes, bytes]
    client: tuple[bytes, bytes]

    @classmethod
    def from_secret(cls, secret: bytes) -> PeerKeys:
        return cls(_keypair(secret, b"server"), _keypair(secret, b"client"))

    def serve(self, sock: zmq.Socket) -> None:
        """Make ``sock`` (before it binds) a CURVE server with the server key pair."""
        sock.curve_server = True
        sock.curve_publickey, sock.curve_secretkey = self.server

    def connect(self, sock: zmq.Socket) -> None:
        """Make ``sock`` (before it connects) a CURVE client of a server holding the key."""
        sock.curve_serverkey = self.server[0]
        sock.curve_publickey, sock.curve_secretkey = self.client


class Gatekeeper:
    """The ZAP handler of one zmq context: admits CURVE clients holding the client key.
    ``refused`` counts the handshakes it turned down (for tests and logs)."""

    def __init__(self, ctx: zmq.Context, keys: PeerKeys) -> None:
        self.keys = keys
        self.refused = 0
        self._lock = threading.Lock()
        self.auth = zmq.auth.thread.ThreadAuthenticator(ctx, log=logger)
        self.auth.start()
        self.auth.configure_curve_callback("*", self)

    def callback(self, domain: str, key: bytes) -> bool:
        ok = hmac.compare_digest(key, self.keys.client[0])
        if not ok:
            with self._lock:
                self.refused += 1
            logger.warning("refused a PD peer without the shared secret (%s)", SECRET_FLAG)
        return ok

    def stop(self) -> None:
        self.auth.stop()
