"""Torch reference kernels: the CPU path of the engine and the oracle of the Triton kernels.

Same signatures as the Triton kernels (see ``radixlm/kernels/__init__.py``), and the same
layout checks (``check_decode_layout`` / ``check_extend_layout``), so both backends reject
a bad batch with the same ``ValueError``.

Attention runs on groups of sequences of similar length: each group is gathered into a
padded ``[g, Hkv, L, D]`` batch and handed to one ``scaled_dot_product_attention`` call
(GQA via ``enable_gqa``, no ``repeat_interleave``). Groups are capped in size so the
gathered K/V stays cache-sized; ``benchmarks/kernels_cpu.py`` measures this against a
per-sequence loop and one padded batch.
"""

from __future__ import annotations

import os
from typing import NamedTuple

import torch
import torch.nn.functional as F

# RADIXLM_DEBUG_KERNELS=1: check every batch's index values on the device (a host sync
# per call) even when the caller gave its layout
DEBUG_KERNELS = os.environ.get("RADIXLM_DEBUG_KERNELS") == "1"
# Elements of gathered K (per group); ~1M float32 = 4 MiB keeps a group's K and V in cache.
_GROUP_KV_ELEMS = 1 << 20
# A sequence joins a group only if it is at least this fraction of the group's longest one.
_GROUP_MIN_FILL = 0.5


class Layout(NamedTuple):
    """Host-side facts about a ragged batch: given by the caller that already knows them
    (the model runner, from host lengths: no device sync), else read with one sync."""

    batch_size: int
    max_q_len: int  # new tokens of the longest sequence (1 in decode)
    max_kv_len: int  # cached KV of the longest sequence (the prefix in extend)


# --------------------------------------------------------------------------- layout checks


def _check_index(name: str, t: torch.Tensor) -> None:
    if t.dim() != 1:
        raise ValueError(f"{name} must be 1-D, got shape {tuple(t.shape)}")
    if t.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{name} must be int32 or int64, got {t.dtype}")


def _check_kv_buffers(q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor) -> None:
    if k_buf.dim() != 3 or k_buf.shape != v_buf.shape:
        raise ValueError(
            f"k_buf and v_buf must both be [S, Hkv, D], got {tuple(k_buf.shape)} "
            f"and {tuple(v_buf.shape)}"
        )
    if q.dim() != 3 or q.shape[2] != k_buf.shape[2]:
        raise ValueError(
            f"q must be [tokens, Hq, D] with D = k_buf's head_dim {k_buf.shape[2]}, "
            f"got {tuple(q.shape)}"
        )
    if q.shape[1] % k_buf.shape[1] != 0:
        raise ValueError(f"Hq ({q.shape[1]}) must be a multiple of Hkv ({k_buf.shape[1]})")
    for name, buf in (("k_buf", k_buf), ("v_buf", v_buf)):
        if buf.stride(2) != 1 or buf.stride(1) != buf.shape[2]:
            raise ValueError(
                f"{name} must be contiguous in its last two dims [Hkv, D], "
                f"got strides {buf.stride()}"
            )
    if k_buf.device != q.device or v_buf.device != q.device:
        raise ValueError(f"q is on {q.device} but the KV buffers are on {k_buf.device}")


def _read_layout(
    qo_indptr: torch.Tensor | None,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    num_tokens: int,
    num_slots: int,
) -> Layout:
    """Check the indptr arrays' values (one host sync) and return the batch's extents."""
    batch = kv_indptr.numel() - 1
    if batch == 0:
        return Layout(0, 0, 0)
    kv_lens = kv_indptr[1:] - kv_indptr[:-1]
    facts = [kv_indptr[0], kv_indptr[-1], kv_lens.min(), kv_lens.max()]
    if kv_indices.numel() > 0:
        facts += [kv_indices.min(), kv_indices.max()]
    if qo_indptr is not None:
        q_lens = qo_indptr[1:] - qo_indptr[:-1]
        facts += [qo_indptr[0], qo_indptr[-1], q_lens.min(), q_lens.max()]
    vals = torch.stack([f.to(torch.int64) for f in facts]).tolist()
    kv_first, kv_last, kv_min, kv_max = vals[:4]
    if kv_first != 0 or kv_last != kv_indices.numel():
        raise ValueError(
            f"kv_indptr must run from 0 to len(kv_indices) = {kv_indices.numel()}, "
            f"got {kv_first} .. {kv_last}"
        )
    if kv_min < 0:
        raise ValueError("kv_indptr must be non-decreasing")
    if kv_indices.numel() > 0 and (vals[4] < 0 or vals[5] >= num_slots):
        raise ValueError(
            f"kv_indices must lie in [0, {num_slots}) (the KV pool size), "
            f"got {vals[4]} .. {vals[5]}"
        )
    if qo_indptr is None:
        return Layout(batch, 1, kv_max)
    q_first, q_last, q_min, q_max = vals[-4:]
    if q_first != 0 or q_last != num_tokens:
        raise ValueError(
            f"qo_indptr must run from 0 to the number of new tokens {num_tokens}, "
            f"got {q_first} .. {q_last}"
        )
    if q_min < 0:
        raise ValueError("qo_indptr must be non-decreasing")
    return Layout(batch, q_max, kv_max)


def check_decode_layout(
    q: torch.Tensor,
    k_buf: torch.Tensor,
    v_buf: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    layout: Layout | None = None,
) -> Layout:
    """Raise ``ValueError`` unless the arguments form a valid decode batch. With
    ``layout`` (the caller's host-side facts) the index values are not read back from the
    device, unless RADIXLM_DEBUG_KERNELS=1 asks for the full check."""
    _check_index("kv_indptr", kv_indptr)
    _check_index("kv_indices", kv_indices)
    _check_kv_buffers(q, k_buf, v_buf)
    if kv_indptr.numel() != q.shape[0] + 1:
        raise ValueError(
            f"kv_indptr must have batch + 1 = {q.shape[0] + 1} entries (one query per "
            f"sequence in decode), got {kv_indptr.numel()}"
        )
    if layout is not None and not DEBUG_KERNELS:
        return layout
    return _read_layout(None, kv_indptr, kv_indices, q.shape[0], k_buf.shape[0])


def check_extend_layout(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_buf: torch.Tensor,
    v_buf: torch.Tensor,
    qo_indptr: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    layout: Layout | None = None,
) -> Layout:
    """Raise ``ValueError`` unless the arguments form a valid extend batch (``layout``: see
    check_decode_layout)."""
    for name, t in (("qo_indptr", qo_indptr), ("kv_indptr", kv_indptr), ("kv_indices", kv_indices)):
        _check_index(name, t)
    _check_kv_buffers(q, k_buf, v_buf)
    expect = (q.shape[0], k_buf.shape[1], k_buf.shape[2])
    if tuple(k.shape) != expect or tuple(v.shape) != expect:
        raise ValueError(
            f"k and v must be [N, Hkv, D] = {list(expect)}, got {tuple(k.shape)} "
            f"and {tuple(v.shape)}"
        )
    if qo_indptr.numel() != kv_indptr.numel():
        raise ValueError(
            f"qo_indptr and kv_indptr must both have batch + 1 entries, got "
            f"{qo_indptr.numel()} and {kv_indptr.numel()}"
        )
    if qo_indptr.numel() == 0:
        raise ValueError("qo_indptr must have batch + 1 >= 1 entries")
    if layout is not None and not DEBUG_KERNELS:
        return layout
    return _read_layout(qo_indptr, kv_indptr, kv_indices, q.shape[0], k_buf.shape[0])


# --------------------------------------------------------------------------- norm, rotary


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


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:  # [N, 2I] -> [N, I]
    """The gated MLP's activation: ``silu(gate) * up`` for ``x = cat(gate, up)``."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


# --------------------------------------------------------------------------- KV store


def store_kv(
    k_buf: torch.Tensor,  # [S, Hkv, D]
    v_buf: torch.Tensor,  # [S, Hkv, D]
    loc: torch.Tensor,  # [N] int64
    k: torch.Tensor,  # [N, Hkv, D]
    v: torch.Tensor,  # [N, Hkv, D]
) -> None:
    """Write row ``i`` of ``k``/``v`` into slot ``loc[i]`` of the pool."""
    check_store_layout(k_buf, v_buf, loc, k, v)
    k_buf[loc] = k.to(k_buf.dtype)
    v_buf[loc] = v.to(v_buf.dtype)


def check_store_layout(
    k_buf: torch.Tensor,
    v_buf: torch.Tensor,
    loc: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
) -> None:
    """Raise ``ValueError`` unless ``k``/``v`` rows fit the pool at ``loc``."""
    _check_index("loc", loc)
    if k_buf.dim() != 3 or k_buf.shape != v_buf.shape:
        raise ValueError(f"k_buf/v_buf must be [S, Hkv, D], got {tuple(k_buf.shape)}")
    expect = (loc.numel(), k_buf.shape[1], k_buf.shape[2])
    if tuple(k.shape) != expect or tuple(v.shape) != expect:
        raise ValueError(
            f"k and v must be [len(loc), Hkv, D] = {list(expect)}, got {tuple(k.shape)} "
            f"and {tuple(v.shape)}"
        )


# --------------------------------------------------------------------------- attention


def decode_attention(
    q: torch.Tensor,  # [B, Hq, D]
    k_buf: torch.Tensor,  # [S, Hkv, D]
    v_buf: torch.Tensor,  # [S, Hkv, D]
    kv_indptr: torch.Tensor,  # [B+1]
    kv_indices: torch.Tensor,  # [nnz]
    sm_scale: float,
    out: torch.Tensor | None = None,  # [B, Hq, D]
) -> torch.Tensor:  # [B, Hq, D]
    """One query token per sequence over its whole KV (gathered through ``kv_indices``)."""
    check_decode_layout(q, k_buf, v_buf, kv_indptr, kv_indices)
    qo_indptr = torch.arange(q.shape[0] + 1, device=q.device, dtype=kv_indptr.dtype)
    return _grouped_attention(
        q, None, None, k_buf, v_buf, qo_indptr, kv_indptr, kv_indices, sm_scale, out
    )


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
    out: torch.Tensor | None = None,  # [N, Hq, D]
) -> torch.Tensor:  # [N, Hq, D]
    """New tokens attend to their cached prefix (from the pool) and causally to each other."""
    check_extend_layout(q, k, v, k_buf, v_buf, qo_indptr, kv_indptr, kv_indices)
    return _grouped_attention(
        q, k, v, k_buf, v_buf, qo_indptr, kv_indptr, kv_indices, sm_scale, out
    )


def length_groups(
    q_lens: list[int],
    kv_lens: list[int],
    kv_elems_per_token: int,
) -> list[list[int]]:
    """Sequences (longest first) in groups of similar total length, each group's padded
    K below ``_GROUP_KV_ELEMS`` elements (a single long sequence is its own group)."""
    order = sorted(
        range(len(q_lens)), key=lambda b: (q_lens[b] + kv_lens[b], q_lens[b]), reverse=True
    )
    groups: list[list[int]] = []
    for b in order:
        if q_lens[b] == 0:
            continue
        total = q_lens[b] + kv_lens[b]
        if groups:
            head = groups[-1][0]
            head_total = q_lens[head] + kv_lens[head]
            size = (len(groups[-1]) + 1) * head_total * kv_elems_per_token
            if total >= _GROUP_MIN_FILL * head_total and size <= _GROUP_KV_ELEMS:
                groups[-1].append(b)
                continue
        groups.append([b])
    return groups


def _grouped_attention(q, k, v, k_buf, v_buf, qo_indptr, kv_indptr, kv_indices, sm_scale, out):
    if out is None:
        out = torch.empty_like(q)
    qo, kv = qo_indptr.tolist(), kv_indptr.tolist()
    q_lens = [qo[b + 1] - qo[b] for b in range(len(qo) - 1)]
    kv_lens = [kv[b + 1] - kv[b] for b in range(len(kv) - 1)]
    per_token = k_buf.shape[1] * k_buf.shape[2]
    for group in length_groups(q_lens, kv_lens, per_token):
        idx = torch.tensor(group, device=q.device)
        _padded_attention(
            q,
            k,
            v,
            k_buf,
            v_buf,
            qo_indptr[idx],
            kv_indptr[idx],
            [q_lens[b] for b in group],
            [kv_lens[b] for b in group],
            kv_indices,
            sm_scale,
            out,
        )
    return out


def _padded_attention(
    q, k, v, k_buf, v_buf, q_start, kv_start, q_lens, kv_lens, kv_indices, sm_scale, out
) -> None:
    """Attention of one group, padded to ``[g, H, Lq, Lkv]``: the prefix gathered from the
    pool, then (in extend) the group's new tokens, with a causal mask over the new ones."""
    g, hq, d = len(q_lens), q.shape[1], q.shape[2]
    dev = q.device
    lq, lp = max(q_lens), max(kv_lens)
    q_pos = torch.arange(lq, device=dev)
    q_ok = q_pos < torch.tensor(q_lens, device=dev)[:, None]  # [g, lq]
    q_rows = (q_start[:, None] + q_pos).masked_fill(~q_ok, 0)  # [g, lq]
    p_pos = torch.arange(lp, device=dev)
    p_len = torch.tensor(kv_lens, device=dev)[:, None]
    p_ok = p_pos < p_len  # [g, lp]
    slots = kv_indices[(kv_start[:, None] + p_pos).masked_fill(~p_ok, 0)] if lp else None
    kk = k_buf[slots] if lp else k_buf.new_empty(g, 0, *k_buf.shape[1:])  # [g, lp, Hkv, D]
    vv = v_buf[slots] if lp else v_buf.new_empty(g, 0, *v_buf.shape[1:])
    mask = p_ok[:, None, :]  # [g, 1, lp]: every query sees its whole prefix
    if k is not None:
        kk = torch.cat((kk, k[q_rows].to(kk.dtype)), dim=1)  # [g, lp + lq, Hkv, D]
        vv = torch.cat((vv, v[q_rows].to(vv.dtype)), dim=1)
        causal = q_pos[None, :, None] >= q_pos[None, None, :]  # [1, lq, lq]
        mask = torch.cat((mask.expand(g, lq, lp), causal & q_ok[:, None, :]), dim=2)
    full = min(kv_lens) == lp and min(q_lens) == lq
    plain_causal = full and k is not None and lp == 0  # no prefix: top-left causal mask
    no_mask = full and (k is None or lq == 1)
    qq = q[q_rows].transpose(1, 2)  # [g, Hq, lq, D]
    o = F.scaled_dot_product_attention(
        qq,
        kk.transpose(1, 2).to(q.dtype),
        vv.transpose(1, 2).to(q.dtype),
        attn_mask=None if no_mask or plain_causal else mask[:, None],
        is_causal=plain_causal and lq > 1,
        scale=sm_scale,
        enable_gqa=hq != k_buf.shape[1],
    )  # [g, Hq, lq, D]
    o = o.transpose(1, 2)  # [g, lq, Hq, D]
    if lq == 1 or min(q_lens) == lq:
        out[q_rows.reshape(-1)] = o.reshape(-1, hq, d)
    else:
        out[q_rows[q_ok]] = o[q_ok]
