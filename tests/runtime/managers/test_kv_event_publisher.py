"""--kv-events-config: the zmq publisher's frames and replay protocol (vLLM's), the
subscriber's gap detection and replay, and real Engine / server streams rebuilt into a
PrefixIndex that equals the tree (after requests, eviction and a flush)."""

from __future__ import annotations

import dataclasses
import json
import time
from typing import Any

import httpx
import msgspec
import pytest
import zmq

from radixlm.radix_cache.kv_event_subscriber import KVEventSubscriber, ReplicaStream
from radixlm.radix_cache.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    chain_hashes,
)
from radixlm.radix_cache.prefix_index import PrefixIndex
from radixlm.radix_cache.radix_tree import RadixCache
from radixlm.runtime.config import ServerArgs
from radixlm.runtime.entrypoints.server_process import ServerProcess, free_port
from radixlm.runtime.kv_events_config import KVEventsConfig
from radixlm.runtime.managers.scheduler.kv_event_publisher import (
    KVEventPublisher,
    endpoint_for_rank,
    should_bind,
)

WAIT_S = 120.0  # a bound for "eventually", never a measured time


# vLLM's Structs (vllm/distributed/kv_events.py, array-like era), to prove wire compatibility
class VllmEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class VllmKVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False,
                       tag=True):
    pass


class VllmBlockStored(VllmKVCacheEvent, tag="BlockStored"):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None


class VllmBlockRemoved(VllmKVCacheEvent, tag="BlockRemoved"):
    block_hashes: list[int]
    medium: str | None


class VllmAllBlocksCleared(VllmKVCacheEvent, tag="AllBlocksCleared"):
    pass


class VllmKVEventBatch(VllmEventBatch):
    events: list[VllmBlockStored | VllmBlockRemoved | VllmAllBlocksCleared]


VLLM_DECODER = msgspec.msgpack.Decoder(VllmKVEventBatch)


def config(**extra: Any) -> KVEventsConfig:
    pub, replay = free_port(), free_port()
    return KVEventsConfig(publisher="zmq", endpoint=f"tcp://127.0.0.1:{pub}",
                          replay_endpoint=f"tcp://127.0.0.1:{replay}", **extra)


def stored(n: int) -> KVEventBatch:
    hashes = chain_hashes([n, n + 1], 1, None)
    return KVEventBatch(ts=float(n), events=[BlockStored(hashes, None, [n, n + 1], 1, None,
                                                         "CPU")])


def wait_until(pred, what: str, sub: KVEventSubscriber | None = None) -> None:
    """Poll ``sub`` until ``pred``; when the stream goes quiet first, ``catch_up`` (the last
    batch may be the dropped one, and no later one shows the gap)."""
    deadline = time.monotonic() + WAIT_S
    while not pred():
        assert time.monotonic() < deadline, f"never happened: {what}"
        if sub is None:
            time.sleep(0.01)
        elif not sub.poll(50):
            sub.catch_up()


class Dropping(KVEventSubscriber):
    """Discards the received messages whose positions (0-based) are in ``drop``."""

    def __init__(self, *args: Any, drop: set[int], **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.drop, self.received = drop, 0

    def handle(self, replica: int, frames: list[bytes]) -> None:
        self.received += 1
        if self.received - 1 not in self.drop:
            super().handle(replica, frames)


def subscribe_raw(cfg: KVEventsConfig) -> zmq.Socket:
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(cfg.endpoint)
    return sub


# ---- config and endpoints -------------------------------------------------------------------


def test_config_parsing_and_refusals() -> None:
    assert ServerArgs().kv_events() is None
    assert ServerArgs(kv_events_config='{"publisher": "null"}').kv_events() is None
    vllm = ServerArgs(kv_events_config='{"enable_kv_cache_events": true}').kv_events()
    assert vllm is not None and vllm.endpoint == "tcp://127.0.0.1:5557"
    sglang = ServerArgs(kv_events_config='{"publisher": "zmq", "topic": "kv"}').kv_events()
    assert sglang is not None and sglang.topic == "kv"
    off = '{"publisher": "zmq", "enable_kv_cache_events": false}'
    assert ServerArgs(kv_events_config=off).kv_events() is None
    for bad, words in [("nope", "not JSON"), ('{"hwm": 0}', "hwm must be >= 1"),
                       ('{"format": "dynamo"}', "unknown key"),
                       ('{"publisher": "kafka"}', "publisher must be"),
                       ('{"endpoint": "http://x:1"}', "endpoint must be"),
                       ('{"buffer_steps": "9"}', "buffer_steps must be int")]:
        with pytest.raises(ValueError, match=words):
            ServerArgs(kv_events_config=bad)


def test_endpoint_rules() -> None:
    assert endpoint_for_rank("tcp://*:5557", 0) == "tcp://*:5557"
    assert endpoint_for_rank("tcp://127.0.0.1:5557", 2) == "tcp://127.0.0.1:5559"
    assert endpoint_for_rank("ipc:///tmp/kv", 1) == "ipc:///tmp/kv_dp1"
    assert should_bind("tcp://*:5557", None) and should_bind("tcp://127.0.0.1:1", None)
    assert not should_bind("tcp://router.example:5557", None)
    assert should_bind("tcp://10.0.0.5:5557", True) and should_bind("ipc:///tmp/x", None)


# ---- publisher wire protocol -------------------------------------------------------------------


def test_frames_and_replay_follow_vllm_protocol() -> None:
    cfg = config(topic="kv")
    pub = KVEventPublisher(cfg, dp_rank=0)
    sub = subscribe_raw(cfg)
    try:
        # a SUB misses what is sent before it joined: publish until it hears something
        wait_until(lambda: pub.publish(stored(0)) >= 0 and sub.poll(20), "first message")
        topic, seq_bytes, payload = sub.recv_multipart()
        assert topic == b"kv" and len(seq_bytes) == 8
        batch = VLLM_DECODER.decode(payload)
        assert batch.data_parallel_rank == 0 and isinstance(batch.events[0], VllmBlockStored)
        assert batch.events[0].token_ids == [0, 1] and batch.events[0].medium == "CPU"
        last = pub.publish(stored(7))
        dealer = zmq.Context.instance().socket(zmq.DEALER)
        dealer.connect(cfg.replay_endpoint)
        dealer.send_multipart((b"", (1).to_bytes(8, "big")))
        replies = []
        while True:
            assert dealer.poll(int(WAIT_S * 1000)), "replay did not answer"
            replies.append(dealer.recv_multipart())
            if replies[-1][1] == (-1).to_bytes(8, "big", signed=True):
                break
        assert replies[-1] == [b"", (-1).to_bytes(8, "big", signed=True), b""]
        seqs = [int.from_bytes(r[1], "big") for r in replies[:-1]]
        assert seqs == list(range(1, last + 1))  # every batch from 1 on, in order
        assert VLLM_DECODER.decode(replies[-2][2]).events[0].token_ids == [7, 8]
        # vLLM's example client uses REQ: it reads the first reply
        req = zmq.Context.instance().socket(zmq.REQ)
        req.connect(cfg.replay_endpoint)
        req.send(last.to_bytes(8, "big"))
        assert req.poll(int(WAIT_S * 1000))
        seq_bytes, payload = req.recv_multipart()
        assert int.from_bytes(seq_bytes, "big") == last
        for sock in (dealer, req):
            sock.close(linger=0)
    finally:
        sub.close(linger=0)
        pub.shutdown()


def test_subscriber_fills_a_dropped_batch_from_replay() -> None:
    cfg = config()
    pub = KVEventPublisher(cfg, dp_rank=0)
    index = PrefixIndex(1, 1)
    sub = Dropping([ReplicaStream(cfg.endpoint, cfg.replay_endpoint)], index, drop={1})
    try:
        numbers = list(range(0, 40, 4))
        for n in numbers:
            pub.publish(stored(n))
        # a late joiner: what its SUB missed comes from replay at the first message it gets;
        # the second message it gets is discarded, and a later one shows the gap
        deadline = time.monotonic() + WAIT_S
        while sub.received < 3:
            assert time.monotonic() < deadline, "messages do not arrive"
            numbers.append(1000 + len(numbers))
            pub.publish(stored(numbers[-1]))
            sub.poll(50)
        wait_until(lambda: sub.poll(50) >= 0 and sub.next_seq[0] == pub.next_seq, "all")
        assert sub.lost == [0] and sub.replayed[0] >= 1
        expect = {h for n in numbers for h in chain_hashes([n, n + 1], 1, None)}
        assert index.blocks(0) == expect
        assert index.match([8, 9, 10]) == [2]
    finally:
        sub.close()
        pub.shutdown()


def test_gap_replay_cannot_fill_resets_the_replica() -> None:
    cfg = config(buffer_steps=2)
    pub = KVEventPublisher(cfg, dp_rank=0)
    raw = subscribe_raw(cfg)
    index = PrefixIndex(1, 1)
    sub = KVEventSubscriber([ReplicaStream(cfg.endpoint, cfg.replay_endpoint)], index)
    try:
        wait_until(lambda: pub.publish(stored(0)) >= 0 and raw.poll(20), "raw subscribed")
        for n in (50, 60, 70, 80, 90):
            pub.publish(stored(n))
        frames: list[list[bytes]] = []
        wait_until(lambda: frames.extend(_drain(raw)) or
                   int.from_bytes(frames[-1][1], "big") == pub.next_seq - 1, "all sent")
        first = frames[0]
        sub.next_seq[0] = int.from_bytes(first[1], "big")
        sub.handle(0, first)
        sub.handle(0, frames[-1])  # the ones between are lost; replay keeps the last 2 only
        assert sub.lost == [1] and sub.next_seq[0] == pub.next_seq
        # the replica's old blocks are forgotten, the last batch is in
        assert not index.blocks(0) & set(chain_hashes([0, 1], 1, None))
        assert index.match([90, 91]) == [2]
    finally:
        raw.close(linger=0)
        sub.close()
        pub.shutdown()


def _drain(sock: zmq.Socket) -> list[list[bytes]]:
    out = []
    while sock.poll(10):
        out.append(sock.recv_multipart())
    return out


# ---- a real Engine: index == tree after requests, eviction and flush --------------------------


def tree_blocks(tree: RadixCache) -> set[int]:
    out: set[int] = set()
    stack = [(child, []) for child in tree.root.children.values()]
    while stack:
        node, prefix = stack.pop()
        path = prefix + node.key
        out.update(chain_hashes(path, tree.page_size, node.namespace))
        stack.extend((c, path) for c in node.children.values())
    return out


@pytest.mark.parametrize("page_size", [1, 4])
def test_engine_stream_rebuilds_the_tree(page_size: int) -> None:
    from radixlm.runtime.entrypoints.engine.engine import Engine

    cfg = config()
    engine = Engine(max_total_tokens=192, page_size=page_size, random_seed=0,
                    kv_events_config=json.dumps(dataclasses.asdict(cfg)))
    publishers = engine._kv_publishers  # the Engine publishes as the server does
    assert len(publishers) == 1
    publisher = publishers[0]
    index = PrefixIndex(1, page_size)
    kinds: set[type] = set()
    sub = Dropping([ReplicaStream(publisher.endpoint, publisher.replay_endpoint)], index,
                   drop={2}, on_batch=lambda r, s, b: kinds.update(type(e) for e in b.events))
    tree = engine.scheduler.cache.tree

    def synced() -> None:
        sub.catch_up()  # a quiet stream: fetch what the last message did not show yet
        wait_until(lambda: sub.next_seq[0] == publisher.next_seq, "stream caught up", sub)
        assert index.blocks(0) == tree_blocks(tree)

    try:
        greedy = {"max_new_tokens": 6, "temperature": 0}
        base = list(range(3, 40))
        for i in range(4):
            engine.generate(input_ids=base + [50 + i] * 5, sampling_params=greedy)
        engine.generate(input_ids=base, sampling_params=greedy, cache_salt="tenant-b")
        synced()
        assert BlockStored in kinds and len(index.blocks(0)) > 0
        assert index.match(base + [50] * 5)[0] == tree.match_prefix(base + [50] * 5).prefix_len
        salted = {n.namespace for n in tree.root.children.values()} - {None}
        assert len(salted) == 1  # the cache_salt request's namespace (as the tree keys it)
        (ns,) = salted
        assert index.match(base, ns)[0] == tree.match_prefix(base, ns).prefix_len > 0
        for i in range(12):  # distinct prompts past the pool: eviction
            engine.generate(input_ids=[100 + i] * 40, sampling_params=greedy)
        synced()
        assert BlockRemoved in kinds
        assert engine.flush_cache()
        synced()
        assert AllBlocksCleared in kinds and index.blocks(0) == set()
        assert sub.replayed[0] >= 1 and sub.lost == [0]  # the dropped message came back
    finally:
        sub.close()
        engine.shutdown()  # stops the engine's publisher too


# ---- the server: events over zmq from the scheduler process -----------------------------------


def test_server_publishes_events(tmp_path) -> None:
    cfg = config()
    flags = ["--max-total-tokens", "256", "--random-seed", "0", "--log-level", "warning",
             "--kv-events-config", json.dumps(dataclasses.asdict(cfg))]
    srv = ServerProcess(flags, tmp_path / "server.log")
    index = PrefixIndex(1, 1)
    kinds: set[type] = set()
    sub = Dropping([ReplicaStream(cfg.endpoint, cfg.replay_endpoint)], index, drop={1},
                   on_batch=lambda r, s, b: kinds.update(type(e) for e in b.events))
    try:
        srv.wait_healthy()

        def gen(ids: list[int]) -> dict:
            body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 4,
                                                           "temperature": 0}}
            r = httpx.post(srv.url + "/generate", json=body, timeout=WAIT_S)
            assert r.status_code == 200, r.text
            return r.json()

        prompts = [[7, 8, 9, 10, 11, 12] + [20 + i] * 10 for i in range(3)]
        for p in prompts:
            gen(p)
            wait_until(lambda p=p: index.match(p)[0] == len(p), "the prompt's blocks", sub)
        # the index predicts the server's own cache hit
        probe = prompts[1][:12] + [99, 98, 97]
        predicted = index.match(probe)[0]
        assert predicted == 12
        assert gen(probe)["meta_info"]["cached_tokens"] == predicted
        for i in range(10):  # distinct prompts past the 256-token pool: eviction
            gen([200 + i] * 60)
        wait_until(lambda: BlockRemoved in kinds, "an eviction event", sub)
        wait_until(lambda: index.match([209] * 60)[0] == 60, "the last prompt", sub)
        assert len(index.blocks(0)) <= 256
        assert httpx.post(srv.url + "/flush_cache", timeout=WAIT_S).status_code == 200
        wait_until(lambda: AllBlocksCleared in kinds and not index.blocks(0), "flush", sub)
        assert sub.replayed[0] >= 1 and sub.lost == [0]
    finally:
        sub.close()
        assert srv.stop() == 0
