"""ForwardBatchBuilder (the ModelRunner's ``batch_builder``): a ModelWorkerBatch as the
packed tensors of one forward (``ForwardBatch``), with this forward's attention plan (torch
path), for windowed layers each sequence's last ``window`` slots, and with the SWA pool the
sliding layers' translation of it all (``ForwardBatch.swa``)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from radixlm.kernels.reference import Layout
from radixlm.kernels.shared_prefix import AttentionPlan
from radixlm.radix_cache.kv_pool import KVPool, SWAKVPool
from radixlm.radix_cache.state_pool import StatePool
from radixlm.runtime.executor.forward_batch import (
    ForwardBatch,
    ForwardMode,
    StateIndices,
    SWAIndices,
    WindowView,
)
from radixlm.runtime.executor.layers.gated_delta import Snapshots
from radixlm.runtime.executor.worker_batch import ModelWorkerBatch


@dataclass
class ForwardBatchBuilder:
    """What of the runner a forward's layout depends on (fixed once the runner is built)."""

    device: torch.device
    kv_pool: KVPool | SWAKVPool
    attention_backend: str | None
    dtype: torch.dtype  # the model's (the plan widens a bf16 / fp16 q for the CPU kernel)
    decode_windows: list[int]  # sliding windows the torch path decodes over a truncated view
    uses_torch_attention: bool  # the torch path: an ``AttentionPlan`` per forward
    paged_kernel: bool  # see ModelRunner.paged_kernel
    amx_attention: bool  # see ModelRunner.amx_attention
    state_pool: StatePool | None = None  # a hybrid model's (radix_cache/state_pool.py)

    def build(self, batch: ModelWorkerBatch, req_to_token: torch.Tensor) -> ForwardBatch:
        """Packed tensors for ``batch``; see ForwardBatch for the layout."""
        if batch.is_decode:
            fb = self._decode_batch(batch, req_to_token)
        else:
            fb = self._extend_batch(batch, req_to_token)
        if self.state_pool is not None:
            fb.state = self._state(batch)
        return fb

    def _state(self, batch: ModelWorkerBatch) -> StateIndices:
        """Each sequence's state slot; those with nothing computed start from zeros."""
        assert self.state_pool is not None and batch.state_slots is not None, (
            "a hybrid model's batch carries state_slots")
        assert len(batch.state_slots) == len(batch), (batch.state_slots, len(batch))
        fresh = [p == 0 for p in batch.prefix_lens]
        st = StateIndices(
            self.state_pool,
            torch.tensor(batch.state_slots, dtype=torch.int64, device=self.device),
            torch.tensor(fresh, device=self.device) if any(fresh) else None,
            list(batch.extend_lens))
        inner, at_end = [], []
        for i, tokens, slot in batch.state_saves or ():
            if tokens == batch.extend_lens[i]:
                at_end.append([batch.state_slots[i], slot])
            else:
                inner.append((i, tokens, slot))
        if inner:
            st.saves = Snapshots.of([(i, n) for i, n, _ in inner], self.device)
            st.save_slots = torch.tensor([s for _, _, s in inner], dtype=torch.int64,
                                         device=self.device)
        st.saves_at_end = at_end or None
        return st

    def _decode_batch(self, batch: ModelWorkerBatch, req_to_token: torch.Tensor) -> ForwardBatch:
        """One new token per sequence, built with a few vectorised ops."""
        dev = self.device
        rows = torch.tensor(batch.req_pool_indices, device=dev)
        pos = torch.tensor(batch.prefix_lens, dtype=torch.int64, device=dev)
        lens = pos + 1  # the new token's KV is stored before attention reads it
        width = max(batch.prefix_lens) + 1  # from the host: no device sync
        table = req_to_token[rows, :width]  # [B, width]
        # masked_select, not table[mask]: the same row-major order in a fifth of the time
        kv_indices = table.masked_select(torch.arange(width, device=dev) < lens[:, None])
        kv_indptr = torch.zeros(len(batch) + 1, dtype=torch.int64, device=dev)
        kv_indptr[1:] = lens.cumsum(0)
        qo_indptr = torch.arange(len(batch) + 1, device=dev)
        out_cache_loc = table.gather(1, pos[:, None])[:, 0]
        swa_map = self.swa_map

        def views(t: torch.Tensor) -> dict[int, WindowView]:
            return {w: self._window_view(t, lens, w, qo_indptr) for w in self.decode_windows}

        return ForwardBatch(
            mode=ForwardMode.DECODE,
            input_ids=torch.tensor(batch.input_ids, dtype=torch.int64, device=dev),
            positions=pos,
            out_cache_loc=out_cache_loc,
            qo_indptr=qo_indptr,
            kv_indptr=kv_indptr,
            kv_indices=kv_indices,
            logits_indices=torch.arange(len(batch), device=dev),
            kv_pool=self.kv_pool,
            attention_backend=self.attention_backend,
            attention_plan=self._plan(qo_indptr, kv_indptr, kv_indices, False,
                                      batch.prefix_groups),
            layout=Layout(len(batch), 1, max(batch.prefix_lens) + 1),
            window_views={} if swa_map is not None else views(table),
            swa=None if swa_map is None else self._swa_indices(
                swa_map, out_cache_loc, qo_indptr, kv_indptr, kv_indices, batch, False,
                views(swa_map[table])),
        )

    def _window_view(self, table: torch.Tensor, lens: torch.Tensor, window: int,
                     qo_indptr: torch.Tensor) -> WindowView:
        """Each sequence's last ``window`` slots of ``table`` [B, width] (lens: its KV
        length, new token included)."""
        width = table.shape[1]
        w = min(window, width)
        kept = lens.clamp(max=window)  # [B]
        cols = (lens - kept)[:, None] + torch.arange(w, device=table.device)  # [B, w]
        ok = torch.arange(w, device=table.device) < kept[:, None]
        kv_indices = table.gather(1, cols.clamp(max=width - 1)).masked_select(ok)
        kv_indptr = torch.zeros(len(lens) + 1, dtype=torch.int64, device=table.device)
        kv_indptr[1:] = kept.cumsum(0)
        # no shared-prefix groups: a window's first slot differs by sequence length
        return WindowView(kv_indptr, kv_indices,
                          self._plan(qo_indptr, kv_indptr, kv_indices, False, None),
                          Layout(len(lens), 1, w))

    def _plan(self, qo_indptr, kv_indptr, kv_indices, extend, groups,
              new_slots=None) -> AttentionPlan | None:
        if not self.uses_torch_attention:
            return None
        per_token = self.kv_pool.num_kv_heads * self.kv_pool.head_dim
        return AttentionPlan.build(qo_indptr, kv_indptr, kv_indices, per_token, extend=extend,
                                   prefix_groups=groups, paged_kernel=self.paged_kernel,
                                   new_slots=new_slots, dtype=self.dtype,
                                   amx=self.amx_attention)

    def _extend_batch(self, batch: ModelWorkerBatch, req_to_token: torch.Tensor) -> ForwardBatch:
        """Prefill chunks (and, in a mixed batch, decode rows): the cached prefix of each
        sequence in kv_indices, its new tokens packed."""
        positions: list[torch.Tensor] = []
        locs, kv_slices, logits_rows = [], [], []
        qo_indptr, kv_indptr = [0], [0]
        for idx, start, n, (a, b) in zip(batch.req_pool_indices, batch.prefix_lens,
                                         batch.extend_lens, batch.logit_ranges):
            row = req_to_token[idx]
            positions.append(torch.arange(start, start + n))
            locs.append(row[start: start + n])
            kv_slices.append(row[:start])
            logits_rows.append(torch.arange(qo_indptr[-1] + a, qo_indptr[-1] + b))
            qo_indptr.append(qo_indptr[-1] + n)
            kv_indptr.append(kv_indptr[-1] + start)
        dev = self.device
        qo_t = torch.tensor(qo_indptr, dtype=torch.int64, device=dev)
        kv_t = torch.tensor(kv_indptr, dtype=torch.int64, device=dev)
        kv_indices = torch.cat(kv_slices)
        out_cache_loc = torch.cat(locs)
        return ForwardBatch(
            mode=ForwardMode.EXTEND,
            input_ids=torch.tensor(batch.input_ids, dtype=torch.int64, device=dev),
            positions=torch.cat(positions).to(dev),
            out_cache_loc=out_cache_loc,
            qo_indptr=qo_t,
            kv_indptr=kv_t,
            kv_indices=kv_indices,
            logits_indices=torch.cat(logits_rows).to(dev),
            kv_pool=self.kv_pool,
            attention_backend=self.attention_backend,
            attention_plan=self._plan(qo_t, kv_t, kv_indices, True, batch.prefix_groups,
                                      out_cache_loc),
            layout=Layout(len(batch), max(batch.extend_lens), max(batch.prefix_lens)),
            swa=None if self.swa_map is None else self._swa_indices(
                self.swa_map, out_cache_loc, qo_t, kv_t, kv_indices, batch, True),
            last_rows=self._last_rows(batch, req_to_token),
        )

    def _last_rows(self, batch: ModelWorkerBatch,
                   req_to_token: torch.Tensor) -> ForwardBatch | None:
        """The last layer's attention when each sequence wants the logits (or hidden
        state) of one new row at most (its last, to sample; its first, CLS pooling):
        those rows as a decode over their sequence's KV up to them (every new token's K/V
        stored first), so that layer's attention, o_proj and MLP run on them alone (when
        none wants any, a batch of no sequences: that layer only stores K/V). None when a
        sequence wants more rows (prompt logprobs, mean pooling)."""
        keep, rows = [], []
        for b, (a, e) in enumerate(batch.logit_ranges):
            if e - a == 1:
                keep.append(b)
                rows.append(a)
            elif e != a:
                return None
        if not keep:  # chunks whose prompts go on
            none = torch.zeros(1, dtype=torch.int64, device=self.device)
            return ForwardBatch(ForwardMode.DECODE, none[1:], none[1:], none[1:], none,
                                none, none[1:], none[1:], self.kv_pool,
                                self.attention_backend)
        view = {b: i for i, b in enumerate(keep)}
        groups = [(length, [view[b] for b in members if b in view])
                  for length, members in batch.prefix_groups or []]
        return self._decode_batch(ModelWorkerBatch(
            is_decode=True,
            req_pool_indices=[batch.req_pool_indices[b] for b in keep],
            prefix_lens=[batch.prefix_lens[b] + a for b, a in zip(keep, rows)],
            extend_lens=[1] * len(keep),
            input_ids=[0] * len(keep),  # read by no layer
            logit_ranges=[(0, 1)] * len(keep),
            prefix_groups=[g for g in groups if len(g[1]) >= 2] or None,
        ), req_to_token)

    def _swa_indices(self, swa_map, out_cache_loc, qo_indptr, kv_indptr, kv_indices, batch,
                     extend: bool, views=None) -> SWAIndices:
        """The sliding layers' translation of a forward, with its own plan (the kernel
        passes read the sliding pool's slots)."""
        loc, kv = swa_map[out_cache_loc], swa_map[kv_indices]
        plan = self._plan(qo_indptr, kv_indptr, kv, extend, batch.prefix_groups,
                          loc if extend else None)
        return SWAIndices(loc, kv, views or {}, plan)

    @property
    def swa_map(self) -> torch.Tensor | None:
        """``full_to_swa`` of the SWA pool (None: one pool for every layer)."""
        return getattr(self.kv_pool, "full_to_swa", None)
