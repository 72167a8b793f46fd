"""Triton RMSNorm (optionally fused with the residual add) and rotary embedding.

Both match their twins in ``reference.py``: the residual sum is rounded to the input
dtype before it is normalised, and the arithmetic runs in float32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    res_ptr,
    w_ptr,
    out_ptr,
    res_out_ptr,
    eps,
    stride_x,
    stride_r,
    stride_o,
    stride_ro,
    HIDDEN: tl.constexpr,
    BLOCK: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < HIDDEN
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * stride_r + offs, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(res_out_ptr + row * stride_ro + offs, x, mask=mask)
    xf = x.to(tl.float32)
    inv = 1.0 / tl.sqrt(tl.sum(xf * xf, 0) / HIDDEN + eps)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(
        out_ptr + row * stride_o + offs, (xf * inv * w).to(out_ptr.dtype.element_ty), mask=mask
    )


def rms_norm_triton(
    x: torch.Tensor,  # [N, H]
    weight: torch.Tensor,  # [H]
    eps: float,
    residual: torch.Tensor | None = None,  # [N, H]
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm; with ``residual`` returns ``(norm(x + residual) * weight, x + residual)``."""
    if x.dim() != 2 or weight.shape != (x.shape[1],):
        raise ValueError(
            f"x must be [N, H] and weight [H], got {tuple(x.shape)}, {tuple(weight.shape)}"
        )
    if residual is not None and residual.shape != x.shape:
        raise ValueError(f"residual must match x {tuple(x.shape)}, got {tuple(residual.shape)}")
    x = x if x.stride(1) == 1 else x.contiguous()
    out = torch.empty_like(x)
    res_in = x if residual is None else residual.contiguous()
    res_out = torch.empty_like(x) if residual is not None else out
    if x.shape[0] > 0:
        _rms_norm_kernel[(x.shape[0],)](
            x,
            res_in,
            weight.contiguous(),
            out,
            res_out,
            eps,
            x.stride(0),
            res_in.stride(0),
            out.stride(0),
            res_out.stride(0),
            HIDDEN=x.shape[1],
            BLOCK=triton.next_power_of_2(x.shape[1]),
            HAS_RESIDUAL=residual is not None,
        )
    return out if residual is None else (out, res_out)


@triton.jit
def _rotary_kernel(
    x_ptr,
    out_ptr,
    cos_sin_ptr,
    pos_ptr,
    stride_xn,
    stride_xh,
    stride_on,
    stride_oh,
    stride_cs,
    HEADS: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """One token: out = [x1 * cos - x2 * sin, x2 * cos + x1 * sin] for every head."""
    i = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + i).to(tl.int64)
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HALF
    cos = tl.load(cos_sin_ptr + pos * stride_cs + offs_d, mask=mask_d, other=0.0)
    sin = tl.load(cos_sin_ptr + pos * stride_cs + HALF + offs_d, mask=mask_d, other=0.0)
    mask = (offs_h[:, None] < HEADS) & mask_d[None, :]
    x1_ptr = x_ptr + i * stride_xn + offs_h[:, None] * stride_xh + offs_d[None, :]
    x1 = tl.load(x1_ptr, mask=mask, other=0.0).to(tl.float32)  # [BLOCK_H, BLOCK_D]
    x2 = tl.load(x1_ptr + HALF, mask=mask, other=0.0).to(tl.float32)
    o1 = x1 * cos[None, :] - x2 * sin[None, :]
    o2 = x2 * cos[None, :] + x1 * sin[None, :]
    o_ptr = out_ptr + i * stride_on + offs_h[:, None] * stride_oh + offs_d[None, :]
    tl.store(o_ptr, o1.to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(o_ptr + HALF, o2.to(out_ptr.dtype.element_ty), mask=mask)


def _rotate(x: torch.Tensor, cos_sin_cache: torch.Tensor, positions: torch.Tensor):
    x = x if x.stride(2) == 1 else x.contiguous()
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    n, heads, d = x.shape
    if n > 0:
        _rotary_kernel[(n,)](
            x,
            out,
            cos_sin_cache,
            positions,
            x.stride(0),
            x.stride(1),
            out.stride(0),
            out.stride(1),
            cos_sin_cache.stride(0),
            HEADS=heads,
            HALF=d // 2,
            BLOCK_H=triton.next_power_of_2(heads),
            BLOCK_D=triton.next_power_of_2(d // 2),
        )
    return out


def apply_rotary_triton(
    q: torch.Tensor,  # [N, Hq, D]
    k: torch.Tensor,  # [N, Hkv, D]
    cos_sin_cache: torch.Tensor,  # [max_pos, D] float32: cat(cos[:, :D/2], sin[:, :D/2])
    positions: torch.Tensor,  # [N]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Neox-style (rotate-half) rotary embedding; returns new tensors."""
    d = q.shape[-1]
    if q.dim() != 3 or k.dim() != 3 or k.shape[2] != d or d % 2:
        raise ValueError(
            f"q/k must be [N, H, D] with the same even D, got {tuple(q.shape)}, {tuple(k.shape)}"
        )
    if cos_sin_cache.dim() != 2 or cos_sin_cache.shape[1] != d:
        raise ValueError(f"cos_sin_cache must be [max_pos, {d}], got {tuple(cos_sin_cache.shape)}")
    if positions.shape != (q.shape[0],) or k.shape[0] != q.shape[0]:
        raise ValueError(
            f"positions must be [N] = [{q.shape[0]}] like q and k, got {tuple(positions.shape)}"
        )
    cos_sin_cache = cos_sin_cache.float().contiguous()
    return _rotate(q, cos_sin_cache, positions), _rotate(k, cos_sin_cache, positions)
