"""Torch reference kernels: the CPU path of the engine and the oracle of the Triton kernels.

Same signatures as the Triton kernels (see ``radixlm/kernels/__init__.py``).
"""

from __future__ import annotations

import torch


def rms_norm(
    x: torch.Tensor,  # [N, H]
    weight: torch.Tensor,  # [H]
    eps: float,
    residual: torch.Tensor | None = None,  # [N, H]
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm in float32; with ``residual``: ``residual = x + residual`` first, and
    returns ``(norm(residual) * weight, residual)``."""
    if residual is not None:
        x = x + residual
        residual = x
    xf = x.float()
    out = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    out = (out * weight.float()).to(x.dtype)
    return out if residual is None else (out, residual)


def apply_rotary(
    q: torch.Tensor,  # [N, Hq, D]
    k: torch.Tensor,  # [N, Hkv, D]
    cos_sin_cache: torch.Tensor,  # [max_pos, D]: cat(cos[:, :D/2], sin[:, :D/2]) in float32
    positions: torch.Tensor,  # [N] int64
) -> tuple[torch.Tensor, torch.Tensor]:
    """Neox-style (rotate-half) rotary embedding, as Hugging Face Llama applies it."""
    cos, sin = cos_sin_cache[positions].chunk(2, dim=-1)  # [N, D/2] each
    cos = cos.unsqueeze(1)  # [N, 1, D/2]
    sin = sin.unsqueeze(1)
    return _rotate(q, cos, sin), _rotate(k, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)


def store_kv(
    k_buf: torch.Tensor,  # [S, Hkv, D]
    v_buf: torch.Tensor,  # [S, Hkv, D]
    loc: torch.Tensor,  # [N] int64
    k: torch.Tensor,  # [N, Hkv, D]
    v: torch.Tensor,  # [N, Hkv, D]
) -> None:
    k_buf[loc] = k.to(k_buf.dtype)
    v_buf[loc] = v.to(v_buf.dtype)


def decode_attention(
    q: torch.Tensor,  # [B, Hq, D]
    k_buf: torch.Tensor,  # [S, Hkv, D]
    v_buf: torch.Tensor,  # [S, Hkv, D]
    kv_indptr: torch.Tensor,  # [B+1]
    kv_indices: torch.Tensor,  # [nnz]
    sm_scale: float,
) -> torch.Tensor:  # [B, Hq, D]
    """One query token per sequence over its whole KV (gathered through ``kv_indices``)."""
    qo_indptr = torch.arange(q.shape[0] + 1, device=q.device, dtype=kv_indptr.dtype)
    return _ragged_attention(q, None, None, k_buf, v_buf, qo_indptr, kv_indptr, kv_indices,
                             sm_scale, causal=False)


def extend_attention(
    q: torch.Tensor,  # [N, Hq, D]
    k: torch.Tensor,  # [N, Hkv, D]
    v: torch.Tensor,  # [N, Hkv, D]
    k_buf: torch.Tensor,  # [S, Hkv, D]
    v_buf: torch.Tensor,  # [S, Hkv, D]
    qo_indptr: torch.Tensor,  # [B+1]
    kv_indptr: torch.Tensor,  # [B+1], prefix ranges into kv_indices
    kv_indices: torch.Tensor,  # [nnz_prefix]
    sm_scale: float,
) -> torch.Tensor:  # [N, Hq, D]
    """New tokens attend to their cached prefix (from the pool) and causally to each other."""
    return _ragged_attention(q, k, v, k_buf, v_buf, qo_indptr, kv_indptr, kv_indices,
                             sm_scale, causal=True)


def _ragged_attention(q, k, v, k_buf, v_buf, qo_indptr, kv_indptr, kv_indices, sm_scale, causal):
    out = torch.empty_like(q)
    hq, hkv = q.shape[1], k_buf.shape[1]
    qo = qo_indptr.tolist()
    kv = kv_indptr.tolist()
    for b in range(len(qo) - 1):
        qs, qe, ks, ke = qo[b], qo[b + 1], kv[b], kv[b + 1]
        if qe == qs:
            continue
        idx = kv_indices[ks:ke]
        kk, vv = k_buf[idx], v_buf[idx]  # [P, Hkv, D]
        if k is not None:
            kk = torch.cat((kk, k[qs:qe].to(kk.dtype)))
            vv = torch.cat((vv, v[qs:qe].to(vv.dtype)))
        n_new, n_kv = qe - qs, kk.shape[0]
        mask = None
        if causal:
            # query i (absolute position prefix + i) sees keys 0 .. prefix + i
            rows = torch.arange(n_new, device=q.device).unsqueeze(1) + (n_kv - n_new)
            mask = torch.arange(n_kv, device=q.device).unsqueeze(0) <= rows
        qq = q[qs:qe].transpose(0, 1)  # [Hq, n_new, D]
        kk = kk.transpose(0, 1).repeat_interleave(hq // hkv, 0)  # [Hq, n_kv, D]
        vv = vv.transpose(0, 1).repeat_interleave(hq // hkv, 0)
        o = torch.nn.functional.scaled_dot_product_attention(
            qq.unsqueeze(0), kk.unsqueeze(0).to(qq.dtype), vv.unsqueeze(0).to(qq.dtype),
            attn_mask=mask, scale=sm_scale,
        )
        out[qs:qe] = o[0].transpose(0, 1)
    return out
