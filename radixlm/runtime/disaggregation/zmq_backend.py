"""The zmq transport (``--disaggregation-transfer-backend zmq``): pages over TCP.

Sockets, all owned by one I/O thread (zmq sockets are not thread-safe)::

    prefill server                              decode server
    ROUTER tcp://host:BOOTSTRAP_PORT  <-------- DEALER (one per prefill)   RouteQuery
      (the bootstrap service)          -------> RouteInfo(transfer_ports, layout)
    ROUTER tcp://host:<free port>     <-------- DEALER (one per prefill    Claim / Ack / Abort
      (transfers; ROUTER_MANDATORY)    -------> replica) [StateChunk + 2*linear layers
                                                         frames,] KVChunk + 2*layers
                                                         frames, Abort

With ``--dp-size N`` on the prefill server, replica 0 runs the bootstrap service and every
replica its own transfer ROUTER; replicas 1..N-1 announce theirs to the service
(``Register``, from a DEALER), which answers a RouteQuery once all N are known. The
prefill server places room ``r`` on replica ``r mod N`` (or where ``disagg_prefill_dp_rank``
says: ``load_balancer.room_replica``), and the decode side sends room ``r``'s messages to
that replica's transfer port (``KVReceiver.replica``).

The scheduler's thread hands commands to the I/O thread over an inproc PUSH/PULL pair
(frames passed by reference: ``copy=False`` end to end, so a page is copied once, from
the pool into a frame, until the receiving side copies it into its pool). What arrives
is queued for ``KVManager.poll``. A send to a decode server whose connection is gone
fails at once (``EHOSTUNREACH``); a silent peer is caught by the manager's deadlines.
Messages are msgpack (``base.encode``); nothing is unpickled.

Every TCP socket speaks CurveZMQ with keys derived from the shared secret (``auth.py``):
a peer without it never gets a message through. Every socket also refuses frames over
``max_frame`` bytes (``zmq.MAXMSGSIZE``: libzmq drops the connection as soon as a frame
header declares more), sized from the largest legitimate frame (``KVBuffers.max_frame``).
"""

from __future__ import annotations

import itertools
import logging
import threading
from typing import Any

import msgspec
import torch
import zmq

from radixlm.runtime.disaggregation.auth import Gatekeeper, PeerKeys
from radixlm.runtime.disaggregation.transport import Event, Peer, Transport
from radixlm.runtime.disaggregation.wire import (
    KVLayout,
    Register,
    RouteInfo,
    RouteQuery,
    WireMsg,
    decode,
    encode,
)

logger = logging.getLogger(__name__)
_ids = itertools.count()


def tensor_frame(t: torch.Tensor) -> Any:
    """A contiguous CPU tensor's bytes as a buffer zmq sends without copying."""
    return t.contiguous().view(torch.uint8).numpy()


class ZmqTransport(Transport):
    """``bootstrap`` (host, port): a prefill server's bootstrap service binds there (its
    transfer socket binds a free port on the same host); None: a decode server. A prefill
    replica ``dp_rank`` > 0 of ``dp_size`` registers with replica 0's service instead.
    ``keys``: the CURVE keys of the shared secret; ``max_frame``: the largest frame any
    socket accepts (bytes)."""

    def __init__(self, layout: KVLayout, keys: PeerKeys, max_frame: int,
                 bootstrap: tuple[str, int] | None = None, dp_rank: int = 0,
                 dp_size: int = 1) -> None:
        super().__init__()
        self.layout, self.keys, self.max_frame = layout, keys, max_frame
        self.ctx = zmq.Context()
        # the ZAP handler: a prefill's ROUTERs admit only clients holding the secret
        self.gate = Gatekeeper(self.ctx, keys) if bootstrap is not None else None
        addr = f"inproc://radixlm-pd-{id(self)}-{next(_ids)}"
        self.cmd = self.ctx.socket(zmq.PUSH)  # scheduler thread only
        self.cmd.bind(addr)
        pull = self.ctx.socket(zmq.PULL)
        pull.connect(addr)
        self.boot: zmq.Socket | None = None
        self.xfer: zmq.Socket | None = None
        self.register: zmq.Socket | None = None
        self.transfer_port = 0
        # the bootstrap service: each replica's transfer port, and who waits for them all
        self.dp_size = dp_size
        self.replica_ports: dict[int, int] = {}
        self.waiting_routes: list[bytes] = []
        if bootstrap is not None:
            host, port = bootstrap
            self.xfer = self._socket(zmq.ROUTER, server=True)
            self.xfer.setsockopt(zmq.ROUTER_MANDATORY, 1)
            self.transfer_port = self.xfer.bind_to_random_port(f"tcp://{host}")
            if dp_rank == 0:
                self.boot = self._socket(zmq.ROUTER, server=True)
                self.boot.bind(f"tcp://{host}:{port}")
                self.replica_ports[0] = self.transfer_port
            else:  # queued by zmq until replica 0 has bound
                self.register = self._socket(zmq.DEALER)
                self.register.connect(f"tcp://{host}:{port}")
                self.register.send(encode(Register(dp_rank, self.transfer_port)))
        # decode side: (host, bootstrap port) -> [bootstrap DEALER, the transfer DEALER of
        # each prefill replica (None until the route is known)]
        self.peers: dict[tuple[str, int], list[Any]] = {}
        self._thread = threading.Thread(target=self._run, args=(pull,), daemon=True,
                                        name="kv-transfer")
        self._thread.start()

    def _socket(self, kind: int, server: bool = False) -> zmq.Socket:
        """A TCP socket: CURVE server (bind) or client (connect), frames bounded."""
        s = self.ctx.socket(kind)
        (self.keys.serve if server else self.keys.connect)(s)
        s.setsockopt(zmq.MAXMSGSIZE, self.max_frame)
        s.setsockopt(zmq.LINGER, 0)
        s.setsockopt(zmq.SNDHWM, 0)  # never drop or block a page: the deadlines bound it
        s.setsockopt(zmq.RCVHWM, 0)
        return s

    # --- scheduler thread ---------------------------------------------------------------
    def send(self, peer: Peer, msg: WireMsg, frames: list[torch.Tensor] | None = None,
             replica: int = 0) -> None:
        parts = [tensor_frame(f) for f in frames or []]
        self.cmd.send_multipart([msgspec.msgpack.encode(["send", _peer_key(peer), replica]),
                                 encode(msg), *parts], copy=False)

    def resolve(self, host: str, port: int) -> None:
        self.cmd.send_multipart([msgspec.msgpack.encode(["resolve", [host, port]])])

    def forget(self, peer: Peer) -> None:
        self.cmd.send_multipart([msgspec.msgpack.encode(["forget", _peer_key(peer)])])

    def close(self) -> None:
        if self._thread.is_alive():
            self.cmd.send_multipart([msgspec.msgpack.encode(["stop", None])])
            self._thread.join(timeout=5)
        self.cmd.close(linger=0)
        if self.gate is not None:
            self.gate.stop()
        self.ctx.term()

    # --- I/O thread ---------------------------------------------------------------------
    def _run(self, pull: zmq.Socket) -> None:
        try:
            while self._turn(pull):
                pass
        except Exception:  # noqa: BLE001 - a dying I/O thread must not kill the scheduler
            logger.exception("KV transfer I/O thread failed")
        finally:
            pull.close(linger=0)
            for s in (self.boot, self.xfer, self.register):
                if s is not None:
                    s.close(linger=0)
            for addr in list(self.peers):
                self._forget(addr)

    def _turn(self, pull: zmq.Socket) -> bool:
        poller = zmq.Poller()
        poller.register(pull, zmq.POLLIN)
        for s in (self.boot, self.xfer, *self._peer_sockets()):
            if s is not None:
                poller.register(s, zmq.POLLIN)
        for sock, _ in poller.poll():
            if sock is pull:
                if not self._command(pull.recv_multipart(copy=False)):
                    return False
            elif sock is self.boot:
                ident, *rest = sock.recv_multipart()
                self._answer_route(ident, rest)
            elif sock is self.xfer:
                ident, meta, *frames = sock.recv_multipart(copy=False)
                self._incoming(ident.bytes, meta, frames)
            else:
                self._from_prefill(sock)
        return True

    def _peer_sockets(self) -> list[zmq.Socket]:
        return [s for boot, xfers in self.peers.values() for s in (boot, *(xfers or ()))]

    def _forget(self, addr: tuple[str, int]) -> None:
        boot, xfers = self.peers.pop(addr, (None, None))
        for s in (boot, *(xfers or ())):
            if s is not None:
                s.close(linger=0)

    def _command(self, parts: list[Any]) -> bool:
        op, key, *replica = msgspec.msgpack.decode(parts[0].bytes)
        if op == "stop":
            return False
        if op == "resolve":
            self._connect(tuple(key))
        elif op == "forget":
            self._forget(tuple(key))
        elif op == "send":
            self._send(key, replica[0], parts[1:])
        return True

    def _send(self, key: Any, replica: int, parts: list[Any]) -> None:
        if isinstance(key, bytes):  # prefill -> decode through the transfer ROUTER
            assert self.xfer is not None, "only a prefill transport addresses by routing id"
            try:
                self.xfer.send_multipart([key, *parts], copy=False)
            except zmq.ZMQError as e:
                self.deliver(Event(key, None, error=f"connection lost ({e})"))
            return
        socks = self.peers.get(tuple(key))
        if socks is None or socks[1] is None:
            return  # forgotten meanwhile: its rooms are already failed
        socks[1][replica].send_multipart(parts, copy=False)  # checked by KVReceiver._routed

    def _answer_route(self, ident: bytes, rest: list[bytes]) -> None:
        try:
            msg = decode(rest[-1]) if rest else None
        except msgspec.DecodeError:
            msg = None
        if isinstance(msg, Register) and 0 < msg.dp_rank < self.dp_size:
            self.replica_ports[msg.dp_rank] = msg.transfer_port
            if len(self.replica_ports) == self.dp_size:
                waiting, self.waiting_routes = self.waiting_routes, []
                for who in waiting:
                    self._route_info(who)
        elif isinstance(msg, RouteQuery):
            if len(self.replica_ports) == self.dp_size:
                self._route_info(ident)
            else:  # a replica has not registered yet: answer when it has
                self.waiting_routes.append(ident)

    def _route_info(self, ident: bytes) -> None:
        assert self.boot is not None
        ports = [self.replica_ports[r] for r in range(self.dp_size)]
        self.boot.send_multipart([ident, encode(RouteInfo(ports, self.layout))])

    def _incoming(self, ident: bytes, meta: Any, frames: list[Any]) -> None:
        try:
            msg = decode(meta.buffer)
        except msgspec.DecodeError as e:
            logger.warning("dropped a malformed transfer message: %s", e)
            return
        self.deliver(Event(ident, msg, frames))

    def _connect(self, addr: tuple[str, int]) -> None:
        boot = self._socket(zmq.DEALER)
        boot.connect(f"tcp://{addr[0]}:{addr[1]}")
        boot.send(encode(RouteQuery()))
        self.peers[addr] = [boot, None]

    def _from_prefill(self, sock: zmq.Socket) -> None:
        addr = next((a for a, (boot, xfers) in self.peers.items()
                     if sock is boot or sock in (xfers or ())), None)
        if addr is None:
            sock.recv_multipart()
            return
        meta, *frames = sock.recv_multipart(copy=False)
        try:
            msg = decode(meta.buffer)
        except msgspec.DecodeError as e:
            logger.warning("dropped a malformed message from %s: %s", addr, e)
            return
        if sock is self.peers[addr][0]:  # the bootstrap service answered
            if isinstance(msg, RouteInfo) and self.peers[addr][1] is None \
                    and msg.transfer_ports:
                xfers = []
                for port in msg.transfer_ports:
                    xfers.append(self._socket(zmq.DEALER))
                    xfers[-1].connect(f"tcp://{addr[0]}:{port}")
                self.peers[addr][1] = xfers
                self.deliver(Event(addr, msg))
            return
        self.deliver(Event(addr, msg, frames))


def _peer_key(peer: Peer) -> Any:
    return peer if isinstance(peer, bytes) else list(peer)
