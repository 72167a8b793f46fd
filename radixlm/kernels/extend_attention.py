"""Triton extend (prefill) attention over the paged KV pool.

One program per (sequence, query head, block of new queries) runs one online softmax:
first over the cached prefix, gathered from the pool through ``kv_indices``, then over
the sequence's new tokens (from the ``k``/``v`` arguments) with the causal mask. A block
past the end of a short sequence does no work.

K/V are converted to the dots' dtype as loaded (see decode_attention.py). With a pool
narrower than q the new tokens are first rounded to the pool's dtype, as the pool holds
them, so a token attends alike whether its prefix was cached or computed in this chunk.

Options (compiled in only when set): ``sliding_window`` W masks keys at W or more positions
before the query (query i of a sequence is at position prefix_len + i) and starts both
loops at the block's first visible key; ``logit_cap`` soft-caps the scores
(``decode_attention.soft_cap``); ``sinks`` [Hq] (gpt-oss) adds a learned logit per head to
each row's softmax denominator and nothing to its numerator.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from radixlm.kernels.decode_attention import dot_settings, soft_cap
from radixlm.kernels.reference import Layout, check_extend_layout

_LOG2E = 1.4426950408889634


@triton.jit
def _attend_block(
    q,
    k,
    v,
    valid,
    m_i,
    l_i,
    acc,
    qk_scale,
    cap2,
    DOT_PRECISION: tl.constexpr,
    HAS_CAP: tl.constexpr,
):
    """One online-softmax step over a block of keys; ``valid`` is [BLOCK_M, BLOCK_N]."""
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
    if HAS_CAP:
        s = soft_cap(s, cap2)
    s = tl.where(valid, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that saw no key yet
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return m_new, l_i * alpha + tl.sum(p, 1), acc


@triton.jit
def _extend_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    k_buf_ptr,
    v_buf_ptr,
    o_ptr,
    qo_indptr_ptr,
    kv_indptr_ptr,
    kv_indices_ptr,
    qk_scale,
    window,  # HAS_WINDOW: keys within this many positions of the query
    cap2,  # HAS_CAP: logit_cap * log2(e)
    sinks_ptr,  # HAS_SINKS: [Hq] float32, natural-log logits
    stride_qn,
    stride_qh,
    stride_kn,
    stride_kh,
    stride_vn,
    stride_vh,
    stride_kbs,
    stride_kbh,
    stride_vbs,
    stride_vbh,
    stride_on,
    stride_oh,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    DOT_FP32: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    HAS_CAP: tl.constexpr,
    HAS_SINKS: tl.constexpr,
):
    b = tl.program_id(0)
    head = tl.program_id(1)
    m_block = tl.program_id(2)
    kv_head = head // GROUP
    dot_dtype = tl.float32 if DOT_FP32 else q_ptr.dtype.element_ty

    q_start = tl.load(qo_indptr_ptr + b)
    q_len = tl.load(qo_indptr_ptr + b + 1) - q_start
    prefix_start = tl.load(kv_indptr_ptr + b)
    prefix_len = tl.load(kv_indptr_ptr + b + 1) - prefix_start
    block_lo = m_block * BLOCK_M
    live = block_lo < q_len  # blocks past this sequence's queries skip both loops

    offs_m = block_lo + tl.arange(0, BLOCK_M)
    mask_m = offs_m < q_len
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HEAD_DIM
    q_rows = (q_start + offs_m).to(tl.int64)
    q = tl.load(
        q_ptr + q_rows[:, None] * stride_qn + head * stride_qh + offs_d[None, :],
        mask=mask_m[:, None] & mask_d[None, :],
        other=0.0,
    ).to(dot_dtype)  # [BLOCK_M, BLOCK_D]

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)

    # the cached prefix: every query sees all of it (with a window: what is inside it)
    prefix_lo = 0
    new_lo = 0
    if HAS_WINDOW:  # the block's first query (position prefix_len + block_lo) sees the most
        prefix_lo = tl.maximum(prefix_len + block_lo - window + 1, 0)
        new_lo = tl.maximum(block_lo - window + 1, 0)
    for n0 in range(prefix_lo, tl.where(live, prefix_len, 0), BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        mask_n = offs_n < prefix_len
        slot = tl.load(kv_indices_ptr + prefix_start + offs_n, mask=mask_n, other=0)
        slot = slot.to(tl.int64)
        kv_mask = mask_n[:, None] & mask_d[None, :]
        k = tl.load(
            k_buf_ptr + slot[:, None] * stride_kbs + kv_head * stride_kbh + offs_d[None, :],
            mask=kv_mask,
            other=0.0,
        ).to(dot_dtype)
        v = tl.load(
            v_buf_ptr + slot[:, None] * stride_vbs + kv_head * stride_vbh + offs_d[None, :],
            mask=kv_mask,
            other=0.0,
        ).to(dot_dtype)
        valid = mask_n[None, :]
        if HAS_WINDOW:  # key j at position j, query at prefix_len + offs_m
            valid = valid & (offs_n[None, :] > prefix_len + offs_m[:, None] - window)
        m_i, l_i, acc = _attend_block(
            q, k, v, valid, m_i, l_i, acc, qk_scale, cap2, DOT_PRECISION, HAS_CAP
        )

    # the new tokens, causally: query i sees new keys 0..i
    new_hi = tl.where(live, tl.minimum(q_len, block_lo + BLOCK_M), 0)
    for n0 in range(new_lo, new_hi, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        mask_n = offs_n < q_len
        rows = (q_start + offs_n).to(tl.int64)
        kv_mask = mask_n[:, None] & mask_d[None, :]
        k = tl.load(
            k_ptr + rows[:, None] * stride_kn + kv_head * stride_kh + offs_d[None, :],
            mask=kv_mask,
            other=0.0,
        ).to(dot_dtype)
        v = tl.load(
            v_ptr + rows[:, None] * stride_vn + kv_head * stride_vh + offs_d[None, :],
            mask=kv_mask,
            other=0.0,
        ).to(dot_dtype)
        valid = mask_n[None, :] & (offs_m[:, None] >= offs_n[None, :])
        if HAS_WINDOW:
            valid = valid & (offs_n[None, :] > offs_m[:, None] - window)
        m_i, l_i, acc = _attend_block(q, k, v, valid, m_i, l_i, acc, qk_scale, cap2,
                                      DOT_PRECISION, HAS_CAP)

    if HAS_SINKS:  # the sink's exp joins the denominator (every live row saw a key: m_i finite)
        sink2 = tl.load(sinks_ptr + head).to(tl.float32) * 1.4426950408889634
        l_i = l_i + tl.exp2(sink2 - tl.where(m_i == float("-inf"), sink2, m_i))
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(
        o_ptr + q_rows[:, None] * stride_on + head * stride_oh + offs_d[None, :],
        out.to(o_ptr.dtype.element_ty),
        mask=mask_m[:, None] & mask_d[None, :],
    )


def _launch_config(head_dim: int, kv_dtype: torch.dtype, on_gpu: bool) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, num_stages): the K and V tiles of every stage share memory."""
    if not on_gpu:
        return 32, 32, 1  # interpreter: fewer, larger steps are faster
    if head_dim > 128:
        return 32, 32, 2
    return 64, 64, 2 if kv_dtype == torch.float32 else 3


def extend_attention_triton(
    q: torch.Tensor,  # [N, Hq, D]
    k: torch.Tensor,  # [N, Hkv, D]
    v: torch.Tensor,  # [N, Hkv, D]
    k_buf: torch.Tensor,  # [S, Hkv, D]
    v_buf: torch.Tensor,  # [S, Hkv, D]
    qo_indptr: torch.Tensor,  # [B+1]
    kv_indptr: torch.Tensor,  # [B+1], prefix ranges into kv_indices
    kv_indices: torch.Tensor,  # [nnz_prefix]
    sm_scale: float,
    out: torch.Tensor | None = None,  # [N, Hq, D]
    layout: Layout | None = None,  # host-side extents: no device read-back
    sliding_window: int | None = None,
    logit_cap: float | None = None,
    sinks: torch.Tensor | None = None,  # [Hq]
) -> torch.Tensor:  # [N, Hq, D]
    """Launcher; see the module docstring."""
    layout = check_extend_layout(q, k, v, k_buf, v_buf, qo_indptr, kv_indptr, kv_indices,
                                 layout)
    n, hq, d = q.shape
    hkv = k_buf.shape[1]
    if out is None:
        out = torch.empty_like(q)
    if n == 0:
        return out
    k, v = k.to(k_buf.dtype), v.to(v_buf.dtype)  # no copy when the pool has k's dtype
    q, k, v = (t if t.stride(2) == 1 else t.contiguous() for t in (q, k, v))
    assert out.shape == q.shape and out.stride(2) == 1, f"bad out {out.shape} {out.stride()}"
    if sinks is not None:
        assert sinks.shape == (hq,), f"sinks {tuple(sinks.shape)} for {hq} heads"
        sinks = sinks.float().contiguous()
    block_m, block_n, stages = _launch_config(d, k_buf.dtype, q.is_cuda)
    precision, dot_fp32 = dot_settings(q, k_buf)
    grid = (layout.batch_size, hq, triton.cdiv(layout.max_q_len, block_m))
    _extend_kernel[grid](
        q,
        k,
        v,
        k_buf,
        v_buf,
        out,
        qo_indptr,
        kv_indptr,
        kv_indices,
        sm_scale * _LOG2E,
        sliding_window or 0,
        (logit_cap or 0.0) * _LOG2E,
        sinks if sinks is not None else q,  # a placeholder pointer when unused
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        k_buf.stride(0),
        k_buf.stride(1),
        v_buf.stride(0),
        v_buf.stride(1),
        out.stride(0),
        out.stride(1),
        GROUP=hq // hkv,
        HEAD_DIM=d,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_D=max(16, triton.next_power_of_2(d)),
        DOT_PRECISION=precision,
        DOT_FP32=dot_fp32,
        HAS_WINDOW=sliding_window is not None,
        HAS_CAP=logit_cap is not None,
        HAS_SINKS=sinks is not None,
    )
    return out
