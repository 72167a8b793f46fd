"""Triton decode attention over the paged KV pool (flash-decoding, two stages).

Stage 1: one program per (sequence, KV head, split of the context) runs an online
softmax over its slice of the KV for all ``Hq / Hkv`` query heads sharing that KV head,
so each K/V row is read once per group; it writes a partial output and its log-sum-exp.
Stage 2: one program per (sequence, query head) merges the splits by log-sum-exp.

Each sequence is cut into ``num_splits`` slices of its own length, so short sequences
get short slices; ``num_splits`` follows the longest context and the multiprocessor
count (a small fixed number under the interpreter).

K/V rows are loaded in the pool's dtype (``--kv-cache-dtype``: bf16, fp16, fp8, float32)
and converted to the dots' dtype: float32 when q or the pool is float32, else q's dtype.

Options (compiled in only when set): ``sliding_window`` W splits only each sequence's last W
keys (the query is at the last position, so those are exactly the keys it sees);
``logit_cap`` soft-caps the scores to ``cap * tanh(s / cap)`` before the softmax;
``sinks`` [Hq] (gpt-oss's attention sinks: a learned logit per head with no value) joins
stage 2's merge as one more split whose output is zero.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from radixlm.kernels.reference import Layout, check_decode_layout

_LOG2E = 1.4426950408889634
_MIN_SPLIT_LEN = 256  # don't cut a context finer than this
_MAX_SPLITS = 64
_INTERPRETER_SPLITS = 4


@triton.jit
def soft_cap(s, cap2):
    """``cap2 * tanh(s / cap2)`` for base-2 scores (``cap2 = cap * log2(e)``: the same as
    capping the natural scores at ``cap``); tanh through exp, which every backend has."""
    return cap2 * (1.0 - 2.0 / (tl.exp(2.0 * (s / cap2)) + 1.0))


@triton.jit
def _decode_stage1(
    q_ptr,
    k_ptr,
    v_ptr,
    kv_indptr_ptr,
    kv_indices_ptr,
    mid_o_ptr,
    mid_lse_ptr,
    qk_scale,  # sm_scale * log2(e): the softmax runs in base 2
    window,  # HAS_WINDOW: keys within this many positions of the query
    cap2,  # HAS_CAP: logit_cap * log2(e)
    stride_qb,
    stride_qh,
    stride_ks,
    stride_kh,
    stride_vs,
    stride_vh,
    stride_mb,
    stride_mh,
    stride_ms,  # mid_o [B, Hq, splits, BLOCK_D]
    stride_lb,
    stride_lh,  # mid_lse [B, Hq, splits]
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    DOT_FP32: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    HAS_CAP: tl.constexpr,
):
    b = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    offs_h = kv_head * GROUP + tl.arange(0, BLOCK_H)  # query heads of this KV head
    mask_h = tl.arange(0, BLOCK_H) < GROUP
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HEAD_DIM
    q = tl.load(
        q_ptr + b * stride_qb + offs_h[:, None] * stride_qh + offs_d[None, :],
        mask=mask_h[:, None] & mask_d[None, :],
        other=0.0,
    ).to(tl.float32 if DOT_FP32 else q_ptr.dtype.element_ty)  # [BLOCK_H, BLOCK_D]

    kv_start = tl.load(kv_indptr_ptr + b)
    kv_len = tl.load(kv_indptr_ptr + b + 1) - kv_start
    kv_lo = 0  # the first key the query sees
    if HAS_WINDOW:
        kv_lo = tl.maximum(kv_len - window, 0)
    split_len = tl.cdiv(tl.cdiv(kv_len - kv_lo, NUM_SPLITS), BLOCK_N) * BLOCK_N
    lo = kv_lo + split * split_len
    hi = tl.minimum(lo + split_len, kv_len)

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    for n0 in range(lo, hi, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        mask_n = offs_n < hi
        slot = tl.load(kv_indices_ptr + kv_start + offs_n, mask=mask_n, other=0).to(tl.int64)
        kv_mask = mask_n[:, None] & mask_d[None, :]
        k = tl.load(
            k_ptr + slot[:, None] * stride_ks + kv_head * stride_kh + offs_d[None, :],
            mask=kv_mask,
            other=0.0,
        ).to(q.dtype)  # [BLOCK_N, BLOCK_D]
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
        if HAS_CAP:
            s = soft_cap(s, cap2)
        s = tl.where(mask_n[None, :], s, float("-inf"))  # [BLOCK_H, BLOCK_N]
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        v = tl.load(
            v_ptr + slot[:, None] * stride_vs + kv_head * stride_vh + offs_d[None, :],
            mask=kv_mask,
            other=0.0,
        ).to(q.dtype)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        l_i = l_i * alpha + tl.sum(p, 1)
        m_i = m_new

    has_kv = hi > lo
    out = acc / tl.where(has_kv, l_i, 1.0)[:, None]
    lse = tl.where(has_kv, m_i + tl.log2(tl.where(has_kv, l_i, 1.0)), float("-inf"))
    mid = b * stride_mb + offs_h * stride_mh + split * stride_ms
    tl.store(
        mid_o_ptr + mid[:, None] + offs_d[None, :], out, mask=mask_h[:, None] & mask_d[None, :]
    )
    tl.store(mid_lse_ptr + b * stride_lb + offs_h * stride_lh + split, lse, mask=mask_h)


@triton.jit
def _decode_stage2(
    mid_o_ptr,
    mid_lse_ptr,
    o_ptr,
    sinks_ptr,  # HAS_SINKS: [Hq] float32, natural-log logits
    stride_mb,
    stride_mh,
    stride_ms,
    stride_lb,
    stride_lh,
    stride_ob,
    stride_oh,
    HEAD_DIM: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
    HAS_SINKS: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    mask_s = offs_s < NUM_SPLITS
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HEAD_DIM
    lse = tl.load(
        mid_lse_ptr + b * stride_lb + h * stride_lh + offs_s, mask=mask_s, other=float("-inf")
    )  # [BLOCK_S]; -inf for an empty split
    top = tl.max(lse, 0)
    if HAS_SINKS:  # base 2, as the splits' lse
        sink2 = tl.load(sinks_ptr + h).to(tl.float32) * 1.4426950408889634
        top = tl.maximum(top, sink2)
    w = tl.exp2(lse - top)
    part = tl.load(
        mid_o_ptr + b * stride_mb + h * stride_mh + offs_s[:, None] * stride_ms + offs_d[None, :],
        mask=mask_s[:, None] & mask_d[None, :],
        other=0.0,
    )  # [BLOCK_S, BLOCK_D]
    total = tl.sum(w, 0)
    if HAS_SINKS:
        total += tl.exp2(sink2 - top)
    out = tl.sum(w[:, None] * part, 0) / total
    tl.store(
        o_ptr + b * stride_ob + h * stride_oh + offs_d, out.to(o_ptr.dtype.element_ty), mask=mask_d
    )


def dot_settings(q: torch.Tensor, k_buf: torch.Tensor) -> tuple[str, bool]:
    """``tl.dot`` input precision (exact for float32 inputs, no TF32) and whether to run
    the dots in float32: the interpreter (CPU tensors) computes bfloat16 dots wrongly."""
    fp32 = torch.float32 in (q.dtype, k_buf.dtype)
    interpreted = not q.is_cuda
    return ("ieee" if fp32 or interpreted else "tf32"), fp32 or interpreted


@functools.cache
def _multiprocessors(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def num_kv_splits(batch: int, num_kv_heads: int, max_kv_len: int, device: torch.device) -> int:
    """Splits per sequence: enough programs to fill the GPU about twice over, but no
    split shorter than ``_MIN_SPLIT_LEN`` rows of the longest context."""
    if device.type != "cuda":
        return _INTERPRETER_SPLITS
    programs = batch * num_kv_heads
    wanted = triton.cdiv(2 * _multiprocessors(device.index or 0), max(programs, 1))
    by_len = triton.cdiv(max(max_kv_len, 1), _MIN_SPLIT_LEN)
    return max(1, min(wanted, by_len, _MAX_SPLITS))


def decode_attention_triton(
    q: torch.Tensor,  # [B, Hq, D]
    k_buf: torch.Tensor,  # [S, Hkv, D]
    v_buf: torch.Tensor,  # [S, Hkv, D]
    kv_indptr: torch.Tensor,  # [B+1]
    kv_indices: torch.Tensor,  # [nnz]
    sm_scale: float,
    out: torch.Tensor | None = None,  # [B, Hq, D]
    num_splits: int | None = None,
    layout: Layout | None = None,  # host-side extents: no device read-back
    sliding_window: int | None = None,
    logit_cap: float | None = None,
    sinks: torch.Tensor | None = None,  # [Hq]
) -> torch.Tensor:  # [B, Hq, D]
    """Launcher of the two stages; see the module docstring."""
    layout = check_decode_layout(q, k_buf, v_buf, kv_indptr, kv_indices, layout)
    batch, hq, d = q.shape
    hkv = k_buf.shape[1]
    if out is None:
        out = torch.empty_like(q)
    if batch == 0:
        return out
    q = q if q.stride(2) == 1 else q.contiguous()
    assert out.shape == q.shape and out.stride(2) == 1, f"bad out {out.shape} {out.stride()}"
    if sinks is not None:
        assert sinks.shape == (hq,), f"sinks {tuple(sinks.shape)} for {hq} heads"
        sinks = sinks.float().contiguous()
    splits = num_splits or num_kv_splits(batch, hkv, layout.max_kv_len, q.device)
    block_d = max(16, triton.next_power_of_2(d))
    group = hq // hkv
    mid_o = torch.empty(batch, hq, splits, block_d, dtype=torch.float32, device=q.device)
    mid_lse = torch.empty(batch, hq, splits, dtype=torch.float32, device=q.device)
    precision, dot_fp32 = dot_settings(q, k_buf)
    # KV rows per step, and pipeline depth: the K and V tiles of every stage share memory
    block_n = 64 if d <= 128 else 32
    stages = 2 if d > 128 or k_buf.dtype == torch.float32 else 3
    _decode_stage1[(batch, hkv, splits)](
        q,
        k_buf,
        v_buf,
        kv_indptr,
        kv_indices,
        mid_o,
        mid_lse,
        sm_scale * _LOG2E,
        sliding_window or 0,
        (logit_cap or 0.0) * _LOG2E,
        q.stride(0),
        q.stride(1),
        k_buf.stride(0),
        k_buf.stride(1),
        v_buf.stride(0),
        v_buf.stride(1),
        mid_o.stride(0),
        mid_o.stride(1),
        mid_o.stride(2),
        mid_lse.stride(0),
        mid_lse.stride(1),
        GROUP=group,
        HEAD_DIM=d,
        NUM_SPLITS=splits,
        BLOCK_H=max(16, triton.next_power_of_2(group)),
        BLOCK_D=block_d,
        BLOCK_N=block_n,
        DOT_PRECISION=precision,
        DOT_FP32=dot_fp32,
        HAS_WINDOW=sliding_window is not None,
        HAS_CAP=logit_cap is not None,
        num_stages=stages,
    )
    _decode_stage2[(batch, hq)](
        mid_o,
        mid_lse,
        out,
        sinks if sinks is not None else out,  # a placeholder pointer when unused
        mid_o.stride(0),
        mid_o.stride(1),
        mid_o.stride(2),
        mid_lse.stride(0),
        mid_lse.stride(1),
        out.stride(0),
        out.stride(1),
        HEAD_DIM=d,
        NUM_SPLITS=splits,
        BLOCK_S=triton.next_power_of_2(splits),
        BLOCK_D=block_d,
        HAS_SINKS=sinks is not None,
    )
    return out
