"""KV cache events in vLLM's wire format, and the chained block hashes they carry.

The radix tree reports what it caches so that a router (radixlm's own ``--dp-size``
dispatcher, or an external one: llm-d, Dynamo, vLLM's router) can keep an index of which
replica holds which prefix without asking it::

    insert of new pages  -> BlockStored(block_hashes, parent_block_hash, token_ids, ...)
    eviction of a leaf   -> BlockRemoved(block_hashes)
    reset (/flush_cache) -> AllBlocksCleared()
    split of a node      -> nothing (its pages, hence its blocks, do not change)

Wire format: the msgspec Structs below encode exactly as vLLM's
``vllm/distributed/kv_events.py`` (the array-like, tagged form that vLLM's
``examples/online_serving/kv_events_subscriber.py`` decodes): a batch is
``[ts, [event, ...], data_parallel_rank]`` and an event is ``["BlockStored", block_hashes,
parent_block_hash, token_ids, block_size, lora_id, medium]``. A decoder written for an older
vLLM (without ``medium`` or ``data_parallel_rank``) still reads it: msgspec ignores trailing
array items it does not know.

Blocks are the tree's pages: one block is ``page_size`` tokens. With ``page_size == 1`` a
block is one token, so a stored prefix of ``n`` tokens is ``n`` hashes. That costs bytes, not
correctness: matching stays exact to the token (what the radix tree itself matches), and
the events still carry ``token_ids``, so a consumer that indexes by its own block size
(llm-d, Dynamo) rehashes the tokens at that size. A larger event block would need blocks
that straddle tree nodes and an eviction that removes half a block; the tree never frees
half a page, so the page is the unit that keeps events exact.

Block hash: ``h = first 8 bytes (big-endian, unsigned) of blake2b(msgpack([parent_h,
[token ids], namespace]))`` with ``parent_h`` None for a block at the root. It is stable
across processes and machines (no Python ``hash()``), and the namespace (tenant / cache
salt) is hashed into every block, so equal tokens in two namespaces never share a hash.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Sequence
from typing import Any

import msgspec

MEDIUM_GPU = "GPU"  # vLLM's name for the device pool; radixlm's pool on a CPU says "CPU"
MEDIUM_CPU = "CPU"
# the storage tier under the tree (--enable-hierarchical-cache): pages on disk, shared by
# every replica pointed at the same directory (LMCache and vLLM's offloading name their
# media the same way: where the block lives)
MEDIUM_DISK = "DISK"


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """A batch of events as vLLM encodes it: ``[ts, events, data_parallel_rank]``."""

    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    """Base of the three events; the tag (class name) is the array's first item."""


class BlockStored(KVCacheEvent):
    """Blocks cached under ``parent_block_hash`` (None: at the root), in order; ``token_ids``
    holds ``len(block_hashes) * block_size`` tokens."""

    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None


class BlockRemoved(KVCacheEvent):
    """Blocks no longer cached."""

    block_hashes: list[int]
    medium: str | None


class AllBlocksCleared(KVCacheEvent):
    """Every block of this replica is gone (a flush, or a restart)."""


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared

_encoder = msgspec.msgpack.Encoder()
_batch_decoder = msgspec.msgpack.Decoder(KVEventBatch)


def encode_batch(batch: KVEventBatch) -> bytes:
    return _encoder.encode(batch)


def decode_batch(payload: bytes) -> KVEventBatch:
    """Decode one published payload; raises ``msgspec.DecodeError`` on a malformed one."""
    return _batch_decoder.decode(payload)


# ---- block hashes ---------------------------------------------------------------------


def block_hash(parent: int | None, tokens: Sequence[int], namespace: str | None) -> int:
    """The hash of one block (see the module docstring): unsigned 64-bit."""
    data = _encoder.encode((parent, list(tokens), namespace))
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "big")


def chain_hashes(
    token_ids: Sequence[int], block_size: int, namespace: str | None,
    parent: int | None = None,
) -> list[int]:
    """Hashes of the whole blocks of ``token_ids``, each chained to the one before
    (the first to ``parent``); a partial last block has no hash."""
    assert block_size > 0, f"block_size={block_size}"
    out: list[int] = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = block_hash(parent, token_ids[start : start + block_size], namespace)
        out.append(parent)
    return out


# ---- recording ------------------------------------------------------------------------


class KVEventRecorder:
    """Collects a tree's events until the owner ``take`` s them (once per scheduler step).

    ``block_size`` is the tree's page size; ``medium`` goes into every event (vLLM: "GPU").
    """

    def __init__(self, block_size: int, medium: str | None = MEDIUM_GPU,
                 lora_id: int | None = None) -> None:
        self.block_size = block_size
        self.medium = medium
        self.lora_id = lora_id
        self._events: list[KVEvent] = []

    def stored(self, hashes: list[int], parent: int | None, token_ids: list[int],
               medium: str | None = None) -> None:
        """Blocks stored in this recorder's medium, or ``medium`` (the storage tier's)."""
        assert len(token_ids) == len(hashes) * self.block_size, (
            f"{len(token_ids)} tokens for {len(hashes)} blocks of {self.block_size}"
        )
        self._events.append(BlockStored(hashes, parent, token_ids, self.block_size,
                                        self.lora_id, medium or self.medium))

    def removed(self, hashes: list[int], medium: str | None = None) -> None:
        self._events.append(BlockRemoved(hashes, medium or self.medium))

    def cleared(self) -> None:
        # everything recorded before a clear is moot for a consumer that applies in order,
        # but it is kept: a consumer may count stores, and order is the contract
        self._events.append(AllBlocksCleared())

    def pending(self) -> int:
        return len(self._events)

    def take(self) -> list[KVEvent]:
        """The events recorded since the last ``take``, oldest first."""
        events, self._events = self._events, []
        return events

    def take_batch(self, data_parallel_rank: int | None = None) -> KVEventBatch | None:
        """``take`` as one batch stamped now, or None when nothing happened."""
        events = self.take()
        if not events:
            return None
        return KVEventBatch(ts=time.time(), events=events, data_parallel_rank=data_parallel_rank)
