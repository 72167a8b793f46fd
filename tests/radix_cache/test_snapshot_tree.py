"""The radix tree's recurrent-state snapshots (snapshot_tree.py): a match cut back to the
deepest snapshot, splits keeping a snapshot with the node whose end it describes, snapshot
LRU eviction that spares locked nodes, K/V eviction freeing a leaf's snapshot, reset, and
check_integrity catching a leaked or doubly held slot."""

from __future__ import annotations

import pytest
import torch

from radixlm.radix_cache.allocator import PagedAllocator
from radixlm.radix_cache.radix_tree import RadixCache
from radixlm.radix_cache.state_pool import StateSlots


def make(page_size: int = 1, budget: int = 4) -> tuple[PagedAllocator, StateSlots, RadixCache]:
    alloc = PagedAllocator(256, page_size)
    states = StateSlots(8)
    return alloc, states, RadixCache(alloc, page_size, states=states, snapshot_budget=budget)


def insert(tree: RadixCache, alloc: PagedAllocator, tokens: list[int]) -> None:
    """Insert with fresh slots as a caller would; free what the tree did not take."""
    ps = tree.page_size
    slots = alloc.alloc(-(-len(tokens) // ps) * ps)
    assert slots is not None
    p = tree.insert(tokens, slots)
    pos = torch.arange(slots.numel())
    alloc.free(slots[(pos < p) | (pos >= len(tokens) - len(tokens) % ps)])


def snapshot_at(tree: RadixCache, states: StateSlots, tokens: list[int]) -> int:
    """Give a fresh state slot to the node ending after ``tokens``."""
    m = tree.match_prefix(tokens, raw=True)
    assert m.prefix_len == len(tokens)
    slot = states.alloc()
    assert slot is not None and tree.attach_snapshot(m.last_node, slot)
    return slot


def test_match_is_cut_back_to_the_deepest_snapshot():
    alloc, states, tree = make()
    seq = list(range(1, 41))
    insert(tree, alloc, seq)
    assert tree.match_prefix(seq).prefix_len == 0  # K/V without a state: nothing reused
    assert tree.match_prefix(seq, raw=True).prefix_len == 40
    s16 = snapshot_at(tree, states, seq[:16])  # splits the node at 16
    m = tree.match_prefix(seq + [99])
    assert m.prefix_len == 16 and m.last_node.snapshot == s16
    torch.testing.assert_close(m.slots, tree.match_prefix(seq[:16], raw=True).slots)
    s40 = snapshot_at(tree, states, seq)
    assert tree.match_prefix(seq + [99]).last_node.snapshot == s40
    assert tree.match_prefix(seq[:30] + [7, 7]).prefix_len == 16  # diverges below 16's
    tree.check_integrity()


def test_split_keeps_the_snapshot_with_the_lower_node():
    alloc, states, tree = make(page_size=4)
    seq = list(range(1, 33))
    insert(tree, alloc, seq)
    slot = snapshot_at(tree, states, seq)
    node = tree.match_prefix(seq).last_node
    # a diverging insert splits the node at 12: the upper part ends at 12, without a state
    insert(tree, alloc, seq[:12] + [500] * 8)
    upper = tree.match_prefix(seq[:12], raw=True).last_node
    assert upper is not node and upper.snapshot is None
    assert node.snapshot == slot and tree.match_prefix(seq + [1]).prefix_len == 32
    assert tree.match_prefix(seq[:12] + [500] * 8).prefix_len == 0
    tree.check_integrity()


def test_snapshot_eviction_is_lru_and_spares_locked_nodes():
    alloc, states, tree = make()
    seqs = [[k] * 8 + list(range(10 * k, 10 * k + 8)) for k in (1, 2, 3)]
    for s in seqs:
        insert(tree, alloc, s)
    slots = [snapshot_at(tree, states, s) for s in seqs]
    tree.match_prefix(seqs[0])  # 0 is now the most recently used
    locked = tree.match_prefix(seqs[1]).last_node
    tree.inc_lock_ref(locked)
    assert tree.evict_snapshots(3) == 2  # 2, then 0; 1 is locked
    assert states.is_free(slots[2]) and states.is_free(slots[0])
    assert not states.is_free(slots[1]) and tree.num_snapshots() == 1
    assert tree.match_prefix(seqs[0]).prefix_len == 0  # its K/V stays, unusable
    tree.dec_lock_ref(locked)
    tree.check_integrity()


def test_kv_eviction_frees_snapshots_and_takes_stateless_leaves_first():
    alloc, states, tree = make()
    a, b = [1] * 8 + [2] * 8, [3] * 16
    insert(tree, alloc, a)
    insert(tree, alloc, b)
    slot = snapshot_at(tree, states, a)
    tree.match_prefix(b, raw=True)  # b is more recent, but has no snapshot
    assert tree.evict(16) == 16
    assert tree.match_prefix(a + [1]).prefix_len == 16  # b went, not a
    assert tree.evict(16) == 16
    assert states.is_free(slot) and tree.num_snapshots() == 0
    tree.check_integrity()


def test_reset_frees_every_snapshot():
    alloc, states, tree = make()
    insert(tree, alloc, list(range(1, 20)))
    snapshot_at(tree, states, list(range(1, 10)))
    snapshot_at(tree, states, list(range(1, 20)))
    tree.reset()
    assert states.available_size() == 8 and tree.num_snapshots() == 0
    tree.check_integrity()


def test_attach_refuses_a_second_snapshot_and_the_root():
    alloc, states, tree = make()
    insert(tree, alloc, list(range(1, 9)))
    snapshot_at(tree, states, list(range(1, 9)))
    node = tree.match_prefix(list(range(1, 9))).last_node
    other = states.alloc()
    assert not tree.attach_snapshot(node, other)
    assert not tree.attach_snapshot(tree.root, other)


def test_check_integrity_catches_snapshot_faults():
    alloc, states, tree = make()
    insert(tree, alloc, list(range(1, 17)))
    slot = snapshot_at(tree, states, list(range(1, 9)))
    states.free(slot)  # freed while the tree still holds it
    with pytest.raises(AssertionError, match="free state slots"):
        tree.check_integrity()
    assert states.alloc() == slot
    node = tree.match_prefix(list(range(1, 17)), raw=True).last_node
    node.snapshot = slot  # two nodes, one slot
    with pytest.raises(AssertionError, match="snapshot"):
        tree.check_integrity()


def test_without_states_the_match_is_not_cut():
    alloc = PagedAllocator(64, 1)
    tree = RadixCache(alloc, 1)
    insert(tree, alloc, list(range(1, 9)))
    assert tree.match_prefix(list(range(1, 10))).prefix_len == 8
    tree.check_integrity()


@pytest.mark.parametrize("seed", range(3))
def test_random_operations_keep_the_invariants(seed):
    """Random inserts (splitting nodes), snapshots, locked matches, K/V and snapshot
    evictions: after each step the tree is intact, every match ends on a snapshot, and
    state slots are either free or held once."""
    rng = torch.Generator().manual_seed(seed)
    ps = (1, 2, 4)[seed % 3]
    alloc, states, tree = make(page_size=ps, budget=6)
    locked = []

    def draw(n: int) -> int:
        return int(torch.randint(0, n, (1,), generator=rng))

    bases = [torch.randint(1, 50, (24,), generator=rng).tolist() for _ in range(3)]
    for _ in range(100):
        op = draw(5)
        # a prefix of one of a few sequences, then a short tail of its own: shared paths
        seq = bases[draw(3)][:draw(24) + 1] + [100 + draw(3)] * draw(4)
        if op == 0 and alloc.available_size() >= 32:
            insert(tree, alloc, seq)
        elif op == 1:
            m = tree.match_prefix(seq, raw=True)
            held = tree.num_snapshots()
            if m.prefix_len and m.last_node.snapshot is None and held < 6:
                slot = states.alloc()
                assert tree.attach_snapshot(m.last_node, slot)
        elif op == 2:
            m = tree.match_prefix(seq)
            assert m.last_node is tree.root or m.last_node.snapshot is not None
            assert m.raw_len >= m.prefix_len
            tree.inc_lock_ref(m.last_node)
            locked.append(m.last_node)
        elif op == 3 and locked:
            tree.dec_lock_ref(locked.pop(draw(len(locked))))
        elif op == 4:
            tree.evict(draw(16) + 1)
            tree.evict_snapshots(1)
        tree.check_integrity()
        assert tree.num_snapshots() + states.available_size() == states.size
        assert all(n.snapshot is not None for n in locked if n is not tree.root)
