"""Triton store of new K/V rows into their slots of the paged KV pool."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from radixlm.kernels.reference import check_store_layout


@triton.jit
def _store_kv_kernel(
    k_buf_ptr,
    v_buf_ptr,
    loc_ptr,
    k_ptr,
    v_ptr,
    stride_kbs,
    stride_vbs,
    stride_kn,
    stride_vn,
    ROW: tl.constexpr,
    BLOCK: tl.constexpr,  # ROW = Hkv * D elements per token
):
    i = tl.program_id(0)
    slot = tl.load(loc_ptr + i).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < ROW
    k = tl.load(k_ptr + i * stride_kn + offs, mask=mask)
    v = tl.load(v_ptr + i * stride_vn + offs, mask=mask)
    tl.store(k_buf_ptr + slot * stride_kbs + offs, k.to(k_buf_ptr.dtype.element_ty), mask=mask)
    tl.store(v_buf_ptr + slot * stride_vbs + offs, v.to(v_buf_ptr.dtype.element_ty), mask=mask)


def _rows(t: torch.Tensor) -> torch.Tensor:
    """``t`` with each token's [Hkv, D] block contiguous (a copy only if it is not)."""
    if t.stride(2) == 1 and t.stride(1) == t.shape[2]:
        return t
    return t.contiguous()


def store_kv_triton(
    k_buf: torch.Tensor,  # [S, Hkv, D]
    v_buf: torch.Tensor,  # [S, Hkv, D]
    loc: torch.Tensor,  # [N]
    k: torch.Tensor,  # [N, Hkv, D]
    v: torch.Tensor,  # [N, Hkv, D]
) -> None:
    """Write row ``i`` of ``k``/``v`` into slot ``loc[i]`` of the pool, one program a row.
    Rows are cast to the pool's dtype by torch first (round to nearest even, bit for bit
    the reference store; Triton's interpreter truncates to bfloat16 and mis-rounds fp8)."""
    check_store_layout(k_buf, v_buf, loc, k, v)
    for name, buf in (("k_buf", k_buf), ("v_buf", v_buf)):
        if buf.stride(2) != 1 or buf.stride(1) != buf.shape[2]:
            raise ValueError(f"{name} must be contiguous in its last two dims, got {buf.stride()}")
    n = loc.numel()
    if n == 0:
        return
    k, v = _rows(k.to(k_buf.dtype)), _rows(v.to(v_buf.dtype))
    row = k_buf.shape[1] * k_buf.shape[2]
    _store_kv_kernel[(n,)](
        k_buf,
        v_buf,
        loc,
        k,
        v,
        k_buf.stride(0),
        v_buf.stride(0),
        k.stride(0),
        v.stride(0),
        ROW=row,
        BLOCK=triton.next_power_of_2(row),
    )
