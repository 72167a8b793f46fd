"""A hybrid model's recurrent-state snapshots, on the scheduler's side: where a request's
prefill saves its state, and handing the saved slots to the radix tree.

The tree's snapshots hold state-pool slots (``radix_cache/snapshot_tree.py``), at most
``budget`` of them counting the ones requests have pending. A request's snapshots are
planned before its prefill forward (``plan``: page-aligned points of the chunk, where the
forward writes the state into fresh slots), given to the tree nodes ending at those points
when the chunk's tokens are inserted (``give``), and a finished request's own slot becomes
the snapshot at its end when that end is page-aligned (``give_own_state``). The
``CacheManager`` calls these where it moves the request's K/V.
"""

from __future__ import annotations

from radixlm.radix_cache.radix_tree import RadixCache
from radixlm.radix_cache.state_pool import StateSlots
from radixlm.runtime.managers.scheduler.schedule_batch import Req

# a hybrid's prefill snapshots its state at 64, 128, 256, ... tokens (``plan``): a later
# request sharing any prefix of L >= 64 tokens reuses more than L / 2 of it, at
# log2(prompt / 64) snapshots a prompt
FIRST_DOUBLING_SNAPSHOT = 64


class Snapshots:
    def __init__(self, states: StateSlots, tree: RadixCache, budget: int, page_size: int,
                 inner: bool) -> None:
        """``budget``: snapshot slots (held by the tree plus pending); ``inner``: the model
        writes states inside an extend (``StateIndices.saves``), not only at its end."""
        self.states, self.tree = states, tree
        self.budget, self.page_size, self.inner = budget, page_size, inner
        self.pending = 0  # planned by requests, not yet given to the tree

    def plan(self, reqs: list[Req], extend_lens: list[int], num_prefill: int) -> None:
        """Before a forward: each prefill chunk of ``reqs[:num_prefill]`` saves the state
        at page-aligned points of it into fresh slots (``req.snaps``: ``[pos, slot]``,
        written by the forward), which the tree takes when the chunk's tokens are
        inserted. No free slot within the budget (after evicting unlocked snapshots): no
        more snapshots, nothing else changes."""
        if not self.budget:
            return
        for req, n in zip(reqs[:num_prefill], extend_lens[:num_prefill]):
            for pos in self._points(req, n):
                slot = self.states.alloc() if self._fits() else None
                if slot is None:
                    return
                req.snaps.append([pos, slot])
                self.pending += 1

    def _points(self, req: Req, n: int) -> list[int]:
        """Where a chunk ``[kv_len, kv_len + n)`` of ``req`` snapshots, page-aligned:
        its end, but no later than the last token before the sequence's last (all that a
        request with the same tokens can match: the n > 1 warm-up's samples); the branch
        point where its K/V match outran its snapshot match (the next request with that
        prefix matches it all); and 64, 128, 256, ... tokens (a request sharing part of
        this prompt reuses at least half of the part), in that order of worth (a full
        budget keeps the first). A model without inner snapshots: only the chunk's end,
        when that is page-aligned."""
        start, end, ps = req.kv_len, req.kv_len + n, self.page_size
        if not self.inner:
            return [end] if end % ps == 0 and end > start else []
        last = min(end, req.seq_len - 1)
        points = [last, req.branch_pos]
        p = FIRST_DOUBLING_SNAPSHOT
        while p <= last:
            points.insert(2, p)  # the deepest first
            p *= 2
        aligned = (q - q % ps for q in points)
        return list(dict.fromkeys(q for q in aligned if start < q <= last))

    def stop(self, req: Req) -> int:
        """Where ``req``'s prefill must end a chunk (0: nowhere): for a prefill-only
        request (``max_new_tokens`` 0: the n > 1 warm-up) of a hybrid whose model snapshots
        only at an extend's end, the last page end before its last token, as far as its
        samples can match, so the snapshot they start from is there."""
        if not self.budget or self.inner or req.sampling_params.max_new_tokens != 0:
            return 0
        pos = req.seq_len - 1
        return pos - pos % self.page_size

    def _fits(self) -> bool:
        """Whether one more snapshot fits the budget (evicting the least recently used
        unlocked one when it is full)."""
        held = self.tree.num_snapshots() + self.pending
        return held < self.budget or self.tree.evict_snapshots(1)

    def give(self, req: Req) -> None:
        """The tree takes ``req``'s pending snapshots at the nodes ending at their points
        (split there if needed), except where a node has one already (those are freed)."""
        for pos, slot in req.snaps:
            m = (self.tree.match_prefix(req.fill_ids[:pos], namespace=req.namespace, raw=True)
                 if pos <= req.kv_len else None)  # else: not computed (no forward ran)
            if (m is None or len(m.slots) != pos
                    or not self.tree.attach_snapshot(m.last_node, slot)):
                self.states.free(slot)
        self.pending -= len(req.snaps)
        req.snaps = []

    def drop(self, req: Req) -> None:
        """Free ``req``'s pending snapshots (released without caching)."""
        for _, slot in req.snaps:
            self.states.free(slot)
        self.pending -= len(req.snaps)
        req.snaps = []

    def give_own_state(self, req: Req, aligned: int) -> None:
        """A finished (or retracted) request whose computed tokens end on a page: its own
        slot holds the state there, so the tree takes the slot as that node's snapshot
        (within the budget) instead of it being freed."""
        if (not self.budget or req.state_slot is None or aligned == 0
                or req.kv_len != aligned):
            return
        m = self.tree.match_prefix(req.fill_ids[:aligned], namespace=req.namespace, raw=True)
        if len(m.slots) != aligned or m.last_node.snapshot is not None or not self._fits():
            return
        self.tree.attach_snapshot(m.last_node, req.state_slot)
        req.state_slot = None

    def check(self, running: list[Req]) -> None:
        """free + request-owned + pending + tree-held == state pool size, each running
        request one slot of its own, each snapshot one (``StateSlots.check_integrity``),
        and the snapshots within their budget."""
        owned = [r.state_slot for r in running]
        assert None not in owned, f"running requests without a state slot: {owned}"
        pending = [slot for r in running for _, slot in r.snaps]
        assert len(pending) == self.pending, (
            f"pending snapshots {pending} != counter {self.pending}")
        held = self.tree.snapshot_slots()
        assert len(held) + len(pending) <= self.budget, (
            f"{len(held)} + {len(pending)} pending snapshots > budget {self.budget}")
        self.states.check_integrity(owned + pending + held)
