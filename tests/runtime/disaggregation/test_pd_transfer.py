"""The transfer state machine (fake transport, injected clock) and the zmq transport moving
pages bit for bit between two pools."""

from __future__ import annotations

import time

import pytest
import torch

from radixlm.runtime.disaggregation.auth import PeerKeys
from radixlm.runtime.disaggregation.base import KVPoll
from radixlm.runtime.disaggregation.fake_backend import FakeNetwork, FakeTransport
from radixlm.runtime.disaggregation.kv_buffers import KVBuffers
from radixlm.runtime.disaggregation.manager import KVManager
from radixlm.runtime.disaggregation.rooms import assign_rooms
from radixlm.runtime.disaggregation.wire import Abort, Claim
from radixlm.runtime.disaggregation.zmq_backend import ZmqTransport

PAGE, LAYERS, HEADS, DIM, POOL = 4, 3, 2, 8, 64
ADDR = ("prefill-host", 8998)
KEYS = PeerKeys.from_secret(b"a test secret of 32 bytes or more")


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def pool(seed: int, dtype: torch.dtype = torch.float32, device: str = "cpu") -> KVBuffers:
    g = torch.Generator().manual_seed(seed)
    k = [torch.randn(POOL, HEADS, DIM, generator=g).to(device, dtype) for _ in range(LAYERS)]
    v = [torch.randn(POOL, HEADS, DIM, generator=g).to(device, dtype) for _ in range(LAYERS)]
    return KVBuffers(k, v, PAGE)


def zmq_transport(buf: KVBuffers, *bootstrap) -> ZmqTransport:
    """A zmq transport holding the tests' secret; ``bootstrap``: (host, port)[, rank, size]."""
    return ZmqTransport(buf.layout, KEYS, buf.max_frame(), *bootstrap)


CUDA = pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA")])


def fake_pair(clock: Clock, bootstrap_timeout: float = 10, waiting_timeout: float = 20):
    net = FakeNetwork()
    pbuf, dbuf = pool(0), pool(1)
    prefill = KVManager("prefill", pbuf, FakeTransport(net, pbuf.layout, ADDR),
                        bootstrap_timeout, waiting_timeout, clock)
    dec = KVManager("decode", dbuf, FakeTransport(net), bootstrap_timeout, waiting_timeout,
                    clock)
    return net, prefill, dec


def turn(*managers: KVManager) -> None:
    for _ in range(3):
        for m in managers:
            m.poll()


def slots(*pages: int) -> torch.Tensor:
    return torch.cat([torch.arange(p * PAGE, (p + 1) * PAGE) for p in pages])


def test_happy_path_states_and_bits():
    clock = Clock()
    _, prefill, dec = fake_pair(clock)
    sender = prefill.create_sender(7)
    receiver = dec.create_receiver(*ADDR, 7)
    assert sender.poll() == KVPoll.Bootstrapping
    turn(prefill, dec)
    assert receiver.poll() == KVPoll.WaitingForInput  # route known
    dst = slots(9, 3)
    receiver.send_metadata(dst, prefix_len=4, prompt_len=11)
    turn(prefill, dec)
    assert sender.poll() == KVPoll.WaitingForInput and sender.decode_prefix_len == 4
    src = slots(5, 6)
    sender.send(src, first_token=42, prompt_len=11)
    assert sender.poll() == KVPoll.Transferring
    turn(prefill, dec)
    assert receiver.poll() == KVPoll.Success and receiver.first_token == 42
    assert sender.poll() == KVPoll.Success
    for layer in range(LAYERS):
        assert torch.equal(dec.buffers.k[layer][dst], prefill.buffers.k[layer][src])
        assert torch.equal(dec.buffers.v[layer][dst], prefill.buffers.v[layer][src])


def test_claim_before_request_is_kept():
    clock = Clock()
    _, prefill, dec = fake_pair(clock)
    receiver = dec.create_receiver(*ADDR, 1)
    turn(prefill, dec)
    receiver.send_metadata(slots(0), 0, 3)
    turn(prefill, dec)
    sender = prefill.create_sender(1)  # the request reaches the prefill after the claim
    assert sender.poll() == KVPoll.WaitingForInput


def test_unclaimed_room_times_out_on_prefill():
    clock = Clock()
    _, prefill, _ = fake_pair(clock)
    sender = prefill.create_sender(3)
    clock.t = 9.9
    prefill.poll()
    assert sender.poll() == KVPoll.Bootstrapping
    clock.t = 10.1
    prefill.poll()
    assert sender.poll() == KVPoll.Failed and "no decode server claimed" in \
        sender.failure_reason()


def test_claim_for_a_request_that_never_comes_is_aborted():
    clock = Clock()
    _, prefill, dec = fake_pair(clock)
    receiver = dec.create_receiver(*ADDR, 4)
    turn(prefill, dec)
    receiver.send_metadata(slots(0), 0, 3)
    turn(prefill, dec)
    clock.t = 10.5
    turn(prefill, dec)
    assert receiver.poll() == KVPoll.Failed
    assert "no request with this bootstrap_room" in receiver.failure_reason()


def test_unreachable_prefill_fails_after_bootstrap_timeout():
    clock = Clock()
    _, _, dec = fake_pair(clock)
    receiver = dec.create_receiver("nowhere", 1, 5)
    clock.t = 11
    dec.poll()
    assert receiver.poll() == KVPoll.Failed and "bootstrap" in receiver.failure_reason()
    assert not dec.routes  # the next request asks again


def test_kv_cache_dtype_mismatch_fails_naming_the_flag():
    """A bfloat16 prefill pool and a float8 decode pool cannot copy slot for slot."""
    net = FakeNetwork()
    pbuf = pool(0, torch.bfloat16)
    dbuf = pool(1, torch.float8_e5m2)
    prefill = KVManager("prefill", pbuf, FakeTransport(net, pbuf.layout, ADDR), 10, 20, Clock())
    dec = KVManager("decode", dbuf, FakeTransport(net), 10, 20, Clock())
    prefill.create_sender(6)
    receiver = dec.create_receiver(*ADDR, 6)
    turn(prefill, dec)
    assert receiver.poll() == KVPoll.Failed
    why = receiver.failure_reason()
    assert "--kv-cache-dtype" in why and "bfloat16" in why and "float8_e5m2" in why
    assert not dec.routes


def test_decode_dies_mid_transfer_prefill_times_out():
    clock = Clock()
    net, prefill, dec = fake_pair(clock)
    sender, receiver = prefill.create_sender(8), dec.create_receiver(*ADDR, 8)
    turn(prefill, dec)
    receiver.send_metadata(slots(1), 0, 4)
    turn(prefill, dec)
    net.drop(dec.transport)  # its acks and everything else vanish
    sender.send(slots(2), 5, 4)
    turn(prefill, dec)
    assert sender.poll() == KVPoll.Transferring
    clock.t = 20.5
    prefill.poll()
    assert sender.poll() == KVPoll.Failed and "waiting timeout" in sender.failure_reason()


def test_prefill_never_sends_decode_times_out():
    clock = Clock()
    _, prefill, dec = fake_pair(clock)
    prefill.create_sender(9)
    receiver = dec.create_receiver(*ADDR, 9)
    turn(prefill, dec)
    receiver.send_metadata(slots(1), 0, 4)
    clock.t = 20.5
    turn(prefill, dec)
    assert receiver.poll() == KVPoll.Failed and "sent no KV" in receiver.failure_reason()
    assert ADDR not in dec.routes  # a restarted prefill is asked for its endpoint again
    again = dec.create_receiver(*ADDR, 10)
    turn(prefill, dec)
    assert again.poll() == KVPoll.WaitingForInput


@pytest.mark.parametrize("side", ["prefill", "decode"])
def test_abort_reaches_the_other_side(side):
    clock = Clock()
    net, prefill, dec = fake_pair(clock)
    sender, receiver = prefill.create_sender(2), dec.create_receiver(*ADDR, 2)
    turn(prefill, dec)
    receiver.send_metadata(slots(1), 0, 4)
    turn(prefill, dec)
    (sender if side == "prefill" else receiver).abort("client went away")
    turn(prefill, dec)
    assert sender.poll() == receiver.poll() == KVPoll.Failed
    other = receiver if side == "prefill" else sender
    assert "client went away" in other.failure_reason()
    assert any(isinstance(m, Abort) for m in net.log)


def test_mismatched_claim_fails_both():
    clock = Clock()
    _, prefill, dec = fake_pair(clock)
    sender, receiver = prefill.create_sender(6), dec.create_receiver(*ADDR, 6)
    turn(prefill, dec)
    receiver.send_metadata(slots(1), 0, 4)
    turn(prefill, dec)
    sender.send(slots(1, 2), 5, 7)  # a different prompt length
    turn(prefill, dec)
    assert sender.poll() == receiver.poll() == KVPoll.Failed
    assert "tokenized differently" in receiver.failure_reason()


def test_bad_chunk_is_refused_not_written():
    clock = Clock()
    _, prefill, dec = fake_pair(clock)
    receiver = dec.create_receiver(*ADDR, 11)
    turn(prefill, dec)
    before = dec.buffers.k[0].clone()
    receiver.send_metadata(slots(1), 0, 4)
    from radixlm.runtime.disaggregation.transport import Event
    from radixlm.runtime.disaggregation.wire import KVChunk
    dec.transport.deliver(Event(ADDR, KVChunk(11, 0, PAGE, True, 1), [torch.zeros(3)]))
    dec.poll()
    assert receiver.poll() == KVPoll.Failed and "frames" in receiver.failure_reason()
    assert torch.equal(dec.buffers.k[0], before)


def test_duplicate_room_fails_the_second():
    clock = Clock()
    _, prefill, _ = fake_pair(clock)
    prefill.create_sender(1)
    assert prefill.create_sender(1).poll() == KVPoll.Failed


def test_assign_rooms():
    out = assign_rooms("h", None, 5, [3], 8998)
    assert [b.room for b in out[0]] == [5, 6, 7] and out[0][0].port == 8998
    out = assign_rooms(["a", "b"], [1, 2], [10, 20], [1, 2], 8998)
    assert [(b.host, b.port, b.room) for b in out[1]] == [("b", 2, 20), ("b", 2, 21)]
    out = assign_rooms("h", 9, [4, 8], [2], 8998)  # chat n=2: one room per choice
    assert [b.room for b in out[0]] == [4, 8]
    assert assign_rooms("h", 9, 2**63 - 1, [2], 1)[0][1].room == 0
    for bad in ({"room": -1}, {"room": 2**63}, {"room": [1, 2, 3]}, {"port": 0},
                {"host": ""}, {"room": "1"}):
        args = {"host": "h", "port": 9, "room": 1, **bad}
        with pytest.raises(ValueError, match="bootstrap_"):
            assign_rooms(args["host"], args["port"], args["room"], [2], 1)


@pytest.mark.parametrize("device", ["cpu", CUDA])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e5m2,
                                   torch.float8_e4m3fn])
def test_zmq_moves_pages_bit_for_bit(dtype, device):
    """Two managers over real TCP sockets on loopback; several chunks (small CHUNK_BYTES)."""
    import radixlm.runtime.disaggregation.kv_buffers as kv_buffers
    from radixlm.runtime.entrypoints.server_process import free_port

    port = free_port()
    pbuf, dbuf = pool(0, dtype, device), pool(1, dtype, device)
    prefill = KVManager("prefill", pbuf, zmq_transport(pbuf, ("127.0.0.1", port)), 30, 30)
    dec = KVManager("decode", dbuf, zmq_transport(dbuf), 30, 30)
    old = kv_buffers.CHUNK_BYTES
    kv_buffers.CHUNK_BYTES = 1  # one page per chunk
    try:
        sender = prefill.create_sender(123)
        receiver = dec.create_receiver("127.0.0.1", port, 123)
        _until(lambda: receiver.poll() == KVPoll.WaitingForInput, prefill, dec)
        dst = slots(10, 2, 7)
        receiver.send_metadata(dst, 0, 11)
        _until(lambda: sender.poll() == KVPoll.WaitingForInput, prefill, dec)
        src = slots(1, 4, 12)
        sender.send(src, 99, 11)
        _until(lambda: sender.poll() == KVPoll.Success, prefill, dec)
        assert receiver.poll() == KVPoll.Success and receiver.first_token == 99
        for layer in range(LAYERS):
            assert torch.equal(dbuf.k[layer][dst], pbuf.k[layer][src])
            assert torch.equal(dbuf.v[layer][dst], pbuf.v[layer][src])
        untouched = torch.ones(POOL, dtype=torch.bool)
        untouched[dst] = False
        assert torch.equal(dbuf.k[0][untouched.to(device)],
                           pool(1, dtype, device).k[0][untouched.to(device)])
    finally:
        kv_buffers.CHUNK_BYTES = old
        prefill.close()
        dec.close()


def test_zmq_decode_gone_fails_the_sender():
    """A decode server whose sockets closed: the prefill's send fails (or times out)."""
    from radixlm.runtime.entrypoints.server_process import free_port

    port = free_port()
    pbuf, dbuf = pool(0), pool(1)
    prefill = KVManager("prefill", pbuf, zmq_transport(pbuf, ("127.0.0.1", port)), 30, 2)
    dec = KVManager("decode", dbuf, zmq_transport(dbuf), 30, 30)
    try:
        sender = prefill.create_sender(5)
        receiver = dec.create_receiver("127.0.0.1", port, 5)
        _until(lambda: receiver.poll() == KVPoll.WaitingForInput, prefill, dec)
        receiver.send_metadata(slots(1), 0, 3)
        _until(lambda: sender.poll() == KVPoll.WaitingForInput, prefill, dec)
        dec.close()
        time.sleep(0.2)  # let the disconnect reach the ROUTER (the outcome does not hinge on it)
        sender.send(slots(2), 1, 3)
        _until(lambda: sender.poll() == KVPoll.Failed, prefill)
        assert isinstance(sender.claim, Claim)
    finally:
        prefill.close()


def _until(cond, *managers: KVManager, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not reached"
        for m in managers:
            m.poll()
        time.sleep(0.005)


def test_zmq_two_prefill_replicas_share_one_bootstrap_port():
    """A prefill server with --dp-size 2: replica 1 registers its transfer port with replica
    0's bootstrap service (here before replica 0 exists), the decode side asks once, and
    each room's pages come from replica room mod 2 (room 50: from replica 1, which
    disagg_prefill_dp_rank names), bit for bit; a replica the server lacks fails the room."""
    from radixlm.runtime.entrypoints.server_process import free_port

    port = free_port()
    bufs = [pool(0), pool(2)]
    dbuf = pool(1)
    late = KVManager("prefill", bufs[1], zmq_transport(bufs[1], ("127.0.0.1", port), 1, 2),
                     30, 30)
    first = KVManager("prefill", bufs[0], zmq_transport(bufs[0], ("127.0.0.1", port), 0, 2),
                      30, 30)
    replicas = [first, late]
    dec = KVManager("decode", dbuf, zmq_transport(dbuf), 30, 30)
    try:
        rooms = {40: slots(3), 41: slots(5, 6), 50: slots(7)}
        where = {40: 0, 41: 1, 50: 1}
        senders = {room: replicas[where[room]].create_sender(room) for room in rooms}
        receivers = {room: dec.create_receiver("127.0.0.1", port, room,
                                               1 if room == 50 else None) for room in rooms}
        missing = dec.create_receiver("127.0.0.1", port, 60, 2)
        _until(lambda: all(r.poll() == KVPoll.WaitingForInput for r in receivers.values()),
               *replicas, dec)
        assert missing.poll() == KVPoll.Failed and "runs 2 replica(s)" in missing.reason
        for room, dst in rooms.items():
            receivers[room].send_metadata(dst, 0, len(dst))
        _until(lambda: all(s.poll() == KVPoll.WaitingForInput for s in senders.values()),
               *replicas, dec)
        src = {40: slots(9), 41: slots(1, 2), 50: slots(4)}
        for room in rooms:
            senders[room].send(src[room], room + 1000, len(src[room]))
        _until(lambda: all(s.poll() == KVPoll.Success for s in senders.values()), *replicas, dec)
        for room, dst in rooms.items():
            assert receivers[room].poll() == KVPoll.Success
            assert receivers[room].first_token == room + 1000
            for layer in range(LAYERS):
                assert torch.equal(dbuf.k[layer][dst], bufs[where[room]].k[layer][src[room]])
                assert torch.equal(dbuf.v[layer][dst], bufs[where[room]].v[layer][src[room]])
        assert first.sent_tokens == len(src[40])
        assert late.sent_tokens == len(src[41]) + len(src[50])
    finally:
        for m in (*replicas, dec):
            m.close()


def test_zmq_bootstrap_answers_once_every_replica_registered():
    """Until replica 1 of 2 registers, the decode side gets no route (rather than a route
    without that replica's port); once it registers, the waiting query is answered."""
    from radixlm.runtime.entrypoints.server_process import free_port

    port = free_port()
    pbuf, dbuf = pool(0), pool(1)
    only = KVManager("prefill", pbuf, zmq_transport(pbuf, ("127.0.0.1", port), 0, 2),
                     30, 30)
    dec = KVManager("decode", dbuf, zmq_transport(dbuf), 30, 30)
    try:
        receiver = dec.create_receiver("127.0.0.1", port, 8)
        for _ in range(40):
            only.poll()
            dec.poll()
            time.sleep(0.005)
        assert receiver.poll() == KVPoll.Bootstrapping
        late = zmq_transport(pbuf, ("127.0.0.1", port), 1, 2)
        try:
            _until(lambda: receiver.poll() == KVPoll.WaitingForInput, only, dec)
        finally:
            late.close()
    finally:
        only.close()
        dec.close()
