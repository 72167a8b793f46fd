"""RadixCache: unit tests, a corruption check of check_integrity, and a stateful model test."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from radixlm.radix_cache.allocator import PagedAllocator
from radixlm.radix_cache.radix_tree import RadixCache, TreeNode

# ---- helpers ------------------------------------------------------------------------


def make(page_size: int = 1, size: int = 256, disable: bool = False):
    alloc = PagedAllocator(size, page_size)
    return alloc, RadixCache(alloc, page_size, disable=disable)


def insert_fresh(
    tree: RadixCache, alloc: PagedAllocator, tokens: list[int], namespace: str | None = None
) -> tuple[int, torch.Tensor]:
    """Insert ``tokens`` with fresh slots like a caller would; free what the tree did not take."""
    ps = tree.page_size
    slots = alloc.alloc(-(-len(tokens) // ps) * ps)
    assert slots is not None
    prefix_len = tree.insert(tokens, slots, namespace)
    aligned = len(tokens) - len(tokens) % ps
    pos = torch.arange(slots.numel())
    alloc.free(slots[(pos < prefix_len) | (pos >= aligned)])
    return prefix_len, slots


def tree_pages(tree: RadixCache) -> dict[tuple, tuple[int, ...]]:
    """``{(namespace, page-aligned prefix): slots of its last page}`` read off the nodes."""
    ps = tree.page_size
    out: dict[tuple, tuple[int, ...]] = {}
    stack = [(child, ()) for child in tree.root.children.values()]
    while stack:
        node, prefix = stack.pop()
        for i in range(0, len(node.key), ps):
            prefix = prefix + tuple(node.key[i : i + ps])
            out[(node.namespace, prefix)] = tuple(node.value[i : i + ps].tolist())
        stack.extend((c, prefix) for c in node.children.values())
    return out


def path_key(node: TreeNode) -> list[int]:
    parts = []
    while node.parent is not None:
        parts.append(node.key)
        node = node.parent
    return [t for part in reversed(parts) for t in part]


def assert_accounting(tree: RadixCache, alloc: PagedAllocator, held: int = 0) -> None:
    total = alloc.available_size() + tree.evictable_size() + tree.protected_size() + held
    assert total == alloc.size


# ---- unit tests ---------------------------------------------------------------------


def test_match_after_insert_splits_inside_node() -> None:
    alloc, tree = make()
    prefix_len, slots = insert_fresh(tree, alloc, [1, 2, 3, 4, 5])
    assert prefix_len == 0
    res = tree.match_prefix([1, 2, 3, 9])
    assert res.slots.tolist() == slots[:3].tolist() and res.prefix_len == 3
    assert res.last_node.key == [1, 2, 3] and path_key(res.last_node) == [1, 2, 3]
    assert [c.key for c in res.last_node.children.values()] == [[4, 5]]
    assert tree.match_prefix([1, 2, 3, 4, 5, 6]).slots.tolist() == slots.tolist()
    assert tree.match_prefix([7]).prefix_len == 0
    assert tree.match_prefix([]).last_node is tree.root
    tree.check_integrity()
    assert_accounting(tree, alloc)


def test_split_at_page_boundaries() -> None:
    alloc, tree = make(page_size=4)
    a = list(range(12))
    _, slots_a = insert_fresh(tree, alloc, a)
    res = tree.match_prefix(a[:6] + [99, 99])  # diverges inside page 2: only page 1 matches
    assert res.prefix_len == 4 and res.slots.tolist() == slots_a[:4].tolist()
    assert res.last_node.key == a[:4]
    b = a[:6] + [50] * 6  # second page differs at token 6
    prefix_len, _ = insert_fresh(tree, alloc, b)
    assert prefix_len == 4
    top = tree.root.children[(None, (0, 1, 2, 3))]
    assert sorted(len(c.key) for c in top.children.values()) == [8, 8]
    assert set(top.children) == {(4, 5, 6, 7), (4, 5, 50, 50)}
    assert tree.total_size() == 20
    # a partial last page is never cached
    assert tree.match_prefix(a[:7]).prefix_len == 4
    tree.check_integrity()
    assert_accounting(tree, alloc)


def test_namespaces_are_isolated() -> None:
    alloc, tree = make()
    insert_fresh(tree, alloc, [1, 2, 3])
    prefix_len, slots = insert_fresh(tree, alloc, [1, 2, 3], namespace="lora-a")
    assert prefix_len == 0
    assert tree.match_prefix([1, 2, 3], "lora-a").slots.tolist() == slots.tolist()
    assert tree.match_prefix([1, 2, 3], "lora-b").prefix_len == 0
    assert tree.total_size() == 6
    tree.check_integrity()
    assert tree.evict(100) == 6 and tree.total_size() == 0
    assert_accounting(tree, alloc)


def test_insert_returns_prefix_len_and_takes_only_whole_pages() -> None:
    alloc, tree = make(page_size=4, size=64)
    seq = list(range(10))
    prefix_len, _ = insert_fresh(tree, alloc, seq)
    assert prefix_len == 0 and tree.total_size() == 8
    assert_accounting(tree, alloc)
    assert insert_fresh(tree, alloc, seq)[0] == 8
    assert insert_fresh(tree, alloc, seq[:4] + [0] * 8)[0] == 4
    assert insert_fresh(tree, alloc, seq[:3])[0] == 0  # nothing aligned to insert
    assert tree.total_size() == 16
    tree.check_integrity()
    assert_accounting(tree, alloc)


def test_locks_protect_from_eviction() -> None:
    alloc, tree = make()
    insert_fresh(tree, alloc, [1, 2, 3, 4])
    insert_fresh(tree, alloc, [1, 2, 7, 8])
    res = tree.match_prefix([1, 2, 3, 4])
    tree.inc_lock_ref(res.last_node)
    assert tree.protected_size() == 4 and tree.evictable_size() == 2
    tree.check_integrity()
    assert tree.evict(100) == 2
    assert tree.match_prefix([1, 2, 3, 4]).prefix_len == 4
    assert tree.match_prefix([1, 2, 7, 8]).prefix_len == 2
    tree.dec_lock_ref(res.last_node)
    assert tree.protected_size() == 0 and tree.evictable_size() == 4
    with pytest.raises(AssertionError, match="below zero"):
        tree.dec_lock_ref(res.last_node)
    tree.check_integrity()
    assert tree.evict(1) == 2  # the leaf [3, 4]; its parent [1, 2] is still there
    assert tree.evict(1) == 2 and tree.total_size() == 0
    assert_accounting(tree, alloc)


def test_evicts_least_recently_used_first() -> None:
    alloc, tree = make()
    for first in (1, 2, 3):
        insert_fresh(tree, alloc, [first, 0])
    tree.match_prefix([1, 0])  # 1 is now the most recent, 2 the least
    for expected_gone in (2, 3, 1):
        assert tree.evict(1) == 2
        assert tree.match_prefix([expected_gone, 0]).prefix_len == 0
    assert tree.evict(1) == 0


def test_parent_becomes_eviction_candidate() -> None:
    alloc, tree = make()
    insert_fresh(tree, alloc, [1, 2, 3])
    insert_fresh(tree, alloc, [1, 2, 4])
    insert_fresh(tree, alloc, [5])
    tree.match_prefix([5])
    assert tree.evict(4) == 4  # both leaves under [1, 2], then [1, 2] itself
    assert tree.match_prefix([5]).prefix_len == 1
    assert tree.match_prefix([1, 2]).prefix_len == 0
    tree.check_integrity()
    assert_accounting(tree, alloc)


def test_disable_mode_caches_nothing() -> None:
    alloc, tree = make(disable=True)
    slots = alloc.alloc(3)
    assert slots is not None
    assert tree.insert([1, 2, 3], slots) == 3
    assert tree.match_prefix([1, 2, 3]).prefix_len == 0
    assert tree.total_size() == 0 and alloc.available_size() == alloc.size - 3


def test_reset_frees_everything_and_refuses_when_locked() -> None:
    alloc, tree = make(page_size=4, size=64)
    insert_fresh(tree, alloc, list(range(12)))
    insert_fresh(tree, alloc, list(range(8)) + [9] * 4, namespace="x")
    res = tree.match_prefix(list(range(8)))
    tree.inc_lock_ref(res.last_node)
    with pytest.raises(AssertionError, match="locked"):
        tree.reset()
    tree.dec_lock_ref(res.last_node)
    assert tree.all_slots().numel() == 24
    tree.reset()
    assert tree.total_size() == 0 and alloc.available_size() == 64
    tree.check_integrity()


def test_long_prompt_and_pretty_print() -> None:
    alloc, tree = make(page_size=16, size=8192)
    prompt = [i % 500 for i in range(2000)]
    insert_fresh(tree, alloc, prompt)
    res = tree.match_prefix(prompt[:1000] + [7] + prompt[1001:])
    assert res.prefix_len == 992
    text = tree.pretty_print()
    assert "lock_ref=0" in text and len(text.splitlines()) == 3
    tree.check_integrity()


# ---- check_integrity must catch corruption ------------------------------------------


def _first_child(tree: RadixCache) -> TreeNode:
    return next(iter(tree.root.children.values()))


def _grandchild(tree: RadixCache) -> TreeNode:
    return next(iter(_first_child(tree).children.values()))


CORRUPTIONS: dict[str, Callable[[RadixCache, PagedAllocator], None]] = {
    "value length": lambda t, a: setattr(_first_child(t), "value", _first_child(t).value[:-4]),
    "slot twice": lambda t, a: setattr(_grandchild(t), "value", _first_child(t).value.clone()),
    "slot free": lambda t, a: a.free(_grandchild(t).value[:1]),
    "counter": lambda t, a: setattr(t, "_evictable_size", t.evictable_size() + 4),
    "parent": lambda t, a: setattr(_grandchild(t), "parent", t.root),
    "child lock": lambda t, a: (
        setattr(_grandchild(t), "lock_ref", 1),
        setattr(t, "_protected_size", 4),
        setattr(t, "_evictable_size", t.evictable_size() - 4),
    ),
    "child key": lambda t, a: _first_child(t).children.update(
        {(8, 8, 8, 8): _first_child(t).children.popitem()[1]}
    ),
    "misaligned": lambda t, a: (
        setattr(_first_child(t), "key", _first_child(t).key[:-1]),
        setattr(_first_child(t), "value", _first_child(t).value[:-1]),
        setattr(t, "_evictable_size", t.evictable_size() - 1),
    ),
    "slots not pages": lambda t, a: setattr(_grandchild(t), "value", _grandchild(t).value.flip(0)),
    "namespace": lambda t, a: setattr(_grandchild(t), "namespace", "other"),
}


@pytest.mark.parametrize("name", sorted(CORRUPTIONS))
def test_check_integrity_catches_corruption(name: str) -> None:
    alloc, tree = make(page_size=4, size=64)
    insert_fresh(tree, alloc, list(range(12)))
    insert_fresh(tree, alloc, list(range(4)) + [9] * 8)
    tree.check_integrity()
    CORRUPTIONS[name](tree, alloc)
    with pytest.raises(AssertionError):
        tree.check_integrity()


# ---- stateful test against a reference model ----------------------------------------


class TreeMachine(RuleBasedStateMachine):
    """Random insert / match / lock / unlock / evict / hold / reset against a page dict.

    The model maps ``(namespace, page-aligned prefix)`` to the slots of its last page; the
    tree is a trie of pages, so the model and the tree must hold exactly the same pages.
    """

    page_size = 1

    def __init__(self) -> None:
        super().__init__()
        ps = self.page_size
        self.alloc = PagedAllocator(40 * ps, ps)
        self.tree = RadixCache(self.alloc, ps)
        self.model: dict[tuple, tuple[int, ...]] = {}
        self.seqs: list[list[int]] = [[]]
        self.locks: list[tuple[TreeNode, str | None, tuple[int, ...]]] = []
        self.held: list[torch.Tensor] = []

    def _draw(self, data) -> tuple[str | None, list[int]]:
        ps = self.page_size
        base = data.draw(st.sampled_from(self.seqs))
        base = base[: data.draw(st.integers(0, len(base)))]
        extra = data.draw(st.lists(st.integers(0, 2), max_size=3 * ps + 1))
        return data.draw(st.sampled_from([None, "x"])), (base + extra)[: 10 * ps]

    def _model_match(self, seq: list[int], ns: str | None) -> list[int]:
        ps, slots = self.page_size, []
        for end in range(ps, len(seq) + 1, ps):
            page = self.model.get((ns, tuple(seq[:end])))
            if page is None:
                break
            slots.extend(page)
        return slots

    def _evict(self, num_tokens: int) -> None:
        evictable = self.tree.evictable_size()
        freed = self.tree.evict(num_tokens)
        assert min(num_tokens, evictable) <= freed <= evictable
        after = tree_pages(self.tree)
        assert after.items() <= self.model.items()
        assert (len(self.model) - len(after)) * self.page_size == freed
        self.model = after

    @rule(data=st.data())
    def insert(self, data) -> None:
        ns, seq = self._draw(data)
        ps, alloc, tree = self.page_size, self.alloc, self.tree
        res = tree.match_prefix(seq, ns)
        m = res.prefix_len
        tree.inc_lock_ref(res.last_node)
        need = -(-(len(seq) - m) // ps) * ps
        if not alloc.can_alloc(need):
            self._evict(need - alloc.available_size())
        fresh = alloc.alloc(need)
        if fresh is None:
            tree.dec_lock_ref(res.last_node)
            return
        slots = torch.cat([res.slots, fresh])
        expected = len(self._model_match(seq, ns))
        prefix_len = tree.insert(seq, slots, ns)
        assert prefix_len == expected and prefix_len >= m
        aligned = len(seq) - len(seq) % ps
        pos = torch.arange(fresh.numel()) + m
        alloc.free(fresh[(pos < prefix_len) | (pos >= aligned)])
        tree.dec_lock_ref(res.last_node)
        for end in range(prefix_len + ps, aligned + 1, ps):
            self.model[(ns, tuple(seq[:end]))] = tuple(slots[end - ps : end].tolist())
        self.seqs.append(seq)

    @rule(data=st.data())
    def match(self, data) -> None:
        ns, seq = self._draw(data)
        res = self.tree.match_prefix(seq, ns)
        assert res.slots.tolist() == self._model_match(seq, ns)
        assert path_key(res.last_node) == seq[: res.prefix_len]
        assert res.last_node is self.tree.root or res.last_node.namespace == ns

    @rule(data=st.data())
    def lock(self, data) -> None:
        ns, seq = self._draw(data)
        res = self.tree.match_prefix(seq, ns)
        self.tree.inc_lock_ref(res.last_node)
        self.locks.append((res.last_node, ns, tuple(seq[: res.prefix_len])))

    @precondition(lambda self: self.locks)
    @rule(data=st.data())
    def unlock(self, data) -> None:
        i = data.draw(st.integers(0, len(self.locks) - 1))
        self.tree.dec_lock_ref(self.locks.pop(i)[0])

    @rule(num_tokens=st.integers(0, 24))
    def evict(self, num_tokens: int) -> None:
        self._evict(num_tokens * self.page_size)
        for _, ns, prefix in self.locks:
            assert not prefix or (ns, prefix) in self.model

    @rule(num_pages=st.integers(1, 6))
    def hold(self, num_pages: int) -> None:
        slots = self.alloc.alloc(num_pages * self.page_size)
        if slots is not None:
            self.held.append(slots)

    @precondition(lambda self: self.held)
    @rule()
    def release(self) -> None:
        self.alloc.free(self.held.pop(0))

    @precondition(lambda self: not self.locks)
    @rule()
    def reset(self) -> None:
        self.tree.reset()
        self.model.clear()

    @invariant()
    def consistent(self) -> None:
        tree, alloc = self.tree, self.alloc
        tree.check_integrity()
        held = sum(h.numel() for h in self.held)
        assert_accounting(tree, alloc, held)
        assert tree_pages(tree) == self.model
        assert tree.total_size() == len(self.model) * self.page_size
        everything = torch.cat([alloc.free_slots(), tree.all_slots(), *self.held])
        assert torch.equal(everything.sort().values, torch.arange(alloc.size))


class TreeMachinePaged(TreeMachine):
    page_size = 4


_SETTINGS = settings(max_examples=150, stateful_step_count=40, deadline=None)
TestTreeMachine = TreeMachine.TestCase
TestTreeMachine.settings = _SETTINGS
TestTreeMachinePaged = TreeMachinePaged.TestCase
TestTreeMachinePaged.settings = _SETTINGS
