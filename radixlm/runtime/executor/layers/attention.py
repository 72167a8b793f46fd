"""The attention of one layer over the paged KV pool (SGLang's ``RadixAttention``).

It stores this step's K/V into the pool, then attends through the forward's ragged layout
(``ForwardBatch``): decode reads each sequence's whole KV back, extend its cached prefix
plus, causally, the new tokens. Per-layer options:

- ``sm_scale``: the score scale (``head_dim ** -0.5``; Gemma: ``query_pre_attn_scalar ** -0.5``,
  Granite: ``attention_multiplier``);
- ``sliding_window``: keys within this many positions of the query (Mistral, Phi-3, the
  sliding layers of Gemma, Qwen);
- ``logit_cap``: scores soft-capped to ``cap * tanh(s / cap)`` (Gemma 2);
- ``sinks``: a learned logit per query head in the softmax, with no value (gpt-oss); the
  layer owns the parameter (``self_attn.sinks`` in the checkpoint, this rank's heads).
  Setting ``sinks`` to None switches them off (a test does).

A layer with a window or a cap runs, on the torch path, in the compiled CPU kernel when
the forward's plan has it (a CPU with the kernel built; it takes both options per call),
else in ``kernels.masked_attention`` (the padded passes have neither feature). In decode a window
is also only a shorter layout: when the runner built that view
(``ForwardBatch.window_views``: each sequence's last ``window`` slots), an uncapped sliding
layer decodes through the plain kernels. The Triton kernels take both options themselves
(and so decode CUDA graphs capture such layers too).

With the SWA pool (``--enable-hybrid-swa-memory``, ``SWAKVPool``) a sliding layer's K/V
live in the smaller pool: it writes and reads through ``ForwardBatch.swa`` (the same
layout, slots translated through ``full_to_swa``; tokens out of every window read a
padding row that the window masks); its plan (``SWAIndices.attention_plan``) is the
forward's built over those translated slots.
"""

from __future__ import annotations

import torch
from torch import nn

from radixlm import kernels
from radixlm.kernels.masked_attention import check_options
from radixlm.runtime.distributed.layers import Placement, Shard
from radixlm.runtime.executor.forward_batch import ForwardBatch


class RadixAttention(nn.Module):
    def __init__(self, layer_id: int, num_heads: int, num_kv_heads: int, head_dim: int,
                 sm_scale: float, sliding_window: int | None = None,
                 logit_cap: float | None = None, sinks: Shard | None = None) -> None:
        """``sinks``: this rank's heads of the checkpoint's per-head sink logits (None: the
        layer has none)."""
        super().__init__()
        check_options(sliding_window, logit_cap)
        self.layer_id = layer_id
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.sm_scale = sm_scale
        self.sliding_window = sliding_window
        self.logit_cap = logit_cap
        self.sinks_shard = sinks
        self.sinks = nn.Parameter(torch.zeros(num_heads)) if sinks is not None else None

    def checkpoint_layout(self, prefix: str) -> dict[str, Placement]:
        """The sinks are the attention module's in the checkpoint (``self_attn.sinks``)."""
        if self.sinks_shard is None:
            return {}
        return {f"{prefix.rpartition('.')[0]}.sinks": Placement(f"{prefix}.sinks", None,
                                                                self.sinks_shard)}

    @property
    def masked(self) -> bool:
        """Whether this layer has a window or a cap (the masked torch path, or the CPU
        kernel with the options)."""
        return self.sliding_window is not None or self.logit_cap is not None

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                fb: ForwardBatch, last_rows: bool = False) -> torch.Tensor:
        """q [N, Hq, D], k/v [N, Hkv, D] (rotated) -> [N, Hq * D]. ``last_rows`` (an
        extend with ``fb.last_rows``): every row's K/V stored, then only the rows of
        ``fb.logits_indices`` attend, as that decode batch -> [M, Hq * D]."""
        backend = fb.attention_backend
        k_buf, v_buf = fb.kv_pool.get_kv_buffer(self.layer_id)
        idx = fb.for_layer(self.sliding_window is not None)  # fb, or its SWA translation
        kernels.store_kv(k_buf, v_buf, idx.out_cache_loc, k, v, backend=backend)
        if last_rows:
            assert fb.last_rows is not None
            q, fb = q[fb.logits_indices], fb.last_rows
            if fb.batch_size == 0:  # no row wanted (the decoder layer stops here too)
                return q.reshape(0, self.num_heads * self.head_dim)
            idx = fb.for_layer(self.sliding_window is not None)
        n = q.shape[0]
        view = idx.window_views.get(self.sliding_window) if self.logit_cap is None else None
        if fb.mode.is_decode and view is not None:  # the window's slots, plain kernels
            o = kernels.decode_attention(
                q, k_buf, v_buf, view.kv_indptr, view.kv_indices, self.sm_scale,
                backend=backend, plan=view.attention_plan, layout=view.layout,
                sinks=self.sinks,
            )
            return o.reshape(n, self.num_heads * self.head_dim)
        options = {"sliding_window": self.sliding_window, "logit_cap": self.logit_cap,
                   "sinks": self.sinks}
        # a window or a cap: kernels.* runs the plan's kernel passes with them when it
        # has them, else the masked path (over the raw indices)
        plan = idx.attention_plan
        if fb.mode.is_decode:  # kv_indices already include the new token's slot
            o = kernels.decode_attention(
                q, k_buf, v_buf, fb.kv_indptr, idx.kv_indices, self.sm_scale, backend=backend,
                plan=plan, layout=fb.layout, **options,
            )
        else:  # cached prefix from the pool, new tokens causally from k/v
            ragged = (fb.qo_indptr, fb.kv_indptr, idx.kv_indices)
            o = kernels.extend_attention(
                q, k, v, k_buf, v_buf, *ragged, self.sm_scale, backend=backend,
                plan=plan, layout=fb.layout, **options,
            )
        return o.reshape(n, self.num_heads * self.head_dim)
