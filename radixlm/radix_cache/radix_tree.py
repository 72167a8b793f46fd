"""RadixAttention: a radix tree from token-id prefixes to the KV slots that hold them.

Ownership of slots, for one request whose tokens are ``[prefix | new | tail]``::

    match_prefix ->  |<-- tree slots -->|
    insert       ->  |<----- prefix_len ------>|<- taken by tree ->|<- not taken ->|
                     |  caller's slots[:prefix_len]: not taken;    |  past the last |
                     |  the caller frees those it allocated itself |  whole page    |

Locks: a running request locks the node its match ended on (``inc_lock_ref``), which
locks the whole path from the root; locked nodes are never evicted.

Eviction (``eviction_policy``, SGLang's ``--radix-eviction-policy``): ``lru`` frees the
least recently matched leaves first; ``lfu`` the leaves with the fewest hits first, ties by
recency. A hit is one request whose tokens covered the node, counted when the request's
tokens are inserted (``insert(..., counted_len=)`` keeps a request from counting twice).

Events (``events=KVEventRecorder``, see ``kv_events.py``): a new leaf records BlockStored
(its pages' chained hashes, kept on the node), an evicted leaf BlockRemoved, ``reset``
AllBlocksCleared; a split divides a node's hashes and records nothing.

Snapshots (``states=StateSlots``, a hybrid model: ``snapshot_tree.py``): nodes may hold the
linear layers' state after their path; a match is cut back to the deepest such node.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Hashable, Iterator, Sequence
from dataclasses import dataclass, field

import torch

from radixlm.radix_cache.allocator import PagedAllocator
from radixlm.radix_cache.kv_events import KVEventRecorder, chain_hashes
from radixlm.radix_cache.snapshot_tree import SnapshotTree
from radixlm.radix_cache.state_pool import StateSlots
from radixlm.radix_cache.swa_tree import SWATree
from radixlm.radix_cache.tree_checks import TreeChecks


@dataclass(eq=False)
class TreeNode:
    """One edge of the tree: ``key`` token ids and their KV ``value`` slots (same length)."""

    node_id: int
    key: list[int]
    value: torch.Tensor
    namespace: str | None
    parent: TreeNode | None = None
    children: dict[Hashable, TreeNode] = field(default_factory=dict)
    lock_ref: int = 0
    last_access: int = 0
    hit_count: int = 0
    block_hashes: list[int] = field(default_factory=list)  # one per page, with events only
    # the SWA pool (swa_tree.py): sliding slots freed, sliding locks, unlock-walk stop
    swa_tombstone: bool = False
    swa_lock_ref: int = 0
    swa_uuid: int = 0
    # a hybrid model: the state-pool slot with the linear layers' state after this node's
    # path (None: none; snapshot_tree.py)
    snapshot: int | None = None

    def __repr__(self) -> str:
        return (
            f"TreeNode(id={self.node_id}, len={len(self.key)}, lock_ref={self.lock_ref}, "
            f"last_access={self.last_access}, hits={self.hit_count}, "
            f"children={len(self.children)})"
        )


EVICTION_POLICIES = ("lru", "lfu")


def _lru_priority(node: TreeNode) -> tuple[int, ...]:
    return (node.last_access, node.node_id)


def _lfu_priority(node: TreeNode) -> tuple[int, ...]:
    return (node.hit_count, node.last_access, node.node_id)


_PRIORITY = {"lru": _lru_priority, "lfu": _lfu_priority}


@dataclass
class MatchResult:
    """``slots``: the tree's KV slots of the matched prefix; ``last_node``: deepest node;
    ``raw_len``: with snapshots, how far the K/V matched before the cut back (-1: no cut)."""

    slots: torch.Tensor
    last_node: TreeNode
    cut_from: int = -1

    @property
    def raw_len(self) -> int:
        return self.prefix_len if self.cut_from < 0 else self.cut_from

    @property
    def prefix_len(self) -> int:
        return self.slots.numel()


def _common_len(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the common prefix of two int sequences (C-level compare on the fast path)."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    return next(i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y)


class RadixCache(TreeChecks, SWATree, SnapshotTree):
    """Prefix cache over KV slots from ``allocator``; only whole pages are cached.

    Requests in different ``namespace`` s never share a node: the root's children are keyed
    by ``(namespace, first page)``, every other child by its first page (the first token
    when ``page_size == 1``). ``disable=True`` caches nothing. ``eviction_policy``: one
    of ``EVICTION_POLICIES`` (see the module docstring). ``events``: where inserts,
    evictions and resets are recorded (None: nowhere). ``swa_window``: with an
    ``SWAAllocator``, the sliding window (tombstones and sliding locks: ``swa_tree.py``).
    ``states``: a hybrid model's state slots: nodes keep recurrent-state snapshots, at
    most ``snapshot_budget`` (``snapshot_tree.py``).
    """

    def __init__(self, allocator: PagedAllocator, page_size: int, disable: bool = False,
                 eviction_policy: str = "lru", events: KVEventRecorder | None = None,
                 swa_window: int | None = None, states: StateSlots | None = None,
                 snapshot_budget: int = 0):
        assert page_size == allocator.page_size, (
            f"page_size={page_size} but allocator.page_size={allocator.page_size}"
        )
        if eviction_policy not in _PRIORITY:
            raise ValueError(f"eviction_policy must be one of {EVICTION_POLICIES}, "
                             f"got {eviction_policy!r}")
        assert events is None or events.block_size == page_size, (
            f"events.block_size={events.block_size} but page_size={page_size}"
        )
        self.events = None if disable else events
        self.eviction_policy = eviction_policy
        self._priority = _PRIORITY[eviction_policy]
        self.allocator = allocator
        self.swa_window = swa_window
        self.page_size = page_size
        self.disable = disable
        self.device = allocator.device
        self._next_id = 0
        self._clock = 0
        # called with each leaf before eviction frees it (its path's slots still hold
        # their KV): the hierarchical cache writes it to storage (managers/hicache.py)
        self.on_evict: Callable[[TreeNode], None] | None = None
        self.init_snapshots(states, snapshot_budget)
        self.reset_state()

    # ---- bookkeeping ----------------------------------------------------------------

    def reset_state(self) -> None:
        """Forget everything without freeing slots (used by ``__init__`` and ``reset``)."""
        self.root = self._new_node([], self._empty(), None)
        self._snapshots = {}
        self._evictable_size = 0
        self._protected_size = 0
        self._swa_evictable_size = 0
        self._swa_protected_size = 0

    def reset(self) -> None:
        """Drop every node and free all its slots through the allocator. Nothing may be locked."""
        assert self._protected_size == 0, f"reset with {self._protected_size} locked tokens"
        self.allocator.free(self.all_slots())
        self._reset_snapshots()
        self.reset_state()
        if self.events is not None:
            self.events.cleared()

    def evictable_size(self) -> int:
        """Tokens held by unlocked nodes."""
        return self._evictable_size

    def protected_size(self) -> int:
        """Tokens held by locked nodes."""
        return self._protected_size

    def total_size(self) -> int:
        return self._evictable_size + self._protected_size

    def all_slots(self) -> torch.Tensor:
        """Every KV slot held by the tree (in DFS order)."""
        values = [n.value for n in self._nodes() if n is not self.root]
        return torch.cat(values) if values else self._empty()

    # ---- match / insert -------------------------------------------------------------

    def match_prefix(self, token_ids: Sequence[int], namespace: str | None = None,
                     raw: bool = False) -> MatchResult:
        """Longest cached page-aligned prefix of ``token_ids`` in ``namespace``.

        Returns the tree's slots of that prefix and the deepest node covering it; if the
        match ends inside a node, that node is split there so ``last_node`` ends exactly at
        the prefix. Touches the LRU time of every node on the path. The caller should
        ``inc_lock_ref(last_node)`` while it uses the slots. With snapshots (a hybrid
        model) and not ``raw``, the match is cut back to the deepest node on it that has a
        snapshot (``last_node.snapshot``; the root when none has).
        """
        if self.disable:
            return MatchResult(self._empty(), self.root)
        key = self._aligned_key(token_ids)
        node, pos, values = self._walk(key, namespace)
        if self.states is not None and not raw:
            cut = self._snapshot_cut(node)
            if cut is not node:
                return MatchResult(self._path_slots(cut), cut, pos)
        if self.swa_window is not None:  # only as far as the sliding K/V is there
            node = self._swa_cut(node)
            return MatchResult(self._path_slots(node), node)
        slots = torch.cat(values) if values else self._empty()
        return MatchResult(slots, node)

    def insert(
        self, token_ids: Sequence[int], slots: torch.Tensor, namespace: str | None = None,
        counted_len: int = 0, swa_from: int = 0,
    ) -> int:
        """Cache the whole pages of ``token_ids`` with KV ``slots``; return ``prefix_len``.

        ``prefix_len`` is the number of leading tokens already in the tree: the caller's
        ``slots[:prefix_len]`` are not taken (the caller frees those it allocated itself).
        ``slots[prefix_len:aligned_len]`` now belong to the tree; slots past the last whole
        page are not taken. With ``disable=True`` nothing is taken and ``len(token_ids)``
        is returned. Every node on the path that ends past ``counted_len`` (the tokens
        this request already inserted, so already counted) gets one more hit.
        With the SWA pool, ``slots`` have sliding slots from ``swa_from`` on (before it the
        caller freed them, or they are the tree's): new nodes before it are tombstones,
        tombstoned nodes after it take the caller's.
        """
        if self.disable:
            return len(token_ids)
        key = self._aligned_key(token_ids)
        assert slots.numel() >= len(key), f"{slots.numel()} slots for {len(key)} tokens"
        node, pos, _ = self._walk(key, namespace)
        self._count_hits(node, pos, counted_len)
        if self.swa_window is not None:
            self._revive(node, pos, slots, swa_from)
        cut = pos if self.swa_window is None else min(max(swa_from, pos), len(key))
        if pos < cut:  # the caller's sliding slots are gone: a tombstone
            node = self._add_leaf(node, key[pos:cut], slots[pos:cut], namespace, True)
        if cut < len(key):
            self._add_leaf(node, key[cut:], slots[cut:len(key)], namespace, False)
        return pos

    def _add_leaf(self, parent: TreeNode, key: list[int], slots: torch.Tensor,
                  namespace: str | None, tombstone: bool) -> TreeNode:
        value = slots.to(device=self.device, dtype=torch.int64).clone()
        leaf = self._new_node(key, value, namespace)
        leaf.last_access = self._clock
        leaf.hit_count = 1
        leaf.swa_tombstone = tombstone
        self._attach(parent, leaf)
        self._evictable_size += len(leaf.key)
        if self.swa_window is not None and not tombstone:
            self._swa_evictable_size += len(leaf.key)
        if self.events is not None:
            self._record_stored(leaf)
        return leaf

    def _record_stored(self, leaf: TreeNode) -> None:
        assert self.events is not None and leaf.parent is not None
        parent_hash = leaf.parent.block_hashes[-1] if leaf.parent is not self.root else None
        leaf.block_hashes = chain_hashes(leaf.key, self.page_size, leaf.namespace, parent_hash)
        self.events.stored(leaf.block_hashes, parent_hash, leaf.key)

    def _count_hits(self, node: TreeNode, end: int, counted_len: int) -> None:
        """One hit for each node of the path root..node (which ends at token ``end``)
        that ends past ``counted_len``."""
        while node is not self.root and end > counted_len:
            node.hit_count += 1
            end -= len(node.key)
            assert node.parent is not None
            node = node.parent

    def _walk(
        self, key: list[int], namespace: str | None
    ) -> tuple[TreeNode, int, list[torch.Tensor]]:
        """Follow ``key`` from the root; split where it diverges inside a node."""
        self._clock += 1
        node, pos, values = self.root, 0, []
        while pos < len(key):
            child = node.children.get(
                self._child_key(node, key[pos : pos + self.page_size], namespace)
            )
            if child is None:
                break
            m = _common_len(child.key, key[pos : pos + len(child.key)])
            m -= m % self.page_size
            assert m > 0, f"child keyed by its first page but matched {m} tokens: {child}"
            diverged = m < len(child.key)
            if diverged:
                child = self._split(child, m)
            child.last_access = self._clock
            values.append(child.value)
            node, pos = child, pos + m
            if diverged:
                break
        return node, pos, values

    def _split(self, child: TreeNode, m: int) -> TreeNode:
        """Cut ``child`` after ``m`` tokens; the new upper node keeps its lock, LRU time and
        hit count."""
        assert 0 < m < len(child.key) and m % self.page_size == 0, f"split at {m} of {child}"
        parent = child.parent
        assert parent is not None
        upper = self._new_node(child.key[:m], child.value[:m], child.namespace)
        upper.lock_ref, upper.last_access = child.lock_ref, child.last_access
        upper.hit_count = child.hit_count
        upper.swa_tombstone, upper.swa_lock_ref = child.swa_tombstone, child.swa_lock_ref
        upper.swa_uuid, child.swa_uuid = child.swa_uuid, 0  # the unlock walk stops higher
        pages = m // self.page_size
        upper.block_hashes = child.block_hashes[:pages]
        child.block_hashes = child.block_hashes[pages:]
        parent.children[self._child_key(parent, child.key, child.namespace)] = upper
        upper.parent = parent
        child.key, child.value = child.key[m:], child.value[m:]
        self._attach(upper, child)
        return upper

    # ---- locks and eviction ---------------------------------------------------------

    def inc_lock_ref(self, node: TreeNode) -> None:
        """Lock every node on the path root..node against eviction."""
        while node is not self.root:
            if node.lock_ref == 0:
                self._evictable_size -= len(node.key)
                self._protected_size += len(node.key)
            node.lock_ref += 1
            assert node.parent is not None
            node = node.parent

    def dec_lock_ref(self, node: TreeNode) -> None:
        """Undo one ``inc_lock_ref(node)``."""
        while node is not self.root:
            assert node.lock_ref > 0, f"dec_lock_ref below zero on {node}"
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self._evictable_size += len(node.key)
                self._protected_size -= len(node.key)
            assert node.parent is not None
            node = node.parent

    def evict(self, num_tokens: int) -> int:
        """Free unlocked leaves in ``eviction_policy`` order (lru: least recently used
        first; lfu: fewest hits first, then least recently used) until ``num_tokens`` are
        freed or nothing is evictable. Returns the number of tokens freed."""
        heap = [(self._leaf_priority(n), n) for n in self._evictable_leaves()]
        heapq.heapify(heap)
        freed: list[torch.Tensor] = []
        removed: list[int] = []
        num_freed = 0
        while num_freed < num_tokens and heap:
            _, leaf = heapq.heappop(heap)
            parent = leaf.parent
            self._remove_leaf(leaf, freed, removed)
            num_freed += len(leaf.key)
            if parent is not self.root and not parent.children and parent.lock_ref == 0:
                heapq.heappush(heap, (self._leaf_priority(parent), parent))
        self._free_removed(freed, removed)
        return num_freed

    def _remove_leaf(self, leaf: TreeNode, freed: list[torch.Tensor],
                     removed: list[int]) -> None:
        """Detach an unlocked leaf; its slots (full, and sliding if it is live) and block
        hashes go to ``freed`` / ``removed`` for ``_free_removed``."""
        parent = leaf.parent
        assert parent is not None and not leaf.children and leaf.lock_ref == 0, leaf
        if self.on_evict is not None:
            self.on_evict(leaf)
        del parent.children[self._child_key(parent, leaf.key, leaf.namespace)]
        self._drop_snapshot(leaf)
        freed.append(leaf.value)
        removed.extend(leaf.block_hashes)
        self._evictable_size -= len(leaf.key)
        if self.swa_window is not None and not leaf.swa_tombstone:
            self._swa_evictable_size -= len(leaf.key)

    def _free_removed(self, freed: list[torch.Tensor], removed: list[int]) -> None:
        if freed:
            self.allocator.free(torch.cat(freed))
        if removed and self.events is not None:
            self.events.removed(removed)

    def _evictable_leaves(self) -> Iterator[TreeNode]:
        for n in self._nodes():
            if n is not self.root and not n.children and n.lock_ref == 0:
                yield n

    # ---- helpers --------------------------------------------------------------------

    def _new_node(self, key: list[int], value: torch.Tensor, namespace: str | None) -> TreeNode:
        self._next_id += 1
        return TreeNode(self._next_id, key, value, namespace)

    def _attach(self, parent: TreeNode, child: TreeNode) -> None:
        parent.children[self._child_key(parent, child.key, child.namespace)] = child
        child.parent = parent

    def _child_key(self, parent: TreeNode, key: Sequence[int], namespace: str | None) -> Hashable:
        first = key[0] if self.page_size == 1 else tuple(key[: self.page_size])
        return (namespace, first) if parent is self.root else first

    def _aligned_key(self, token_ids: Sequence[int]) -> list[int]:
        if isinstance(token_ids, torch.Tensor):
            token_ids = token_ids.tolist()
        n = len(token_ids) - len(token_ids) % self.page_size
        return list(token_ids[:n])

    def _empty(self) -> torch.Tensor:
        return torch.empty(0, dtype=torch.int64, device=self.device)

    def _nodes(self) -> Iterator[TreeNode]:
        stack = [self.root]
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())
