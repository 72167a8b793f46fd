"""The scheduler's cache manager: a request's KV slots against the pool and the radix tree.

It owns the allocator, the request-to-token table and the radix tree, and is the only
place that moves slots between them, so the accounting invariant of docs/design.md

    free + evictable + protected + request-owned == pool size

can be checked here (``check_accounting``).

A hybrid model's state slots (``radix_cache/state_pool.py``) are moved here too: each
running request owns one, the tree's snapshots hold others (``snapshots.py``: where they are
taken and handed to the tree), so ``free + request-owned + pending + tree-held == state pool
size``.
"""

from __future__ import annotations

import logging

import torch

from radixlm.radix_cache.allocator import PagedAllocator
from radixlm.radix_cache.kv_events import KVEventRecorder
from radixlm.radix_cache.kv_pool import ReqToTokenPool
from radixlm.radix_cache.radix_tree import MatchResult, RadixCache
from radixlm.radix_cache.state_pool import StateSlots
from radixlm.radix_cache.swa_allocator import SWAAllocator, SWASpec
from radixlm.runtime.managers.scheduler.hicache import HiCache
from radixlm.runtime.managers.scheduler.schedule_batch import Req
from radixlm.runtime.managers.scheduler.snapshots import Snapshots

logger = logging.getLogger(__name__)

# a shared prefix shorter than this is not worth a separate attention pass
MIN_SHARED_PREFIX = 64


def _ceil_to(n: int, page: int) -> int:
    return -(-n // page) * page


class CacheManager:
    def __init__(self, pool_size: int, page_size: int, max_reqs: int, max_context_len: int,
                 disable_radix_cache: bool, device: torch.device,
                 eviction_policy: str = "lru", events: KVEventRecorder | None = None,
                 hicache: HiCache | None = None, swa: SWASpec | None = None,
                 state_slots: int = 0, snapshot_slots: int = 0,
                 inner_snapshots: bool = False) -> None:
        """``hicache``: the storage tier under the tree (``--enable-hierarchical-cache``):
        evicted pages are written to it, admissions load from it what the tree lacks.
        ``swa``: the sliding layers' pool (``--enable-hybrid-swa-memory``); each running
        request's sliding slots older than its window are freed as it runs.
        ``state_slots``: a hybrid model's state pool size (``radix_cache/state_pool.py``;
        0: the model has no linear-attention layer): each running request owns one slot,
        and with the radix cache on, up to ``snapshot_slots`` of them are the tree's
        recurrent-state snapshots. ``inner_snapshots``: the model writes states inside an
        extend (``StateIndices.saves``), not only at its end."""
        self.page_size = page_size
        self.pool_size = pool_size
        self.swa = swa
        if swa is None:
            self.allocator = PagedAllocator(pool_size, page_size, device=device)
        else:
            self.allocator = SWAAllocator(pool_size, swa.size, swa.full_to_swa, page_size,
                                          device=device)
        self.req_to_token_pool = ReqToTokenPool(
            max_reqs, _ceil_to(max_context_len, page_size) + page_size, device=device)
        self.states = StateSlots(state_slots) if state_slots else None
        self.snapshot_slots = 0 if disable_radix_cache or self.states is None else snapshot_slots
        self.tree = RadixCache(self.allocator, page_size, disable=disable_radix_cache,
                               eviction_policy=eviction_policy, events=events,
                               swa_window=None if swa is None else swa.window,
                               states=self.states if self.snapshot_slots else None,
                               snapshot_budget=self.snapshot_slots)
        self.snapshots = None if self.states is None else Snapshots(
            self.states, self.tree, self.snapshot_slots, page_size, inner_snapshots)
        self.hicache = None if disable_radix_cache else hicache
        if self.hicache is not None:
            self.tree.on_evict = self.hicache.on_evict
            self.hicache.attach_events(events)
        self.running: dict[str, Req] = {}  # requests that hold a req_to_token row
        self.inserted: dict[str, int] = {}  # rid -> tokens it put in the tree (hits counted)
        self.evicted_tokens = 0  # freed by eviction since start (a metric)

    # --- sizes ------------------------------------------------------------------------
    def available_size(self) -> int:
        """Tokens that can be allocated now, evicting unlocked tree nodes if needed."""
        return self.allocator.available_size() + self.tree.evictable_size()

    def used_size(self) -> int:
        return self.pool_size - self.allocator.available_size() - self.tree.evictable_size()

    def pages_needed(self, req: Req, num_new: int) -> int:
        """Tokens (whole pages) to allocate for ``req`` to extend its KV by ``num_new``."""
        return max(_ceil_to(req.kv_len + num_new, self.page_size) - req.alloc_len, 0)

    # --- admission --------------------------------------------------------------------
    def match(self, req: Req) -> int:
        """Length of the cached prefix ``req`` could reuse (no locking)."""
        ids = req.fill_ids[: req.max_cached_prefix()]
        return len(self.tree.match_prefix(ids, namespace=req.namespace).slots)

    def admit(self, req: Req) -> bool:
        """Give ``req`` a row (and, for a hybrid model, a state slot) and lock its cached
        prefix. False, and nothing held, if no row or no state slot is free."""
        row = self.req_to_token_pool.alloc()
        if row is None:
            return False
        if self.states is not None:
            req.state_slot = self.states.alloc()
            if req.state_slot is None:  # the request waits for a running one to end
                self.req_to_token_pool.free(row)
                return False
        ids = req.fill_ids[: req.max_cached_prefix()]
        m = self.tree.match_prefix(ids, namespace=req.namespace)
        loaded = 0
        if self.hicache is not None:
            m, loaded = self._load_from_storage(req, ids, m)
        n = len(m.slots)
        self.req_to_token_pool.req_to_token[row, :n] = m.slots
        if n and self.states is not None:  # its first forward starts from the snapshot
            assert m.last_node.snapshot is not None, f"match of {n} without a snapshot"
            req.state_restore = m.last_node.snapshot
        # where its K/V match ended past the snapshot: the branch point other requests
        # with this prefix will want a snapshot at
        req.branch_pos = m.raw_len if m.raw_len > n else 0
        self.tree.inc_lock_ref(m.last_node)
        req.swa_uuid = self.tree.inc_swa_lock(m.last_node)
        req.req_pool_idx, req.last_node = row, m.last_node
        req.prefix_len = req.kv_len = req.alloc_len = n
        if not req.admitted_once:
            req.cached_tokens, req.admitted_once = n, True
            req.storage_cached_tokens = loaded
        self.running[req.rid] = req
        return True

    def prefetch(self, req: Req) -> None:
        """A request joined the queue: start reading its pages the tree lacks."""
        if self.hicache is not None:
            ids = req.fill_ids[: req.max_cached_prefix()]
            cached = len(self.tree.match_prefix(ids, namespace=req.namespace).slots)
            self.hicache.prefetch(req.rid, ids, req.namespace, cached)

    def storage_ready(self, req: Req) -> bool:
        """Whether ``req`` may be admitted now as far as storage goes: False while its
        pages are loading and its prefetch policy says wait (the scheduler skips it; it
        never blocks on storage)."""
        return self.hicache is None or self.hicache.ready(req.rid)

    def wait_storage(self, timeout: float) -> bool:
        """With storage loads in flight, nap until one progresses (at most ``timeout`` s);
        False (at once) if none is."""
        if self.hicache is None or not self.hicache.loading():
            return False
        self.hicache.wait(timeout)
        return True

    def observe_prefill(self, tokens: int, seconds: float) -> None:
        """A prefill step's tokens and time: the storage tier's measure of computing."""
        if self.hicache is not None:
            self.hicache.observe_prefill(tokens, seconds)

    def _load_from_storage(self, req: Req, ids: list[int], m: MatchResult
                           ) -> tuple[MatchResult, int]:
        """Extend the match ``m`` of ``ids`` with the pages storage holds past it: fresh
        slots get their K/V and go into the tree. Returns the new match and the tokens
        loaded (0, and ``m``, when storage holds none or the pool has no room)."""
        assert self.hicache is not None
        n = len(m.slots)
        got = self.hicache.take(req.rid, ids, req.namespace, n)
        if got is None:
            return m, 0
        start, kv = got
        end = start + kv.shape[1]
        self.tree.inc_lock_ref(m.last_node)  # making room must not evict the match
        ok = self.ensure_free(end - n)
        self.tree.dec_lock_ref(m.last_node)
        if not ok:
            return m, 0
        slots = self.allocator.alloc(end - n)
        assert slots is not None, f"alloc of {end - n} failed after ensure_free"
        self.hicache.write_kv(slots, list(kv[:, n - start:].unbind(0)))
        p = self.tree.insert(ids[:end], torch.cat([m.slots, slots]), namespace=req.namespace)
        assert p == n, f"storage load: the tree grew from {n} to {p} tokens meanwhile"
        self.inserted[req.rid] = end  # its hit is counted
        self.hicache.loaded(end - n, kv)
        return self.tree.match_prefix(ids[:end], namespace=req.namespace), end - n

    def alloc(self, req: Req, num_new: int) -> bool:
        """Make room for ``num_new`` more tokens of ``req`` (evicting if needed)."""
        return self.alloc_many([req], [num_new])

    def alloc_many(self, reqs: list[Req], num_new: list[int]) -> bool:
        """Room for ``num_new[i]`` more tokens of each request, with one allocator call;
        False (and nothing changed) if the pool is short even after eviction."""
        needs = [self.pages_needed(r, n) for r, n in zip(reqs, num_new)]
        total = sum(needs)
        if total == 0:
            return True
        if not self.ensure_free(total):
            return False
        slots = self.allocator.alloc(total)
        assert slots is not None, f"alloc of {total} failed after ensure_free"
        rows, cols = [], []
        for r, need in zip(reqs, needs):
            if need:
                rows += [r.req_pool_idx] * need
                cols += range(r.alloc_len, r.alloc_len + need)
                r.alloc_len += need
        dev = slots.device
        self.req_to_token_pool.req_to_token[torch.tensor(rows, device=dev),
                                            torch.tensor(cols, device=dev)] = slots
        return True

    def ensure_free(self, num_tokens: int) -> bool:
        """Whether ``num_tokens`` slots (and, with the SWA pool, as many sliding slots) can
        be allocated now, after evicting from the tree what is short."""
        short = num_tokens - self.allocator.available_size()
        if short > 0:
            self.evicted_tokens += self.tree.evict(short)
        if self.swa is None:
            return self.allocator.available_size() >= num_tokens
        self.trim_windows()
        short = num_tokens - self.allocator.swa_available_size()
        if short > 0:
            self.tree.evict_swa(short)
        return (self.allocator.available_size() >= num_tokens
                and self.allocator.swa_available_size() >= num_tokens)

    # --- the SWA pool -------------------------------------------------------------------
    @property
    def max_extend(self) -> int | None:
        """Most tokens one request may compute in one forward (None: no limit): with the
        SWA pool, what a lone request's sliding slots leave room for (``swa_pool.py``)."""
        if self.swa is None:
            return None
        return self.swa.size - self.swa.window - 4 * self.page_size

    def swa_keep_from(self, req: Req) -> int:
        """The first position whose sliding K/V ``req`` still needs: its next query (at
        ``kv_len``) sees keys after ``kv_len - window``; one page more, page-aligned."""
        assert self.swa is not None
        keep = req.kv_len - self.swa.window - self.page_size
        return max(keep - keep % self.page_size, 0)

    def trim_windows(self) -> None:
        """Free the sliding slots every running request's window has left behind (only
        its own slots: the tree's, ``[0, prefix_len)``, stay, and are unlocked once the
        window has passed them all)."""
        assert isinstance(self.allocator, SWAAllocator)
        table = self.req_to_token_pool.req_to_token
        for r in self.running.values():
            start, keep = max(r.prefix_len, r.swa_released), self.swa_keep_from(r)
            if r.swa_uuid and keep >= r.prefix_len:
                self.tree.dec_swa_lock(r.last_node, r.swa_uuid)
                r.swa_uuid = 0
            if keep > start:
                self.allocator.free_swa(table[r.req_pool_idx, start:keep])
                r.swa_released = keep

    # --- release ----------------------------------------------------------------------
    def cache_unfinished(self, req: Req) -> None:
        """After a prefill chunk: put the computed tokens in the tree and re-lock on them,
        so that other requests can share them and retraction cannot lose them."""
        if self.tree.disable:
            return
        row = self.req_to_token_pool.req_to_token[req.req_pool_idx]
        ids = req.fill_ids[: req.kv_len]
        p, aligned = self._insert(req, row)
        self.inserted[req.rid] = aligned
        # our copies of what the tree already had are duplicates
        self._free_range(row, req.prefix_len, min(p, aligned))
        if self.snapshots is not None:
            self.snapshots.give(req)
        # its own tokens: their state is in its slot, so no cut back to a snapshot
        m = self.tree.match_prefix(ids[:aligned], namespace=req.namespace, raw=True)
        assert len(m.slots) == aligned, f"re-match gave {len(m.slots)}, expected {aligned}"
        row[:aligned] = m.slots
        self.tree.inc_lock_ref(m.last_node)
        uuid = self.tree.inc_swa_lock(m.last_node)
        self.tree.dec_swa_lock(req.last_node, req.swa_uuid)
        self.tree.dec_lock_ref(req.last_node)
        req.last_node, req.prefix_len, req.swa_uuid = m.last_node, aligned, uuid

    def _insert(self, req: Req, row: torch.Tensor) -> tuple[int, int]:
        """Put ``req``'s computed tokens in the tree (and the storage tier's write-through);
        (tokens the tree already had, the page-aligned length inserted)."""
        ids = req.fill_ids[: req.kv_len]
        aligned = req.kv_len - req.kv_len % self.page_size
        p = self.tree.insert(ids, row[: req.kv_len].clone(), namespace=req.namespace,
                             counted_len=self.inserted.get(req.rid, 0),
                             swa_from=max(req.prefix_len, req.swa_released))
        if self.hicache is not None:
            self.hicache.after_insert(ids[:aligned], row[:aligned], req.namespace)
        return p, aligned

    def release(self, req: Req, cache: bool) -> None:
        """Return a request's slots: into the tree (``cache``) or to the allocator."""
        row = self.req_to_token_pool.req_to_token[req.req_pool_idx]
        if cache and req.kv_len > 0:
            p, aligned = self._insert(req, row)
            self._free_range(row, req.prefix_len, min(p, aligned))
            self._free_range(row, aligned, req.alloc_len)
            if self.snapshots is not None:
                self.snapshots.give(req)
                self.snapshots.give_own_state(req, aligned)
        else:
            self._free_range(row, req.prefix_len, req.alloc_len)
            if self.snapshots is not None:
                self.snapshots.drop(req)
        req.state_restore = None
        self.tree.dec_swa_lock(req.last_node, req.swa_uuid)
        self.tree.dec_lock_ref(req.last_node)
        self.req_to_token_pool.free(req.req_pool_idx)
        if req.state_slot is not None:
            assert self.states is not None, f"{req} holds a state slot without a state pool"
            self.states.free(req.state_slot)
            req.state_slot = None
        del self.running[req.rid]
        self.inserted.pop(req.rid, None)
        req.req_pool_idx, req.last_node = None, None
        req.prefix_len = req.kv_len = req.alloc_len = req.swa_released = req.swa_uuid = 0

    def free_spare(self, req: Req) -> None:
        """Free ``req``'s whole pages past its computed tokens (a verification's rejected
        drafts: their KV is garbage, and ``alloc_len`` shrinks to the page of ``kv_len``)."""
        keep = _ceil_to(req.kv_len, self.page_size)
        if req.alloc_len > keep:
            self._free_range(self.req_to_token_pool.req_to_token[req.req_pool_idx], keep,
                             req.alloc_len)
            req.alloc_len = keep

    def _free_range(self, row: torch.Tensor, start: int, end: int) -> None:
        if end > start:
            self.allocator.free(row[start:end])

    def flush(self) -> bool:
        """Drop the whole tree; only when no request holds KV."""
        if self.running:
            return False
        self.tree.reset()
        return True

    # --- shared prefixes ------------------------------------------------------------------
    def shared_prefix_groups(self, reqs: list[Req]) -> list[tuple[int, list[int]]]:
        """``[(L, [batch indices])]``: requests whose first L KV slots are the same tree
        nodes (the deepest node on their paths that another request of the batch shares)."""
        paths, count = [], {}
        for r in reqs:
            path, node = [], r.last_node
            while node is not None and node is not self.tree.root:
                path.append(node)
                node = node.parent
            paths.append(path[::-1])
            for n in path:
                count[id(n)] = count.get(id(n), 0) + 1
        groups: dict[int, tuple[int, list[int]]] = {}
        for i, path in enumerate(paths):
            length, deepest = 0, None
            for n in path:
                if count[id(n)] < 2:
                    break
                length, deepest = length + len(n.key), n
            if deepest is not None and length >= MIN_SHARED_PREFIX:
                groups.setdefault(id(deepest), (length, []))[1].append(i)
        return [g for g in groups.values() if len(g[1]) >= 2]

    # --- invariants -------------------------------------------------------------------
    def request_owned(self) -> int:
        return sum(r.alloc_len - r.prefix_len for r in self.running.values())

    def swa_request_owned(self) -> int:
        """Sliding slots of running requests: their own tokens not yet trimmed."""
        return sum(r.alloc_len - max(r.prefix_len, r.swa_released)
                   for r in self.running.values())

    def check_accounting(self, deep: bool = True) -> None:
        """free + evictable + protected + request-owned == pool size, for each pool; with
        ``deep``, also the tree's own integrity check (walks every node) and, with the SWA
        pool, its mapping and every request's trimmed range."""
        free = self.allocator.available_size()
        ev, prot = self.tree.evictable_size(), self.tree.protected_size()
        owned = self.request_owned()
        total = free + ev + prot + owned
        assert total == self.pool_size, (
            f"KV accounting broken: free {free} + evictable {ev} + protected {prot} + "
            f"request-owned {owned} = {total} != pool size {self.pool_size}")
        if self.swa is not None:
            self._check_swa_accounting(deep)
        if self.snapshots is not None:
            self.snapshots.check(list(self.running.values()))
        if deep:
            self.tree.check_integrity()

    def _check_swa_accounting(self, deep: bool) -> None:
        assert self.swa is not None and isinstance(self.allocator, SWAAllocator)
        free = self.allocator.swa_available_size()
        ev, prot = self.tree.swa_evictable_size(), self.tree.swa_protected_size()
        owned = self.swa_request_owned()
        total = free + ev + prot + owned
        assert total == self.swa.size, (
            f"SWA accounting broken: free {free} + evictable {ev} + protected {prot} + "
            f"request-owned {owned} = {total} != SWA pool size {self.swa.size}")
        if not deep:
            return
        self.allocator.check_mapping()
        table = self.req_to_token_pool.req_to_token
        for r in self.running.values():
            kept = max(r.prefix_len, r.swa_released)
            row = table[r.req_pool_idx]
            assert not bool(self.allocator.has_swa(row[r.prefix_len:kept]).any()), (
                f"{r}: trimmed slots [{r.prefix_len}, {kept}) still have sliding slots")
            assert bool(self.allocator.has_swa(row[kept:r.alloc_len]).all()), (
                f"{r}: slots [{kept}, {r.alloc_len}) lack sliding slots")
