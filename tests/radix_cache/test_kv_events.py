"""KV events: the tree's events rebuild its set of blocks exactly (PrefixIndex as the
consumer, hashes recomputed from the tree's own pages as the oracle), splits say nothing,
namespaces never collide, and the bytes decode with vLLM's own Struct definitions."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from radixlm.radix_cache.allocator import PagedAllocator
from radixlm.radix_cache.kv_events import (
    MEDIUM_DISK,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    KVEventRecorder,
    block_hash,
    chain_hashes,
    decode_batch,
    encode_batch,
)
from radixlm.radix_cache.prefix_index import PrefixIndex
from radixlm.radix_cache.radix_tree import RadixCache

# ---- vLLM's Structs, written out from vllm/distributed/kv_events.py (array-like era) ----


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


# vLLM's example subscriber before `medium` and `data_parallel_rank` were added
class OldBlockStored(msgspec.Struct, array_like=True, tag="BlockStored"):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None


class OldBlockRemoved(msgspec.Struct, array_like=True, tag="BlockRemoved"):
    block_hashes: list[int]


class OldAllBlocksCleared(msgspec.Struct, array_like=True, tag="AllBlocksCleared"):
    pass


class OldKVEventBatch(msgspec.Struct, array_like=True):
    ts: float
    events: list[OldBlockStored | OldBlockRemoved | OldAllBlocksCleared]


# ---- helpers ----------------------------------------------------------------------------


def make(page_size: int, size: int = 256) -> tuple[PagedAllocator, RadixCache, KVEventRecorder]:
    alloc = PagedAllocator(size, page_size)
    rec = KVEventRecorder(page_size)
    return alloc, RadixCache(alloc, page_size, events=rec), rec


def insert(tree: RadixCache, alloc: PagedAllocator, tokens: list[int],
           namespace: str | None = None) -> None:
    ps = tree.page_size
    slots = alloc.alloc(-(-len(tokens) // ps) * ps)
    assert slots is not None
    prefix_len = tree.insert(tokens, slots, namespace)
    aligned = len(tokens) - len(tokens) % ps
    pos = torch.arange(slots.numel())
    alloc.free(slots[(pos < prefix_len) | (pos >= aligned)])


def oracle_blocks(tree: RadixCache) -> set[int]:
    """Hashes of every page of the tree, computed from root paths (not the stored hashes)."""
    out: set[int] = set()
    stack = [(child, []) for child in tree.root.children.values()]
    while stack:
        node, prefix = stack.pop()
        path = prefix + node.key
        out.update(chain_hashes(path, tree.page_size, node.namespace))
        stack.extend((c, path) for c in node.children.values())
    return out


def flush_to(index: PrefixIndex, replica: int, rec: KVEventRecorder) -> None:
    """Publish like the scheduler: one batch per step, through the wire bytes."""
    batch = rec.take_batch(data_parallel_rank=replica)
    if batch is not None:
        index.apply(replica, decode_batch(encode_batch(batch)))


# ---- unit tests ---------------------------------------------------------------------------


def test_hash_is_deterministic_chained_and_namespaced() -> None:
    h = block_hash(None, [1, 2], None)
    assert h == block_hash(None, [1, 2], None) and 0 <= h < 2**64
    assert h != block_hash(None, [1, 2], "tenant-a")
    assert block_hash(h, [3, 4], None) != block_hash(None, [3, 4], None)
    assert chain_hashes([1, 2, 3, 4, 5], 2, None) == [h, block_hash(h, [3, 4], None)]
    # a fixed value: the hash must not depend on the process (no Python hash())
    assert block_hash(None, [1, 2, 3], "ns") == block_hash(None, (1, 2, 3), "ns")


def test_insert_stores_blocks_chained_to_parent() -> None:
    alloc, tree, rec = make(page_size=2)
    insert(tree, alloc, [1, 2, 3, 4, 5])  # the odd token is not cached
    insert(tree, alloc, [1, 2, 3, 4, 7, 8])
    first, second = rec.take()
    assert isinstance(first, BlockStored) and isinstance(second, BlockStored)
    assert first.token_ids == [1, 2, 3, 4] and first.parent_block_hash is None
    assert first.block_hashes == chain_hashes([1, 2, 3, 4], 2, None)
    assert second.token_ids == [7, 8] and second.parent_block_hash == first.block_hashes[-1]
    assert second.block_hashes == chain_hashes([1, 2, 3, 4, 7, 8], 2, None)[2:]
    assert first.block_size == 2 and first.medium == "GPU"


def test_split_records_nothing_and_keeps_hashes() -> None:
    alloc, tree, rec = make(page_size=1)
    insert(tree, alloc, [1, 2, 3, 4, 5, 6])
    rec.take()
    before = oracle_blocks(tree)
    tree.match_prefix([1, 2, 3, 9])  # splits [1..6] after 3
    assert rec.take() == []
    assert len(tree.root.children[(None, 1)].children) == 1  # it did split
    tree.check_integrity()  # stored hashes still chain
    assert oracle_blocks(tree) == before
    insert(tree, alloc, [1, 2, 3, 9])
    (stored,) = rec.take()
    assert stored.token_ids == [9]
    assert stored.parent_block_hash == chain_hashes([1, 2, 3], 1, None)[-1]


def test_evict_and_reset_events() -> None:
    alloc, tree, rec = make(page_size=1)
    insert(tree, alloc, [1, 2, 3])
    insert(tree, alloc, [5, 6])
    rec.take()
    assert tree.evict(2) == 3  # the least recently used leaf first: [1, 2, 3]
    (removed,) = rec.take()
    assert isinstance(removed, BlockRemoved)
    assert removed.block_hashes == chain_hashes([1, 2, 3], 1, None)
    tree.reset()
    assert rec.take() == [AllBlocksCleared()]


def test_same_tokens_in_two_namespaces_never_collide() -> None:
    alloc, tree, rec = make(page_size=1)
    insert(tree, alloc, [1, 2, 3], "a")
    insert(tree, alloc, [1, 2, 3], "b")
    index = PrefixIndex(1, 1)
    flush_to(index, 0, rec)
    assert len(index.blocks(0)) == 6
    tree.evict(3)  # one namespace's copy goes
    flush_to(index, 0, rec)
    left = "b" if index.match([1, 2, 3], "a") == [0] else "a"
    assert index.match([1, 2, 3], left) == [3]
    assert index.blocks(0) == oracle_blocks(tree)


def test_disabled_tree_records_nothing() -> None:
    alloc = PagedAllocator(64, 1)
    rec = KVEventRecorder(1)
    tree = RadixCache(alloc, 1, disable=True, events=rec)
    tree.insert([1, 2, 3], alloc.alloc(3))
    assert rec.take() == [] and rec.take_batch() is None


def test_prefix_index_match_per_replica() -> None:
    trees = [make(page_size=2) for _ in range(3)]
    index = PrefixIndex(3, 2)
    insert(trees[0][1], trees[0][0], [1, 2, 3, 4, 5, 6])
    insert(trees[1][1], trees[1][0], [1, 2, 9, 9])
    for r, (_, _, rec) in enumerate(trees):
        flush_to(index, r, rec)
    assert index.match([1, 2, 3, 4, 5]) == [4, 2, 0]
    assert index.match([1, 2, 3, 4, 5, 6, 7]) == [6, 2, 0]
    assert index.match([1, 2, 3, 4], "tenant") == [0, 0, 0]
    assert index.match([1]) == [0, 0, 0]
    index.drop_replica(0)
    assert index.match([1, 2, 3, 4]) == [0, 2, 0] and index.blocks(0) == set()


def test_prefix_index_keeps_storage_blocks_for_every_replica() -> None:
    """Blocks stored with medium DISK (the shared storage tier) match for any replica,
    through match_storage; a replica's flush keeps them, a DISK removal drops them."""
    index = PrefixIndex(2, 2)
    hashes = chain_hashes([1, 2, 3, 4], 2, None)
    disk = BlockStored(hashes, None, [1, 2, 3, 4], 2, None, MEDIUM_DISK)
    index.apply(1, KVEventBatch(ts=0.0, events=[disk, AllBlocksCleared()]))
    assert index.match([1, 2, 3, 4, 5]) == [0, 0]
    assert index.match_storage([1, 2, 3, 4, 5]) == 4
    assert index.match_storage([1, 2, 3, 4], "tenant") == 0
    assert index.match_storage([1, 2, 7, 7]) == 2
    index.apply(0, KVEventBatch(ts=0.0, events=[BlockRemoved(hashes[1:], MEDIUM_DISK)]))
    assert index.match_storage([1, 2, 3, 4]) == 2


def test_prefix_index_refuses_another_block_size() -> None:
    alloc, tree, rec = make(page_size=2)
    insert(tree, alloc, [1, 2])
    with pytest.raises(ValueError, match="blocks of 2 tokens"):
        PrefixIndex(1, 4).apply(0, rec.take_batch())


def test_wire_format_decodes_with_vllm_structs() -> None:
    alloc, tree, rec = make(page_size=2)
    insert(tree, alloc, [1, 2, 3, 4])
    tree.evict(4)
    tree.reset()
    batch = rec.take_batch(data_parallel_rank=3)
    payload = encode_batch(batch)
    raw = msgspec.msgpack.decode(payload)
    assert raw[0] == batch.ts and raw[2] == 3
    assert raw[1][0][0] == "BlockStored" and raw[1][1][0] == "BlockRemoved"
    assert raw[1][2] == ["AllBlocksCleared"]
    vllm = msgspec.msgpack.Decoder(VllmKVEventBatch).decode(payload)
    stored, removed, cleared = vllm.events
    assert isinstance(stored, VllmBlockStored) and isinstance(cleared, VllmAllBlocksCleared)
    assert stored.block_hashes == chain_hashes([1, 2, 3, 4], 2, None)
    assert (stored.parent_block_hash, stored.token_ids, stored.block_size) == (None, [1, 2, 3, 4],
                                                                             2)
    assert (stored.lora_id, stored.medium) == (None, "GPU")
    assert isinstance(removed, VllmBlockRemoved) and removed.block_hashes == stored.block_hashes
    assert vllm.data_parallel_rank == 3
    old = msgspec.msgpack.Decoder(OldKVEventBatch).decode(payload)
    assert old.events[0].block_hashes == stored.block_hashes
    assert isinstance(old.events[2], OldAllBlocksCleared)
    assert decode_batch(payload) == batch
    assert isinstance(decode_batch(payload), KVEventBatch)


# ---- stateful: random inserts / matches / evictions / resets over replicas -----------------


class EventMachine(RuleBasedStateMachine):
    """Two replicas (trees) with events; a PrefixIndex fed batch by batch must hold exactly
    each tree's pages, and its match must equal the tree's own match_prefix."""

    page_size = 1
    vocab = st.integers(0, 3)
    namespaces = st.sampled_from([None, "a", "b"])

    @initialize()
    def setup(self) -> None:
        self.replicas = [make(self.page_size, size=48 * self.page_size) for _ in range(2)]
        self.index = PrefixIndex(2, self.page_size)

    def _tokens(self, data: st.DataObject) -> list[int]:
        return data.draw(st.lists(self.vocab, min_size=0, max_size=6 * self.page_size))

    @rule(data=st.data(), r=st.integers(0, 1), ns=namespaces)
    def insert(self, data: st.DataObject, r: int, ns: str | None) -> None:
        alloc, tree, _ = self.replicas[r]
        tokens = self._tokens(data)
        need = -(-len(tokens) // self.page_size) * self.page_size
        if alloc.available_size() < need:
            tree.evict(need - alloc.available_size())
        insert(tree, alloc, tokens, ns)

    @rule(data=st.data(), r=st.integers(0, 1), ns=namespaces)
    def match(self, data: st.DataObject, r: int, ns: str | None) -> None:
        self.replicas[r][1].match_prefix(self._tokens(data), ns)  # may split

    @rule(r=st.integers(0, 1), n=st.integers(1, 12))
    def evict(self, r: int, n: int) -> None:
        self.replicas[r][1].evict(n)

    @rule(r=st.integers(0, 1))
    def reset(self, r: int) -> None:
        self.replicas[r][1].reset()

    @rule(data=st.data(), r=st.integers(0, 1), ns=namespaces)
    def reset_then_insert(self, data: st.DataObject, r: int, ns: str | None) -> None:
        self.reset(r)  # one batch: AllBlocksCleared, then BlockStored
        self.insert(data, r, ns)

    @rule(data=st.data(), ns=namespaces)
    def compare_match(self, data: st.DataObject, ns: str | None) -> None:
        tokens = self._tokens(data)
        expect = [tree.match_prefix(tokens, ns).prefix_len for _, tree, _ in self.replicas]
        assert self.index.match(tokens, ns) == expect

    @invariant()
    def index_equals_tree(self) -> None:
        """After each step's batch, the index holds exactly the hashes of the tree's pages."""
        for r, (_, tree, rec) in enumerate(self.replicas):
            tree.check_integrity()
            flush_to(self.index, r, rec)
            assert self.index.blocks(r) == oracle_blocks(tree)


class EventMachinePaged(EventMachine):
    page_size = 4
    vocab = st.integers(0, 1)


TestEvents = EventMachine.TestCase
TestEvents.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)
TestEventsPaged = EventMachinePaged.TestCase
TestEventsPaged.settings = settings(max_examples=40, stateful_step_count=30, deadline=None)
