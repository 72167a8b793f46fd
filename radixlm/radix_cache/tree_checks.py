"""The radix tree's invariants, checked (``check_integrity``), and the tree as text
(``pretty_print``): for tests and debugging, never on the request path."""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any

import torch

from radixlm.radix_cache.kv_events import chain_hashes


class TreeChecks:
    """Mixed into ``RadixCache`` (its root, counters, allocator, page size, events and
    ``_nodes`` / ``_child_key`` / ``_empty``)."""

    def check_integrity(self) -> None:
        """Raise ``AssertionError`` naming the first broken invariant of the tree.

        Checks parent pointers, child keys, key/value lengths, page alignment, path locking
        (a child's ``lock_ref`` and ``hit_count`` <= its parent's), namespaces, the size
        counters, that no slot is held twice and that no held slot is free in the allocator,
        and the snapshots' state slots (``snapshot_tree.py``).
        """
        root = self.root
        assert root.parent is None and not root.key and root.value.numel() == 0, f"root {root}"
        assert root.lock_ref == 0, f"root has lock_ref {root.lock_ref}"
        sizes = [0, 0]  # [evictable, protected]
        values = []
        for node in self._nodes():
            for child_key, child in node.children.items():
                self._check_edge(node, child_key, child)
            if node is not root:
                sizes[node.lock_ref > 0] += len(node.key)
                values.append(node.value)
        assert sizes == [self._evictable_size, self._protected_size], (
            f"recomputed evictable/protected {sizes} != counters "
            f"{[self._evictable_size, self._protected_size]}"
        )
        self._check_slots(torch.cat(values) if values else self._empty())
        if self.swa_window is not None:
            self._check_swa()
        self._check_snapshots()

    def _check_swa(self) -> None:
        """Live nodes have every sliding slot, tombstones none and no sliding lock; a
        sliding lock only under a full one; the sliding counters equal a recount."""
        sizes = [0, 0]  # [swa evictable, swa protected]
        for node in self._nodes():
            if node is self.root:
                continue
            assert 0 <= node.swa_lock_ref <= node.lock_ref, (
                f"{node}: sliding lock {node.swa_lock_ref}")
            has = self.allocator.has_swa(node.value)
            if node.swa_tombstone:
                assert node.swa_lock_ref == 0 and not bool(has.any()), f"tombstone {node} {has}"
            else:
                assert bool(has.all()), f"live {node} lacks sliding slots: {has.tolist()}"
                sizes[node.swa_lock_ref > 0] += len(node.key)
        assert sizes == [self._swa_evictable_size, self._swa_protected_size], (
            f"recomputed sliding evictable/protected {sizes} != counters "
            f"{[self._swa_evictable_size, self._swa_protected_size]}")

    def _check_edge(self, parent: Any, child_key: Hashable, child: Any) -> None:
        ps = self.page_size
        assert child.parent is parent, f"{child} under {parent} has parent {child.parent}"
        n = len(child.key)
        assert child.value.dim() == 1 and child.value.numel() == n, (
            f"{child}: key length {n} != value shape {tuple(child.value.shape)}"
        )
        assert child.value.dtype == torch.int64, f"{child}: value dtype {child.value.dtype}"
        assert n > 0 and n % ps == 0, f"{child}: length {n} not a positive multiple of {ps}"
        expected = self._child_key(parent, child.key, child.namespace)
        assert child_key == expected, f"{child} keyed {child_key!r}, expected {expected!r}"
        assert child.lock_ref >= 0, f"{child}: negative lock_ref"
        if self.events is not None:
            parent_hash = parent.block_hashes[-1] if parent is not self.root else None
            hashes = chain_hashes(child.key, ps, child.namespace, parent_hash)
            assert child.block_hashes == hashes, f"{child}: block hashes do not chain"
        if parent is not self.root:
            assert child.namespace == parent.namespace, (
                f"{child} in namespace {child.namespace!r} under {parent.namespace!r}"
            )
            assert child.lock_ref <= parent.lock_ref, f"{child} locked more than {parent}"
            assert child.hit_count <= parent.hit_count, f"{child} hit more than {parent}"
        if ps > 1:
            pages = child.value.view(-1, ps)  # [num_pages, page_size]
            offsets = torch.arange(ps, device=pages.device)
            assert bool((pages == pages[:, :1] + offsets).all()) and bool(
                (pages[:, 0] % ps == 0).all()
            ), f"{child}: slots are not whole allocator pages: {child.value.tolist()}"

    def _check_slots(self, slots: torch.Tensor) -> None:
        uniq, counts = torch.unique(slots, return_counts=True)
        assert uniq.numel() == slots.numel(), f"slots held twice: {uniq[counts > 1].tolist()}"
        if slots.numel() == 0:
            return
        lo, hi = int(uniq[0]), int(uniq[-1])
        assert 0 <= lo and hi < self.allocator.size, f"slots out of range: min {lo}, max {hi}"
        free = self.allocator.is_free[uniq // self.page_size]
        assert not bool(free.any()), f"tree holds free slots {uniq[free].tolist()}"

    def pretty_print(self) -> str:
        """The tree as indented text, one node per line (for debugging)."""
        lines = [
            f"RadixCache(page_size={self.page_size}, evictable={self._evictable_size}, "
            f"protected={self._protected_size})"
        ]
        stack = [(child, 1) for child in reversed(self.root.children.values())]
        while stack:
            node, depth = stack.pop()
            head = node.key[:8]
            more = "..." if len(node.key) > 8 else ""
            lines.append(
                f"{'  ' * depth}[{node.namespace}] {head}{more} len={len(node.key)} "
                f"lock_ref={node.lock_ref} t={node.last_access} hits={node.hit_count}"
                + ("" if node.snapshot is None else f" snapshot={node.snapshot}")
            )
            stack.extend((c, depth + 1) for c in reversed(node.children.values()))
        return "\n".join(lines)
