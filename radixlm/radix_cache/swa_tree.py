"""The radix tree's second pool (``--enable-hybrid-swa-memory``): tombstones and sliding
locks (a mixin of ``RadixCache``; SGLang's ``SWARadixCache`` is the model).

A node keeps its full slots as long as it lives; its sliding-layer slots (reached through
the allocator's ``full_to_swa``) can go earlier: a **tombstoned** node has none. A prefix
can be reused only up to a point ``p`` whose last ``window`` tokens are in live nodes (or
all of ``[0, p)`` is): ``match_prefix`` cuts a match back to such a point (``_swa_cut``).

Sliding locks: a running request needs the sliding K/V of the tree only for its window
behind the match, so it locks (``inc_swa_lock``) the nodes covering the last ``window``
tokens of its path, the topmost of which carries a ``swa_uuid`` where the unlock walk
stops (a split moves it to the upper part); the topmost node is split at the window's
start, so a request locks at most the window rounded up to a page. Unlocked live nodes
are swa-evictable: ``evict_swa`` tombstones them (a leaf no request holds is removed
whole instead). A request's lock goes once its own window has passed its cached prefix
(``CacheManager.trim_windows``).

Counters: ``swa_evictable`` + ``swa_protected`` = tokens of live nodes, by sliding lock.
"""

from __future__ import annotations

import heapq
from typing import Any

import torch


class SWATree:
    """Mixed into ``RadixCache`` (its root, allocator, ``swa_window``, priority, counters
    and node helpers). Every method is a no-op or plain with ``swa_window`` None."""

    swa_window: int | None

    def swa_evictable_size(self) -> int:
        return self._swa_evictable_size

    def swa_protected_size(self) -> int:
        return self._swa_protected_size

    def _swa_count(self, node: Any, sign: int) -> None:
        """Add (sign 1) or remove (-1) a live node's tokens from the sliding counters."""
        if node.swa_lock_ref > 0:
            self._swa_protected_size += sign * len(node.key)
        else:
            self._swa_evictable_size += sign * len(node.key)

    def _swa_cut(self, node: Any) -> Any:
        """The deepest node of the path root..node at which the sliding K/V of the last
        ``window`` tokens (or of everything from the root) is present."""
        best, run, n = node, 0, node
        while n is not self.root:
            if n.swa_tombstone:
                best, run = n.parent, 0
            else:
                run += len(n.key)
                if run >= self.swa_window:
                    return best
            n = n.parent
        return best

    def _path_slots(self, node: Any) -> torch.Tensor:
        values = []
        while node is not self.root:
            values.append(node.value)
            node = node.parent
        return torch.cat(values[::-1]) if values else self._empty()

    # ---- sliding locks ----------------------------------------------------------------
    def inc_swa_lock(self, node: Any) -> int:
        """Lock the sliding K/V of the last ``window`` tokens of root..node; returns the
        uuid to unlock with (0: nothing locked)."""
        if self.swa_window is None:
            return 0
        target = -(-self.swa_window // self.page_size) * self.page_size
        covered, top, n = 0, None, node
        while n is not self.root and covered < target and not n.swa_tombstone:
            if covered + len(n.key) > target:  # lock only the window: split off the rest
                self._split(n, covered + len(n.key) - target)
            if n.swa_lock_ref == 0:
                self._swa_evictable_size -= len(n.key)
                self._swa_protected_size += len(n.key)
            n.swa_lock_ref += 1
            covered, top, n = covered + len(n.key), n, n.parent
        if top is None:
            return 0
        if top.swa_uuid == 0:
            self._next_id += 1
            top.swa_uuid = self._next_id
        return top.swa_uuid

    def dec_swa_lock(self, node: Any, uuid: int) -> None:
        """Undo ``inc_swa_lock(node)`` that returned ``uuid``."""
        n = node
        while uuid:
            assert n is not self.root and n.swa_lock_ref > 0, f"dec_swa_lock below zero: {n}"
            n.swa_lock_ref -= 1
            if n.swa_lock_ref == 0:
                self._swa_evictable_size += len(n.key)
                self._swa_protected_size -= len(n.key)
            if n.swa_uuid == uuid:
                return
            n = n.parent

    # ---- tombstones ---------------------------------------------------------------------
    def _tombstone(self, node: Any) -> None:
        assert not node.swa_tombstone and node.swa_lock_ref == 0, f"tombstone {node}"
        self.allocator.free_swa(node.value)
        node.swa_tombstone = True
        self._swa_evictable_size -= len(node.key)

    def evict_swa(self, num_tokens: int) -> int:
        """Free sliding slots of live unlocked nodes in eviction order until ``num_tokens``
        are freed: a leaf no request holds goes whole, any other node is tombstoned.
        Returns the sliding tokens freed."""
        heap = [(self._priority(n), n) for n in self._nodes()
                if n is not self.root and not n.swa_tombstone and n.swa_lock_ref == 0]
        heapq.heapify(heap)
        freed, full, removed = 0, [], []
        while freed < num_tokens and heap:
            _, node = heapq.heappop(heap)
            freed += len(node.key)
            if not node.children and node.lock_ref == 0:
                self._remove_leaf(node, full, removed)
            else:
                self._tombstone(node)
        self._free_removed(full, removed)
        return freed

    def _revive(self, node: Any, end: int, slots: torch.Tensor, swa_from: int) -> None:
        """Insert: tombstoned nodes of root..node (which ends at ``end``) over positions
        the caller has sliding K/V for (``[swa_from, end)``) take it: the caller's sliding
        pages move to the node's full slots (the caller then frees its duplicates)."""
        while node is not self.root and end > swa_from:
            start = end - len(node.key)
            if node.swa_tombstone:
                lo = max(start, swa_from)
                if lo > start:
                    self._split(node, lo - start)  # node is now [lo, end)
                self.allocator.move_swa(slots[lo:end], node.value)
                node.swa_tombstone = False
                self._swa_count(node, 1)
            end -= len(node.key)
            node = node.parent
