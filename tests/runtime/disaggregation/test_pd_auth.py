"""Who may talk to a PD server: peers holding the shared secret (CurveZMQ), frames no
bigger than the largest legitimate one, the first claim of a room, a bounded number of
claims waiting for their request. The servers' side (a foreign prefill, a bootstrap_host
off the allow-list): ``test_pd_servers.py``."""

from __future__ import annotations

import os
import socket
import struct
import time

import pytest
import zmq

from radixlm.runtime.disaggregation.auth import PeerKeys, load_secret, write_secret
from radixlm.runtime.disaggregation.base import KVPoll
from radixlm.runtime.disaggregation.fake_backend import FakeNetwork, FakeTransport
from radixlm.runtime.disaggregation.manager import KVManager
from radixlm.runtime.disaggregation.wire import Abort, Claim, RouteQuery, encode
from radixlm.runtime.entrypoints.server_process import free_port
from tests.runtime.disaggregation.test_pd_transfer import (
    ADDR,
    KEYS,
    Clock,
    _until,
    pool,
    slots,
    turn,
    zmq_transport,
)

WAIT_S = 60.0  # a bound for "eventually", never a measured time
QUIET_S = 1.0  # how long a refused peer is watched for a message that must never come


def decoders(net: FakeNetwork, clock: Clock, n: int) -> list[KVManager]:
    return [KVManager("decode", pool(1), FakeTransport(net), 10, 20, clock) for _ in range(n)]


def test_a_later_claim_does_not_override_the_first():
    """Two decode servers claim room 7 before its request reaches the prefill server: the
    first one's claim stands (the second gets an abort); the pages go to the first."""
    clock, net = Clock(), FakeNetwork()
    pbuf = pool(0)
    prefill = KVManager("prefill", pbuf, FakeTransport(net, pbuf.layout, ADDR), 10, 20, clock)
    first, second = decoders(net, clock, 2)
    rx = [d.create_receiver(*ADDR, 7) for d in (first, second)]
    turn(prefill, first, second)
    rx[0].send_metadata(slots(0), 0, 3)
    turn(prefill, first, second)
    rx[1].send_metadata(slots(1), 0, 3)
    turn(prefill, first, second)
    assert rx[1].poll() == KVPoll.Failed and "already claimed" in rx[1].failure_reason()
    sender = prefill.create_sender(7)
    assert sender.poll() == KVPoll.WaitingForInput
    sender.send(slots(2), 42, 3)
    turn(prefill, first, second)
    assert rx[0].poll() == KVPoll.Success and rx[0].first_token == 42


def test_only_its_claimer_withdraws_a_waiting_claim():
    """An Abort for room 7 from another decode server leaves the first one's claim."""
    clock, net = Clock(), FakeNetwork()
    pbuf = pool(0)
    prefill = KVManager("prefill", pbuf, FakeTransport(net, pbuf.layout, ADDR), 10, 20, clock)
    first, other = decoders(net, clock, 2)
    rx = first.create_receiver(*ADDR, 7)
    turn(prefill, first)
    rx.send_metadata(slots(0), 0, 3)
    turn(prefill, first)
    other.transport.send(ADDR, Abort(7, "not mine"))
    turn(prefill, first, other)
    assert prefill.early_claims[7][0] == first.transport.id


def test_waiting_claims_are_bounded():
    """Claims for rooms no request has reached wait (until the bootstrap timeout), at most
    ``early_claims_limit`` of them: a claim beyond is refused at once with the reason."""
    clock, net = Clock(), FakeNetwork()
    pbuf = pool(0)
    prefill = KVManager("prefill", pbuf, FakeTransport(net, pbuf.layout, ADDR), 10, 20, clock,
                        early_claims_limit=2)
    dec = decoders(net, clock, 1)[0]
    rx = [dec.create_receiver(*ADDR, room) for room in (1, 2, 3)]
    turn(prefill, dec)
    for i, r in enumerate(rx):
        r.send_metadata(slots(i), 0, 3)
    turn(prefill, dec)
    assert sorted(prefill.early_claims) == [1, 2]
    assert rx[2].poll() == KVPoll.Failed and "2 claims already wait" in rx[2].failure_reason()
    assert rx[0].poll() == rx[1].poll() == KVPoll.WaitingForInput


def test_secret_file_checks(tmp_path):
    good = tmp_path / "good"
    write_secret(str(good))
    assert oct(os.stat(good).st_mode & 0o777) == "0o600" and len(load_secret(str(good))) == 64
    short = tmp_path / "short"
    short.write_text("x" * 31)
    short.chmod(0o600)
    with pytest.raises(ValueError, match="31 bytes.*--disaggregation-secret-file|"
                                         "--disaggregation-secret-file.*31 bytes"):
        load_secret(str(short))
    good.chmod(0o644)
    with pytest.raises(ValueError, match="group or others.*chmod 600"):
        load_secret(str(good))
    with pytest.raises(ValueError, match="--disaggregation-secret-file"):
        load_secret(str(tmp_path / "missing"))


def _foreign(ctx: zmq.Context, keys: PeerKeys | None, port: int) -> zmq.Socket:
    """A DEALER to 127.0.0.1:port: plain (``keys`` None) or CURVE with other keys."""
    sock = ctx.socket(zmq.DEALER)
    sock.linger = 0
    if keys is not None:
        keys.connect(sock)
    sock.connect(f"tcp://127.0.0.1:{port}")
    return sock


def test_prefill_hears_nothing_from_a_peer_without_the_secret():
    """Plain zmq and CURVE with another secret, speaking the wire format to the bootstrap
    and transfer ports: no RouteInfo comes back, no claim is taken (a foreign decoder
    cannot pull a prompt's KV); a peer holding the secret is heard."""
    port = free_port()
    pbuf = pool(0)
    prefill = KVManager("prefill", pbuf, zmq_transport(pbuf, ("127.0.0.1", port)), 30, 30)
    ctx = zmq.Context()
    other = PeerKeys.from_secret(b"not the shared secret, 32 bytes.")
    try:
        xport = prefill.transport.transfer_port
        foreign = []
        for keys in (None, other):
            boot, xfer = _foreign(ctx, keys, port), _foreign(ctx, keys, xport)
            boot.send(encode(RouteQuery()))
            xfer.send(encode(Claim(9, 3, 0, 4)))
            foreign += [boot, xfer]
        dec = KVManager("decode", pool(1), zmq_transport(pool(1)), 30, 30)
        genuine = dec.create_receiver("127.0.0.1", port, 10)
        _until(lambda: genuine.poll() == KVPoll.WaitingForInput, prefill, dec)
        genuine.send_metadata(slots(0), 0, 3)
        _until(lambda: 10 in prefill.early_claims, prefill, dec)
        deadline = time.monotonic() + QUIET_S
        while time.monotonic() < deadline:
            prefill.poll()
            assert not any(s.poll(10) for s in foreign), "a foreign peer got an answer"
        assert sorted(prefill.early_claims) == [10]
        dec.close()
    finally:
        ctx.destroy(linger=0)
        prefill.close()


def test_decode_hears_nothing_from_a_prefill_without_the_secret():
    """A "prefill" bootstrap service without the secret (plain zmq, or CURVE with other
    keys): the decode's handshake fails, so the foreign service never even sees the
    RouteQuery (it cannot answer, let alone push KV); the room stays unrouted."""
    ctx = zmq.Context()
    dec = KVManager("decode", pool(1), zmq_transport(pool(1)), 30, 30)
    try:
        for i, keys in enumerate((None, PeerKeys.from_secret(b"another secret of 32 bytes...."))):
            port = free_port()
            fake = ctx.socket(zmq.ROUTER)
            fake.linger = 0
            if keys is not None:
                keys.serve(fake)
            fake.bind(f"tcp://127.0.0.1:{port}")
            receiver = dec.create_receiver("127.0.0.1", port, 20 + i)
            deadline = time.monotonic() + QUIET_S
            while time.monotonic() < deadline:
                dec.poll()
                assert not fake.poll(10), "the foreign prefill received a message"
            assert receiver.poll() == KVPoll.Bootstrapping
    finally:
        dec.close()
        ctx.destroy(linger=0)


def test_an_oversized_frame_drops_the_connection():
    """A peer holding the secret that sends a frame one byte over the limit (the largest
    legitimate frame, ``KVBuffers.max_frame``) is disconnected (zmq.MAXMSGSIZE); nothing of
    it is delivered."""
    port = free_port()
    pbuf = pool(0)
    prefill = KVManager("prefill", pbuf, zmq_transport(pbuf, ("127.0.0.1", port)), 30, 30)
    ctx = zmq.Context()
    try:
        sock = ctx.socket(zmq.DEALER)
        sock.linger = 0
        KEYS.connect(sock)
        monitor = sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED)
        sock.connect(f"tcp://127.0.0.1:{prefill.transport.transfer_port}")
        assert _event(monitor) == zmq.EVENT_HANDSHAKE_SUCCEEDED
        sock.send(b"x" * (pbuf.max_frame() + 1))
        assert _event(monitor) == zmq.EVENT_DISCONNECTED
        prefill.poll()
        assert prefill.transport.inbox.empty() and not prefill.early_claims
        sock.disable_monitor()
        monitor.close()
    finally:
        ctx.destroy(linger=0)
        prefill.close()


def _event(monitor: zmq.Socket) -> int:
    assert monitor.poll(WAIT_S * 1000), "no socket event"
    return struct.unpack("=hi", monitor.recv_multipart()[0][:6])[0]


def zmtp_null_hello(sock: socket.socket) -> None:
    """ZMTP 3.0's greeting (NULL mechanism) and READY as a DEALER, by hand."""
    sock.sendall(b"\xff" + b"\0" * 8 + b"\x7f" + b"\x03\x00" + b"NULL".ljust(20, b"\0")
                 + b"\0" * 32)
    prop = b"\x0bSocket-Type" + struct.pack(">I", 6) + b"DEALER"
    body = b"\x05READY" + prop
    sock.sendall(b"\x04" + bytes([len(body)]) + body)


def closes_after_huge_frame(port: int) -> bool:
    """A raw TCP peer declares a 4 GiB frame: True if the server closes the connection."""
    with socket.create_connection(("127.0.0.1", port), timeout=QUIET_S * 10) as sock:
        try:
            zmtp_null_hello(sock)
            sock.sendall(b"\x02" + struct.pack(">Q", 4 << 30) + b"\0" * 4096)
            while sock.recv(65536):
                pass  # the server's greeting and READY
        except TimeoutError:
            return False  # still open, waiting for the rest of the 4 GiB
        except (BrokenPipeError, ConnectionResetError):
            pass
        return True


def test_kv_event_sockets_drop_a_declared_4_gib_frame():
    """The KV events publisher's replay ROUTER refuses a frame header that declares 4 GiB:
    the connection closes at the header, nothing is buffered."""
    from radixlm.runtime.kv_events_config import KVEventsConfig
    from radixlm.runtime.managers.scheduler.kv_event_publisher import KVEventPublisher

    pub, replay = free_port(), free_port()
    publisher = KVEventPublisher(KVEventsConfig(publisher="zmq",
                                                endpoint=f"tcp://127.0.0.1:{pub}",
                                                replay_endpoint=f"tcp://127.0.0.1:{replay}"))
    try:
        assert closes_after_huge_frame(replay)
    finally:
        publisher.shutdown()


def test_pd_bootstrap_port_drops_a_raw_peer():
    """A raw TCP peer on the bootstrap port (no CURVE, a 4 GiB frame header): closed."""
    port = free_port()
    pbuf = pool(0)
    prefill = KVManager("prefill", pbuf, zmq_transport(pbuf, ("127.0.0.1", port)), 30, 30)
    try:
        assert closes_after_huge_frame(port)
        assert closes_after_huge_frame(prefill.transport.transfer_port)
    finally:
        prefill.close()


def test_serve_pd_shares_a_fresh_secret(monkeypatch):
    """``radixlm serve-pd`` without a secret file: both servers get one it made (0600, in
    a 0700 directory), removed when it returns; one given in the flags is used as is."""
    from radixlm.runtime.disaggregation import launcher

    seen: list = []

    def fake_run(args, flags):
        path = flags[flags.index("--disaggregation-secret-file") + 1]
        seen.append((path, os.stat(path).st_mode & 0o777,
                     os.stat(os.path.dirname(path)).st_mode & 0o777, load_secret(path)))
        return 0

    monkeypatch.setattr(launcher, "_run", fake_run)
    assert launcher.run(None, ["--page-size", "4"]) == 0
    path, mode, dir_mode, key = seen[0]
    assert (mode, dir_mode, len(key)) == (0o600, 0o700, 64) and not os.path.exists(path)
    given = ["--disaggregation-secret-file=/etc/pd-key"]
    monkeypatch.setattr(launcher, "_run", lambda args, flags: seen.append(flags) or 0)
    launcher.run(None, given)
    assert seen[1] == given
