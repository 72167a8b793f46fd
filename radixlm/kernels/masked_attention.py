"""Attention with a sliding window, logit soft-capping and/or attention sinks, in torch, on
any device.

The attention of layers that have either feature (Mistral, Phi-3 and Qwen's sliding layers,
Gemma 2's soft-capped scores, Gemma 3's local layers) where no kernel takes them: the
Triton kernels and the compiled CPU kernel (along a plan that has it) take both options
themselves; the padded torch passes have neither, so ``radixlm.kernels`` routes these
layers here on the torch path without the CPU kernel (or without a plan).

Same ragged layout as ``reference.decode_attention`` / ``extend_attention``, plus one
fact the runner guarantees: a sequence's keys in ``kv_indices`` are its positions
``0, 1, ...`` in order (decode: the new token's included; extend: the new tokens follow
the prefix), so key ``j`` is at position ``j`` and a query's position is its index among
the keys. Query at ``p`` sees key ``j`` iff ``j <= p`` and ``p - j < sliding_window``
(transformers' ``sliding_window_overlay``); scores are ``cap * tanh(s / cap)`` before the
softmax when ``logit_cap`` is set (Gemma 2's ``attn_logit_softcapping``); ``sinks`` [Hq]
(gpt-oss) is one more logit per head in each row's softmax, with no value (its share of
the probability is dropped). Arithmetic in float32 (a window alone: torch's fused
attention in q's dtype); one sequence at a time (the index work of a windowed batch is
per sequence). The padded passes have no window or cap; without a plan, sinks also come
here (the reference kernels return no log-sum-exp to apply them with).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from radixlm.kernels.reference import check_decode_layout, check_extend_layout

# query rows per block of scores (see _one_sequence)
QUERY_BLOCK = 128


def check_options(sliding_window: int | None, logit_cap: float | None) -> None:
    """ValueError unless the window is a positive int and the cap a positive number."""
    if sliding_window is not None and (isinstance(sliding_window, bool)
                                       or not isinstance(sliding_window, int)
                                       or sliding_window < 1):
        raise ValueError(f"sliding_window must be a positive int or None, got {sliding_window!r}")
    if logit_cap is not None and not logit_cap > 0:
        raise ValueError(f"logit_cap must be a positive number or None, got {logit_cap!r}")


def decode_attention(
    q: torch.Tensor,  # [B, Hq, D]
    k_buf: torch.Tensor,  # [S, Hkv, D]
    v_buf: torch.Tensor,  # [S, Hkv, D]
    kv_indptr: torch.Tensor,  # [B+1]
    kv_indices: torch.Tensor,  # [nnz]: each sequence's whole KV, new token included
    sm_scale: float,
    sliding_window: int | None = None,
    logit_cap: float | None = None,
    out: torch.Tensor | None = None,  # [B, Hq, D]
    sinks: torch.Tensor | None = None,  # [Hq]
) -> torch.Tensor:  # [B, Hq, D]
    """One query per sequence, at the position of its last key."""
    check_options(sliding_window, logit_cap)
    check_decode_layout(q, k_buf, v_buf, kv_indptr, kv_indices)
    check_sinks(sinks, q.shape[1])
    qo_indptr = torch.arange(q.shape[0] + 1, device=q.device)
    return _attention(q, None, None, k_buf, v_buf, qo_indptr, kv_indptr, kv_indices, sm_scale,
                      (sliding_window, logit_cap, sinks), out)


def extend_attention(
    q: torch.Tensor,  # [N, Hq, D]
    k: torch.Tensor,  # [N, Hkv, D]
    v: torch.Tensor,  # [N, Hkv, D]
    k_buf: torch.Tensor,  # [S, Hkv, D]
    v_buf: torch.Tensor,  # [S, Hkv, D]
    qo_indptr: torch.Tensor,  # [B+1]
    kv_indptr: torch.Tensor,  # [B+1]: the cached prefixes
    kv_indices: torch.Tensor,  # [nnz_prefix]
    sm_scale: float,
    sliding_window: int | None = None,
    logit_cap: float | None = None,
    out: torch.Tensor | None = None,  # [N, Hq, D]
    sinks: torch.Tensor | None = None,  # [Hq]
) -> torch.Tensor:  # [N, Hq, D]
    """New tokens over their cached prefix and, causally, each other."""
    check_options(sliding_window, logit_cap)
    check_extend_layout(q, k, v, k_buf, v_buf, qo_indptr, kv_indptr, kv_indices)
    check_sinks(sinks, q.shape[1])
    return _attention(q, k, v, k_buf, v_buf, qo_indptr, kv_indptr, kv_indices, sm_scale,
                      (sliding_window, logit_cap, sinks), out)


def check_sinks(sinks: torch.Tensor | None, num_heads: int) -> None:
    """ValueError unless ``sinks`` is None or one float logit per query head."""
    if sinks is not None and (sinks.shape != (num_heads,) or not sinks.is_floating_point()):
        raise ValueError(f"sinks must be a float tensor of shape ({num_heads},) (one logit per "
                         f"query head), got {sinks.dtype} {tuple(sinks.shape)}")


def _attention(q, k, v, k_buf, v_buf, qo_indptr, kv_indptr, kv_indices, sm_scale, options,
               out):
    if out is None:
        out = torch.empty_like(q)
    qo, kv = qo_indptr.tolist(), kv_indptr.tolist()
    group = q.shape[1] // k_buf.shape[1]
    for b in range(len(qo) - 1):
        n = qo[b + 1] - qo[b]
        if n == 0:
            continue
        slots = kv_indices[kv[b]: kv[b + 1]]
        keys, values = k_buf[slots], v_buf[slots]  # [L, Hkv, D]
        if k is not None:  # the new tokens, rounded to the pool's dtype as the pool holds them
            keys = torch.cat((keys, k[qo[b]: qo[b + 1]].to(k_buf.dtype)))
            values = torch.cat((values, v[qo[b]: qo[b + 1]].to(v_buf.dtype)))
        out[qo[b]: qo[b + 1]] = _one_sequence(q[qo[b]: qo[b + 1]], keys, values, group,
                                              sm_scale, *options).to(out.dtype)
    return out


def _one_sequence(q, keys, values, group, sm_scale, window, cap, sinks) -> torch.Tensor:
    """q [n, Hq, D] at the last n of the L key positions; keys/values [L, Hkv, D]. Queries
    go in blocks of QUERY_BLOCK over only the keys the block can see (its window), so the
    scores stay [Hq, QUERY_BLOCK, <= QUERY_BLOCK + window] however long the prompt. A window
    alone is a mask for torch's fused attention (in q's dtype, as the reference path runs);
    soft-capped scores and sinks are computed here, in float32."""
    n, length = q.shape[0], keys.shape[0]
    explicit = cap is not None or sinks is not None
    out = torch.empty(q.shape, dtype=torch.float32 if explicit else q.dtype, device=q.device)
    for i0 in range(0, n, QUERY_BLOCK):
        i1 = min(i0 + QUERY_BLOCK, n)
        first, last = length - n + i0, length - n + i1 - 1  # the block's query positions
        k0 = 0 if window is None else max(0, first - window + 1)
        q_pos = torch.arange(first, last + 1, device=q.device)[:, None]  # [nb, 1]
        k_pos = torch.arange(k0, last + 1, device=q.device)[None, :]  # [1, Lb]
        seen = k_pos <= q_pos
        if window is not None:
            seen &= k_pos > q_pos - window
        kk, vv = keys[k0: last + 1], values[k0: last + 1]  # [Lb, Hkv, D]
        if not explicit:
            out[i0:i1] = F.scaled_dot_product_attention(
                q[i0:i1].transpose(0, 1), kk.transpose(0, 1).to(q.dtype),
                vv.transpose(0, 1).to(q.dtype), attn_mask=seen, scale=sm_scale,
                enable_gqa=group > 1).transpose(0, 1)  # [nb, Hq, D]
            continue
        kk = kk.float().repeat_interleave(group, dim=1)  # [Lb, Hq, D]
        vv = vv.float().repeat_interleave(group, dim=1)
        s = torch.einsum("qhd,khd->hqk", q[i0:i1].float(), kk) * sm_scale  # [Hq, nb, Lb]
        if cap is not None:
            s = torch.tanh(s / cap) * cap
        s = s.masked_fill(~seen, float("-inf"))
        if sinks is not None:  # one more column per head: in the softmax, then dropped
            sink = sinks.float()[:, None, None].expand(-1, s.shape[1], 1)
            p = torch.softmax(torch.cat((s, sink), dim=-1), dim=-1)[..., :-1]
        else:
            p = torch.softmax(s, dim=-1)
        out[i0:i1] = torch.einsum("hqk,khd->qhd", p, vv)
    return out
