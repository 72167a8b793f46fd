"""RadixCache eviction policies (``--radix-eviction-policy lru|lfu``): unit cases where the
two policies disagree, hit counting, and a stateful test whose oracle evicts by brute force
(the minimum-priority evictable leaf, one at a time) and counts hits per page."""

from __future__ import annotations

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from radixlm.radix_cache.allocator import PagedAllocator
from radixlm.radix_cache.radix_tree import EVICTION_POLICIES, RadixCache, TreeNode


def make(policy: str, page_size: int = 1, size: int = 256) -> tuple[PagedAllocator, RadixCache]:
    alloc = PagedAllocator(size, page_size)
    return alloc, RadixCache(alloc, page_size, eviction_policy=policy)


def insert(tree: RadixCache, alloc: PagedAllocator, tokens: list[int], counted_len: int = 0,
           namespace: str | None = None) -> int:
    """Insert like a request that computed every token; free what the tree did not take."""
    ps = tree.page_size
    slots = alloc.alloc(-(-len(tokens) // ps) * ps)
    assert slots is not None
    prefix_len = tree.insert(tokens, slots, namespace, counted_len=counted_len)
    aligned = len(tokens) - len(tokens) % ps
    pos = torch.arange(slots.numel())
    alloc.free(slots[(pos < prefix_len) | (pos >= aligned)])
    return prefix_len


def leaf_keys(tree: RadixCache) -> set[tuple[int, ...]]:
    out, stack = set(), [(c, ()) for c in tree.root.children.values()]
    while stack:
        node, prefix = stack.pop()
        prefix = prefix + tuple(node.key)
        if not node.children:
            out.add(prefix)
        stack.extend((c, prefix) for c in node.children.values())
    return out


def _popular_old_and_fresh(policy: str) -> RadixCache:
    """``A`` inserted three times long ago, ``B`` once, most recently."""
    alloc, tree = make(policy)
    for _ in range(3):
        insert(tree, alloc, [1, 1, 1, 1])
    insert(tree, alloc, [2, 2, 2, 2])
    return tree


def test_lru_and_lfu_evict_different_leaves():
    lru, lfu = _popular_old_and_fresh("lru"), _popular_old_and_fresh("lfu")
    assert lru.evict(4) == 4 and lfu.evict(4) == 4
    assert leaf_keys(lru) == {(2, 2, 2, 2)}  # the least recently used went
    assert leaf_keys(lfu) == {(1, 1, 1, 1)}  # the least hit went
    lru.check_integrity()
    lfu.check_integrity()


def test_lfu_ties_break_by_recency():
    alloc, tree = make("lfu")
    insert(tree, alloc, [1, 1])
    insert(tree, alloc, [2, 2])
    tree.match_prefix([1, 1])  # a match touches recency, not hits
    assert tree.evict(2) == 2
    assert leaf_keys(tree) == {(1, 1)}


def test_hits_count_once_per_request_and_split_keeps_them():
    alloc, tree = make("lfu", page_size=2)
    insert(tree, alloc, [1, 2, 3, 4])  # first chunk of a request
    insert(tree, alloc, [1, 2, 3, 4, 5, 6], counted_len=4)  # the same request, finished
    node = tree.match_prefix([1, 2, 3, 4]).last_node
    assert node.hit_count == 1 and next(iter(node.children.values())).hit_count == 1
    insert(tree, alloc, [1, 2, 9, 9])  # another request: splits after [1, 2]
    upper = tree.match_prefix([1, 2]).last_node
    assert upper.key == [1, 2] and upper.hit_count == 2
    assert tree.match_prefix([1, 2, 3, 4]).last_node.hit_count == 1
    tree.check_integrity()


def test_unknown_policy_is_refused():
    with pytest.raises(ValueError, match="eviction_policy must be one of"):
        make("slru")


class EvictionMachine(RuleBasedStateMachine):
    """Random inserts, matches, locks and evictions; after each eviction, exactly the
    leaves a brute-force oracle picks are gone, and every page's hit count equals the
    number of inserts that covered it since it was last created."""

    policy = "lru"
    page_size = 1

    def __init__(self) -> None:
        super().__init__()
        ps = self.page_size
        self.alloc = PagedAllocator(48 * ps, ps)
        self.tree = RadixCache(self.alloc, ps, eviction_policy=self.policy)
        self.seqs: list[list[int]] = [[]]
        self.locks: list[TreeNode] = []
        self.hits: dict[tuple, int] = {}  # (namespace, page-aligned prefix) -> inserts

    def _draw(self, data) -> tuple[str | None, list[int]]:
        ps = self.page_size
        base = data.draw(st.sampled_from(self.seqs))
        base = base[: data.draw(st.integers(0, len(base)))]
        extra = data.draw(st.lists(st.integers(0, 2), max_size=3 * ps + 1))
        return data.draw(st.sampled_from([None, "x"])), (base + extra)[: 10 * ps]

    def _pages(self, seq: list[int]) -> list[tuple[int, ...]]:
        ps = self.page_size
        return [tuple(seq[:end]) for end in range(ps, len(seq) - len(seq) % ps + 1, ps)]

    @rule(data=st.data())
    def insert(self, data) -> None:
        ns, seq = self._draw(data)
        need = -(-len(seq) // self.page_size) * self.page_size
        if not self.alloc.can_alloc(need):
            self.evict(need - self.alloc.available_size())
            if not self.alloc.can_alloc(need):
                return
        insert(self.tree, self.alloc, seq, namespace=ns)
        for page in self._pages(seq):
            self.hits[(ns, page)] = self.hits.get((ns, page), 0) + 1
        self.seqs.append(seq)

    @rule(data=st.data())
    def match(self, data) -> None:
        ns, seq = self._draw(data)
        self.tree.match_prefix(seq, ns)

    @rule(data=st.data())
    def lock(self, data) -> None:
        ns, seq = self._draw(data)
        node = self.tree.match_prefix(seq, ns).last_node
        self.tree.inc_lock_ref(node)
        self.locks.append(node)

    @precondition(lambda self: self.locks)
    @rule(data=st.data())
    def unlock(self, data) -> None:
        i = data.draw(st.integers(0, len(self.locks) - 1))
        self.tree.dec_lock_ref(self.locks.pop(i))

    @rule(num_pages=st.integers(0, 12))
    def evict_pages(self, num_pages: int) -> None:
        self.evict(num_pages * self.page_size)

    def evict(self, num_tokens: int) -> None:
        expected = self._oracle_evictions(num_tokens)
        nodes = {id(n): n for n in self.tree._nodes()}
        evictable = self.tree.evictable_size()
        freed = self.tree.evict(num_tokens)
        gone = set(nodes) - {id(n) for n in self.tree._nodes()}
        assert gone == expected
        assert freed == sum(len(nodes[i].key) for i in gone)
        assert min(num_tokens, evictable) <= freed <= evictable
        present = self._pages_in_tree()
        self.hits = {k: v for k, v in self.hits.items() if k in present}

    def _oracle_evictions(self, num_tokens: int) -> set[int]:
        """Node ids the policy must evict: repeatedly the evictable leaf of least
        priority (lru: oldest; lfu: fewest hits, then oldest), by brute force."""
        key = ((lambda n: (n.last_access, n.node_id)) if self.policy == "lru"
               else (lambda n: (n.hit_count, n.last_access, n.node_id)))
        root = self.tree.root
        kids = {id(n): len(n.children) for n in self.tree._nodes()}
        alive = {id(n): n for n in self.tree._nodes() if n is not root}
        gone: set[int] = set()
        freed = 0
        while freed < num_tokens:
            leaves = [n for i, n in alive.items()
                      if i not in gone and kids[i] == 0 and n.lock_ref == 0]
            if not leaves:
                break
            victim = min(leaves, key=key)
            gone.add(id(victim))
            freed += len(victim.key)
            kids[id(victim.parent)] -= 1
        return gone

    def _pages_in_tree(self) -> dict[tuple, TreeNode]:
        """``{(namespace, page-aligned prefix): the node holding its last page}``."""
        out, stack = {}, [(c, ()) for c in self.tree.root.children.values()]
        while stack:
            node, prefix = stack.pop()
            for i in range(0, len(node.key), self.page_size):
                out[(node.namespace, prefix + tuple(node.key[: i + self.page_size]))] = node
            stack.extend((c, prefix + tuple(node.key)) for c in node.children.values())
        return out

    @invariant()
    def consistent(self) -> None:
        self.tree.check_integrity()
        pages = self._pages_in_tree()
        assert set(pages) == set(self.hits)
        for page, node in pages.items():
            assert self.hits[page] == node.hit_count, (node, page)


class EvictionMachineLFU(EvictionMachine):
    policy = "lfu"


class EvictionMachineLFUPaged(EvictionMachine):
    policy = "lfu"
    page_size = 4


_SETTINGS = settings(max_examples=100, stateful_step_count=40, deadline=None)
TestEvictionLRU = EvictionMachine.TestCase
TestEvictionLRU.settings = _SETTINGS
TestEvictionLFU = EvictionMachineLFU.TestCase
TestEvictionLFU.settings = _SETTINGS
TestEvictionLFUPaged = EvictionMachineLFUPaged.TestCase
TestEvictionLFUPaged.settings = _SETTINGS


def test_policies_listed():
    assert EVICTION_POLICIES == ("lru", "lfu")
