"""Hierarchical caching (``--enable-hierarchical-cache``): the storage tier under the tree.

::

    request --match--> radix tree (KV pool)  --miss past the match--> storage pages
                          |   ^                                            |   ^
         write_through:   |   |  load: fresh pool slots, inserted          |   |
         on insert;       |   +--------------------------------------------+   |
         write_back:      +--------------------------------------------------+
         on eviction          (copy of the rows, written by a background thread)

Pages of the tier are ``block_tokens`` tokens (the pool's page size, rounded up to at least
``MIN_BLOCK_TOKENS``: one file per KV page of a pool with ``--page-size 1`` would be a file
per token) at positions that are multiples of it from the start of a sequence, under the
content keys of ``radix_cache.storage.page_keys``. A request's pages past its in-pool
prefix are prefetched while it waits in the queue (``prefetch``); the scheduler skips it
while it is not ``ready`` (``radix_cache.storage.prefetch_policy``: the default ``auto``
waits while loading is measured faster than computing) and it takes what arrived when it is
admitted (``take``). The scheduler thread never blocks on storage. There is no separate
host-memory tier: on a CPU the pool is host memory.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

import torch

from radixlm.radix_cache.kv_events import MEDIUM_DISK, KVEventRecorder, chain_hashes
from radixlm.radix_cache.radix_tree import TreeNode
from radixlm.radix_cache.storage.file_backend import FileStorage
from radixlm.radix_cache.storage.page_keys import model_identity, page_keys
from radixlm.radix_cache.storage.prefetch_policy import ComputeRate, wait_s
from radixlm.radix_cache.storage.tier import PageLoad, StorageTier
from radixlm.runtime.config_checks import HICACHE_PREFETCH_POLICIES, HICACHE_WRITE_POLICIES

logger = logging.getLogger(__name__)

MIN_BLOCK_TOKENS = 64
MAX_LOADS = 256  # prefetches of requests still waiting (older ones are dropped)

ReadKV = Callable[[torch.Tensor], list[torch.Tensor]]
WriteKV = Callable[[torch.Tensor, list[torch.Tensor]], None]


def block_tokens_for(page_size: int) -> int:
    """Tokens per stored page: whole pool pages, at least ``MIN_BLOCK_TOKENS``."""
    return page_size * -(-MIN_BLOCK_TOKENS // page_size)


class HiCache:
    """Joins the cache manager's tree and pool (``read_kv`` / ``write_kv``: K/V rows of
    every layer at pool slots, ``[K_0, V_0, K_1, ...]``, each ``[n, kv heads, head_dim]``)
    to a ``StorageTier``. ``layout``: what besides the checkpoint and weight version
    changes the KV bytes (``page_keys.model_identity``)."""

    def __init__(self, tier: StorageTier, block_tokens: int, layout: dict[str, object],
                 write_policy: str, prefetch_policy: str, read_kv: ReadKV,
                 write_kv: WriteKV) -> None:
        assert write_policy in HICACHE_WRITE_POLICIES, write_policy
        assert prefetch_policy in HICACHE_PREFETCH_POLICIES, prefetch_policy
        self.tier = tier
        self.block_tokens = block_tokens
        self.layout = layout
        self.write_policy = write_policy
        self.prefetch_policy = prefetch_policy
        self.read_kv, self.write_kv = read_kv, write_kv
        self.identity = ""
        self.loads: OrderedDict[str, PageLoad] = OrderedDict()
        self.compute = ComputeRate()  # prefill seconds per token (the auto policy)
        self.stats = {"storage_hit_tokens": 0, "storage_loaded_bytes": 0}
        # the tree's KV events (None: none wanted): a page written to storage is recorded
        # as BlockStored blocks of the tree's page size, medium DISK (attach_events)
        self.events: KVEventRecorder | None = None

    def set_model(self, model_path: str, weight_version: str) -> None:
        """The model every key names; a new one (a weight update) makes other keys, so no
        page computed by the old weights is read."""
        self.identity = model_identity(model_path, weight_version, self.layout)
        for load in self.loads.values():
            self.tier.release(load)
        self.loads.clear()

    def attach_events(self, events: KVEventRecorder | None) -> None:
        """Record the pages this replica writes in the tree's event stream (the tree's
        block hashes, so a consumer matches storage hits with the chain it already uses)."""
        assert events is None or self.block_tokens % events.block_size == 0, (
            self.block_tokens, events.block_size)
        self.events = events

    def _record_stored(self, token_ids: Sequence[int], pages: list[int],
                       namespace: str | None) -> None:
        if self.events is None or not pages:
            return
        bs, b = self.events.block_size, self.block_tokens
        per = b // bs
        chain = chain_hashes(token_ids[:(pages[-1] + 1) * b], bs, namespace)
        for i in pages:
            hashes = chain[i * per:(i + 1) * per]
            parent = chain[i * per - 1] if i else None
            tokens = [int(t) for t in token_ids[i * b:(i + 1) * b]]
            self.events.stored(hashes, parent, tokens, medium=MEDIUM_DISK)

    def keys(self, token_ids: Sequence[int], namespace: str | None) -> list[str]:
        return page_keys(self.identity, namespace, token_ids, self.block_tokens)

    # --- writes ---------------------------------------------------------------------------
    def after_insert(self, token_ids: Sequence[int], slots: torch.Tensor,
                     namespace: str | None) -> None:
        """``write_through``: the pages of ``token_ids`` (KV at ``slots``) not stored yet."""
        if self.write_policy == "write_through":
            self.write(token_ids, slots, namespace, 0)

    def on_evict(self, leaf: TreeNode) -> None:
        """The tree is about to free ``leaf`` (its path's slots still hold their KV): write
        the pages that end inside it (under either policy: write-through may have dropped
        some)."""
        nodes = []
        node: TreeNode | None = leaf
        while node is not None and node.parent is not None:
            nodes.append(node)
            node = node.parent
        nodes.reverse()
        tokens = [t for n in nodes for t in n.key]
        slots = torch.cat([n.value for n in nodes])
        self.write(tokens, slots, leaf.namespace, len(tokens) - len(leaf.key))

    def write(self, token_ids: Sequence[int], slots: torch.Tensor, namespace: str | None,
              start: int) -> None:
        """Queue the whole pages of ``token_ids`` that end past token ``start`` and are not
        known to be stored; their rows are copied now (the slots may be reused next)."""
        b = self.block_tokens
        keys = self.keys(token_ids, namespace)
        todo = [i for i in range(start // b, len(keys)) if not self.tier.known(keys[i])]
        if not todo:
            return
        index = torch.cat([slots[i * b:(i + 1) * b] for i in todo])
        frames = self.read_kv(index)
        queued = []
        for j, i in enumerate(todo):
            kv = torch.stack([f[j * b:(j + 1) * b] for f in frames])
            tokens = [int(t) for t in token_ids[i * b:(i + 1) * b]]
            if self.tier.write(keys[i], tokens, kv):  # False: dropped (counted there)
                queued.append(i)
        self._record_stored(token_ids, queued, namespace)

    # --- reads ----------------------------------------------------------------------------
    def prefetch(self, rid: str, token_ids: Sequence[int], namespace: str | None,
                 cached_len: int) -> None:
        """Start reading the pages of a queued request past its ``cached_len`` in-pool
        tokens (``token_ids``: what it may take from the cache)."""
        if len(token_ids) // self.block_tokens <= cached_len // self.block_tokens:
            return
        old = self.loads.pop(rid, None)
        if old is not None:
            self.tier.release(old)
        self.loads[rid] = self._start(token_ids, namespace, cached_len)
        while len(self.loads) > MAX_LOADS:
            self.tier.release(self.loads.popitem(last=False)[1])

    def ready(self, rid: str) -> bool:
        """Whether a queued request may be scheduled now: it has no load (none was needed,
        or it was dropped past ``MAX_LOADS``: it goes on without storage; restarting it here
        would drop the next request's, and none would ever finish), or its load is done,
        past its deadline, or stalled on a page (then a miss)."""
        load = self.loads.get(rid)
        if load is None:
            return True
        now = time.monotonic()
        self.tier.poll(now)
        return (load.done.is_set() or now >= load.deadline
                or load.stalled(now, self.tier.page_deadline))

    def loading(self) -> bool:
        """Whether any queued request's load is still running."""
        return any(not load.done.is_set() for load in self.loads.values())

    def wait(self, timeout: float) -> None:
        """Nap until a page arrives or a load ends (at most ``timeout`` s): the scheduler,
        with nothing else to do, waits for ``ready`` without spinning."""
        self.tier.progress.wait(timeout)
        self.tier.progress.clear()

    def take(self, rid: str, token_ids: Sequence[int], namespace: str | None,
             cached_len: int) -> tuple[int, torch.Tensor] | None:
        """At admission: ``(start, kv)`` with ``kv`` ``[2 * layers, n, heads, head_dim]``
        the rows of tokens ``start .. start + n`` (``start <= cached_len < start + n``), as
        far as storage delivered them contiguously by now (never waits); None if none."""
        b = self.block_tokens
        load = self.loads.pop(rid, None)
        if load is None:
            return None
        self.tier.release(load)  # cancelled: what arrives later is dropped
        skip = cached_len // b - load.first_page
        pages = load.pages[skip:] if skip >= 0 else []  # the tree lost pages before it
        if not pages:
            return None
        start = (load.first_page + skip) * b
        return start, torch.cat(pages, dim=1)

    def observe_prefill(self, tokens: int, seconds: float) -> None:
        """A prefill step computed ``tokens`` tokens in ``seconds`` (the auto policy)."""
        self.compute.observe(tokens, seconds)

    def _start(self, token_ids: Sequence[int], namespace: str | None, cached_len: int
               ) -> PageLoad:
        b = self.block_tokens
        keys = self.keys(token_ids, namespace)
        tokens = [[int(t) for t in token_ids[i * b:(i + 1) * b]] for i in range(len(keys))]
        load = self.tier.start_load(keys, tokens, cached_len // b)
        pages = len(keys) - cached_len // b
        load.deadline = load.started + wait_s(
            self.prefetch_policy, pages, pages * b, self.compute.seconds_per_token,
            self.tier.page_seconds)
        return load

    def loaded(self, tokens: int, kv: torch.Tensor) -> None:
        """Count ``tokens`` served from storage (``kv``: what was read for them)."""
        self.stats["storage_hit_tokens"] += tokens
        self.stats["storage_loaded_bytes"] += kv.numel() * kv.element_size()

    def close(self) -> None:
        for load in self.loads.values():
            self.tier.release(load)
        self.loads.clear()
        self.tier.close()

    def counters(self) -> dict[str, int]:
        """Flat counts for ``get_info`` (summed over replicas, exported to /metrics)."""
        out = {f"hicache_{k}": v for k, v in self.stats.items()}
        out.update({f"hicache_storage_{k}": v for k, v in self.tier.stats.items()})
        out["hicache_storage_pending_write_bytes"] = self.tier.pending_write_bytes()
        return out

    def info(self) -> dict[str, Any]:
        """The tiers as ``/get_server_info`` shows them."""
        return {"tiers": ["device" if self.layout.get("device") == "cuda" else "host",
                          "storage"],
                "write_policy": self.write_policy, "prefetch_policy": self.prefetch_policy,
                "block_tokens": self.block_tokens, "storage": self.tier.backend.info()}


def pool_io(runner: Any) -> tuple[ReadKV, WriteKV]:
    """``runner``'s K/V rows by slot: its own pool, or every rank's shard under
    ``--tp-size`` (the model runner's collectives)."""
    if runner.tp.size > 1:
        return runner.read_kv, runner.write_kv
    pool = runner.kv_pool

    def read(slots: torch.Tensor) -> list[torch.Tensor]:
        idx = slots.to(pool.device)
        return [b[idx].cpu() for k, v in zip(pool.k_buffers, pool.v_buffers) for b in (k, v)]

    def write(slots: torch.Tensor, frames: list[torch.Tensor]) -> None:
        idx = slots.to(pool.device)
        for layer, (k, v) in enumerate(zip(pool.k_buffers, pool.v_buffers)):
            k[idx] = frames[2 * layer].to(k.device)
            v[idx] = frames[2 * layer + 1].to(v.device)

    return read, write


def build_hicache(args: Any, runner: Any, model_path: str, weight_version: str
                  ) -> HiCache | None:
    """The tier of ``--enable-hierarchical-cache`` for ``runner``'s pool, or None."""
    if not args.enable_hierarchical_cache:
        return None
    pool = runner.kv_pool
    heads = runner.model_config.num_key_value_heads  # every head (read_kv joins the shards)
    block = block_tokens_for(args.page_size)
    layout = {"kv_dtype": str(pool.dtype), "dtype": str(runner.dtype),
              "device": runner.device.type, "tp_size": args.tp_size,
              "torchao": args.torchao_config, "layers": pool.num_layers,
              "kv_heads": heads, "head_dim": pool.head_dim}
    backend = FileStorage(args.hicache_storage_dir, int(args.hicache_storage_size_gb * (1 << 30)))
    tier = StorageTier(backend, pool.dtype, (2 * pool.num_layers, block, heads, pool.head_dim))
    cache = HiCache(tier, block, layout, args.hicache_write_policy,
                    args.hicache_storage_prefetch_policy, *pool_io(runner))
    cache.set_model(model_path, weight_version)
    logger.info("hierarchical cache: file storage at %s (%.1f GB max), %d-token pages, %s, "
                "prefetch %s", backend.root, args.hicache_storage_size_gb, block,
                args.hicache_write_policy, args.hicache_storage_prefetch_policy)
    return cache
