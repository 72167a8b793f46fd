"""PrefixIndex: which blocks each replica caches, rebuilt from its KV events.

A router that sees token ids asks ``match(token_ids, namespace)`` and gets, per replica,
how many leading tokens that replica has cached: the request's tokens are hashed block by
block with the same chain as the tree (``kv_events.chain_hashes``) and each replica's match
ends at the first block it does not hold. Events are applied in the order a replica
published them; detecting lost batches (sequence numbers) is the subscriber's job.

Blocks a replica wrote to the storage tier (``medium`` ``DISK``) are kept apart, in one set
for all replicas: the tier's directory is shared, so a page one replica stored is a hit
for every replica (``match_storage``); a replica's own flush does not remove them.
"""

from __future__ import annotations

from collections.abc import Sequence

from radixlm.radix_cache.kv_events import (
    MEDIUM_DISK,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    block_hash,
)


class PrefixIndex:
    """Per-replica sets of cached block hashes; replicas are ``0 .. num_replicas - 1``.

    ``block_size`` is every replica's page size; a BlockStored with another size is an
    error (a consumer could not chain the request's tokens for that replica).
    """

    def __init__(self, num_replicas: int, block_size: int) -> None:
        assert num_replicas > 0 and block_size > 0, (num_replicas, block_size)
        self.block_size = block_size
        self._blocks: list[set[int]] = [set() for _ in range(num_replicas)]
        self._storage: set[int] = set()  # blocks in the shared storage tier

    @property
    def num_replicas(self) -> int:
        return len(self._blocks)

    def apply(self, replica: int, batch: KVEventBatch) -> None:
        """Apply one replica's batch of events, in order."""
        for event in batch.events:
            blocks = (self._storage if getattr(event, "medium", None) == MEDIUM_DISK
                      else self._blocks[replica])
            if isinstance(event, BlockStored):
                if event.block_size != self.block_size:
                    raise ValueError(f"replica {replica} stored blocks of {event.block_size} "
                                     f"tokens; this index chains blocks of {self.block_size}")
                blocks.update(event.block_hashes)
            elif isinstance(event, BlockRemoved):
                blocks.difference_update(event.block_hashes)
            elif isinstance(event, AllBlocksCleared):
                self._blocks[replica].clear()
            else:
                raise TypeError(f"unknown KV event {event!r}")

    def match(self, token_ids: Sequence[int], namespace: str | None = None) -> list[int]:
        """Cached prefix length in tokens (a multiple of ``block_size``) on each replica."""
        return self.match_tiers(token_ids, namespace)[0]

    def match_storage(self, token_ids: Sequence[int], namespace: str | None = None) -> int:
        """Leading tokens of ``token_ids`` in the shared storage tier (a multiple of
        ``block_size``), any replica's writes."""
        return self.match_tiers(token_ids, namespace)[1]

    def match_tiers(self, token_ids: Sequence[int], namespace: str | None = None
                    ) -> tuple[list[int], int]:
        """``match`` and ``match_storage`` in one walk: each block hashed once, the walk
        ending where neither a replica nor the storage tier holds the next block."""
        bs = self.block_size
        matched, stored = [0] * len(self._blocks), 0
        live = [r for r, blocks in enumerate(self._blocks) if blocks]
        in_storage = bool(self._storage)
        parent: int | None = None
        for start in range(0, len(token_ids) - bs + 1, bs):
            if not live and not in_storage:
                break
            parent = block_hash(parent, token_ids[start : start + bs], namespace)
            live = [r for r in live if parent in self._blocks[r]]
            for r in live:
                matched[r] = start + bs
            in_storage = in_storage and parent in self._storage
            if in_storage:
                stored = start + bs
        return matched, stored

    def blocks(self, replica: int) -> set[int]:
        """A copy of the block hashes ``replica`` caches."""
        return set(self._blocks[replica])

    def drop_replica(self, replica: int) -> None:
        """Forget everything ``replica`` cached (it died, or its stream must be resynced);
        it matches nothing until new events arrive."""
        self._blocks[replica].clear()
