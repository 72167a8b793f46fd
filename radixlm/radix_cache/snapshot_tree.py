"""The radix tree of a hybrid model: recurrent-state snapshots at node ends (a mixin of
``RadixCache``; SGLang's ``MambaRadixCache`` is the model).

A hybrid model's linear layers keep one state per sequence instead of K/V rows, so a
cached prefix is reusable only where the tree also holds the state after it. A node may
carry a **snapshot**: a slot of the state pool (``state_pool.py``) holding every linear
layer's (conv, ssm) state after the last token of the node's path::

    root -- A [0, 64) -- B [64, 128) snap 7 -- C [128, 200)          (no snapshot on C)
    request tokens [0, 190): the K/V walk reaches 188 (inside C: split at 188), the match
    is cut back to B's end (128): K/V rows [0, 128) and state slot 7 are reused, the
    request computes [128, 190) from slot 7's state copied into its own slot.

- **Match**: ``match_prefix`` walks the K/V as for any model, then goes up to the deepest
  node on the path that has a snapshot (the root: nothing reused). ``raw=True`` skips the
  cut (a request re-locking the tokens it computed itself, whose state is in its slot).
- **Split**: the upper part is a new node without a snapshot; the lower keeps the node's
  end, so it keeps the snapshot.
- **Budget and LRU**: at most ``snapshot_budget`` slots are held by the tree (and by
  requests' pending snapshots, counted by the cache manager); ``evict_snapshots`` frees
  those of unlocked nodes, least recently matched first. A locked node (on a running
  request's path) keeps its snapshot: the request may still have to read it.
- **K/V eviction** frees a removed leaf's snapshot with it, and (``_leaf_priority``) takes
  leaves without a snapshot first: nothing can reuse their K/V.
"""

from __future__ import annotations

from typing import Any

from radixlm.radix_cache.state_pool import StateSlots


class SnapshotTree:
    """Mixed into ``RadixCache`` (its root, ``_nodes``, LRU clock). With ``states`` None
    (a model of attention layers only) every node's ``snapshot`` stays None and nothing
    here changes a match."""

    states: StateSlots | None
    snapshot_budget: int

    def init_snapshots(self, states: StateSlots | None, budget: int) -> None:
        self.states, self.snapshot_budget = states, budget
        self._snapshots: dict[int, Any] = {}  # slot -> node holding it
        self.evicted_snapshots = 0  # by evict_snapshots since start (a metric)

    def num_snapshots(self) -> int:
        """Snapshot slots held by the tree."""
        return len(self._snapshots)

    def snapshot_slots(self) -> list[int]:
        return list(self._snapshots)

    def _snapshot_cut(self, node: Any) -> Any:
        """The deepest node on root..node with a snapshot (the root if none)."""
        while node is not self.root and node.snapshot is None:
            node = node.parent
        return node

    def attach_snapshot(self, node: Any, slot: int) -> bool:
        """Give ``slot`` (the state after ``node``'s path) to ``node``. False, and the
        slot still the caller's, if ``node`` is the root or already has one."""
        assert self.states is not None, "snapshots need a state pool"
        if node is self.root or node.snapshot is not None:
            return False
        assert slot not in self._snapshots, f"state slot {slot} held twice"
        node.snapshot = slot
        self._snapshots[slot] = node
        return True

    def _drop_snapshot(self, node: Any) -> None:
        """Free ``node``'s snapshot slot (if any) to the state pool."""
        if node.snapshot is None:
            return
        assert self.states is not None
        del self._snapshots[node.snapshot]
        self.states.free(node.snapshot)
        node.snapshot = None

    def evict_snapshots(self, num: int) -> int:
        """Free up to ``num`` snapshots of unlocked nodes, least recently matched first;
        return how many were freed."""
        victims = sorted((n for n in self._snapshots.values() if n.lock_ref == 0),
                         key=lambda n: (n.last_access, n.node_id))[:num]
        for node in victims:
            self._drop_snapshot(node)
        self.evicted_snapshots += len(victims)
        return len(victims)

    def _reset_snapshots(self) -> None:
        """Free every snapshot (``reset``: nothing is locked)."""
        for node in list(self._snapshots.values()):
            self._drop_snapshot(node)

    def _leaf_priority(self, node: Any) -> tuple[int, ...]:
        """Eviction order of leaves: with snapshots kept, those without one go first."""
        base = self._priority(node)
        return base if self.states is None else (int(node.snapshot is not None), *base)

    def _check_snapshots(self) -> None:
        """Every node's snapshot is in the slot map and the other way round, no slot is
        held twice or free in the state pool, and the count is within budget."""
        held = {n.snapshot: n for n in self._nodes() if n.snapshot is not None}
        assert self.root.snapshot is None, "the root holds a snapshot"
        assert held.keys() == self._snapshots.keys() and all(
            self._snapshots[s] is n for s, n in held.items()), (
            f"snapshot map {sorted(self._snapshots)} != nodes' {sorted(held)}")
        n_nodes = sum(n.snapshot is not None for n in self._nodes())
        assert n_nodes == len(held), "two nodes hold one snapshot slot"
        if self.states is None:
            assert not held, "snapshots without a state pool"
            return
        free = [s for s in held if self.states.is_free(s)]
        assert not free, f"tree holds free state slots {free}"
