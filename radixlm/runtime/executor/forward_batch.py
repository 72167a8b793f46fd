"""Per-step tensors for one model forward, passed explicitly to ``model.forward``.

One layout serves every batch (FlashInfer-style ragged, no padding):

- ``DECODE``: every sequence has exactly one new token. ``kv_indptr``/``kv_indices``
  describe each sequence's *whole* KV (cached prefix and the new token, whose K/V are
  stored into ``out_cache_loc`` before attention runs).
- ``EXTEND``: sequences have one or more new tokens (prefill chunks, and in a mixed
  batch also one-token decode rows). ``kv_indptr``/``kv_indices`` describe only the
  cached *prefix* of each sequence; the new tokens attend to it and, causally, to
  each other.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch

from radixlm.kernels.reference import Layout
from radixlm.kernels.shared_prefix import AttentionPlan
from radixlm.radix_cache.kv_pool import KVPool, SWAKVPool
from radixlm.radix_cache.state_pool import StatePool
from radixlm.runtime.executor.layers.gated_delta import Snapshots


@dataclass
class WindowView:
    """Decode over a sliding window of ``window`` tokens: each sequence's last ``window``
    KV slots (the query at position p sees keys p - window < j <= p), in the same layout
    as ``ForwardBatch``'s, so windowed layers decode through the plain kernels."""

    kv_indptr: torch.Tensor  # [B+1]
    kv_indices: torch.Tensor  # [nnz]
    attention_plan: AttentionPlan | None = None
    layout: Layout | None = None


@dataclass
class SWAIndices:
    """The sliding layers' view of a forward under the SWA pool (``SWAKVPool``): the same
    layout with every slot translated through ``full_to_swa``. Slots that fell out of
    every window read the pool's padding row, which the window masks."""

    out_cache_loc: torch.Tensor  # [N]
    kv_indices: torch.Tensor  # [nnz]
    window_views: dict[int, WindowView] = field(default_factory=dict)
    attention_plan: AttentionPlan | None = None  # the forward's, over these slots


@dataclass
class StateIndices:
    """A hybrid model's forward: where its linear layers' states are. Sequence ``i`` reads
    and writes slot ``slots[i]`` of ``pool``, or starts from zeros where ``fresh[i]`` (no
    token of it computed yet: admitted or retracted, so its slot holds someone else's
    leftovers)."""

    pool: StatePool
    slots: torch.Tensor  # [B] int64
    fresh: torch.Tensor | None  # [B] bool; None: no sequence is fresh
    seq_lens: list[int]  # new tokens per sequence (host side: the chunk layout's)
    # snapshots inside the sequences (radix_cache/snapshot_tree.py): the state after
    # ``saves.lens[j]`` new tokens of sequence ``saves.seqs[j]`` goes to ``save_slots[j]``
    # (written by the model's linear layers); None: none
    saves: Snapshots | None = None
    save_slots: torch.Tensor | None = None  # [S] int64
    # snapshots at a sequence's end: [own slot, snapshot slot], copied by the runner after
    # the forward (so a model that ignores ``saves`` still gets these)
    saves_at_end: list[list[int]] | None = None


class ForwardMode(enum.Enum):
    EXTEND = "extend"
    DECODE = "decode"

    @property
    def is_decode(self) -> bool:
        return self is ForwardMode.DECODE


@dataclass
class ForwardBatch:
    """Everything one forward needs; built by ModelRunner from a ModelWorkerBatch."""

    mode: ForwardMode
    input_ids: torch.Tensor  # [N] int64, new tokens of all sequences, packed
    positions: torch.Tensor  # [N] int64, absolute position of each new token
    out_cache_loc: torch.Tensor  # [N] int64, KV slot each new token's K/V is written to
    qo_indptr: torch.Tensor  # [B+1] int64, new-token ranges per sequence
    kv_indptr: torch.Tensor  # [B+1] int64, ranges into kv_indices (see module doc)
    kv_indices: torch.Tensor  # [nnz] int64, KV slot indices
    logits_indices: torch.Tensor  # [M] int64, rows of the packed hidden states to project
    kv_pool: KVPool | SWAKVPool
    attention_backend: str | None = None  # None | "torch" | "triton"
    # torch attention path: index work of this layout done once for every layer, and
    # KV shared by several sequences read once per group (kernels/shared_prefix.py)
    attention_plan: AttentionPlan | None = None
    # extents of the ragged layout from host-side lengths, so the Triton path never reads
    # the index tensors back from the device inside a forward
    layout: Layout | None = None
    # decode: window -> the layout truncated to it, for the model's sliding layers
    window_views: dict[int, WindowView] = field(default_factory=dict)
    # with the SWA pool: what the sliding layers read and write instead (their window
    # views live there, translated)
    swa: SWAIndices | None = None
    # extend: the rows of ``logits_indices`` (one a sequence at most) as a DECODE batch
    # over their sequences' KV up to them, for the last layer, whose other rows no one
    # reads (None: that layer runs every row; see ``ForwardBatchBuilder._last_rows``)
    last_rows: ForwardBatch | None = None
    # a hybrid model: its linear layers' states (None: a model of attention layers only)
    state: StateIndices | None = None

    def for_layer(self, sliding: bool) -> ForwardBatch | SWAIndices:
        """Where a layer's ``out_cache_loc``, ``kv_indices`` and ``window_views`` are."""
        return self.swa if sliding and self.swa is not None else self

    @property
    def batch_size(self) -> int:
        return self.qo_indptr.numel() - 1

    @property
    def num_tokens(self) -> int:
        return self.input_ids.numel()
