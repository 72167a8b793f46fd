"""Triton fused recurrent selective state update (Mamba2) over packed sequences, in the pool.

The GPU twin of ``layers/mamba2.ssd_step`` applied token by token: one program per
(sequence, head, block of ``BLOCK_P`` head channels) keeps its state tile [BLOCK_P, N] in
registers while it walks its sequence's tokens, per token::

    dt = clamp(softplus(dt_t + dt_bias_h), *dt_limit);   A_h = -exp(A_log_h)
    S <- exp(dt A_h) S + dt x_t B_t^T;   y_t = S C_t + D_h x_t

head ``h`` reading group ``h // (H / G)`` of B and C. States are read from and written
back to the pool [slots, H, P, N] (float32) at each sequence's slot, in place; snapshots
and ``fresh`` sequences as in ``gated_delta_triton`` (whose launcher helpers this reuses).
Decode is the case of one token a sequence; ``chunk_ssd_scan`` is the chunked (SSD) form
of the same scan and ``layers/mamba2`` the reference twin.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from radixlm.kernels.gated_delta_triton import SeqLens, SnapshotSlots, cu_seqlens, snapshot_order

NO_DT_LIMIT = (0.0, float("inf"))


@triton.jit
def _ssd_recurrent(
    x_ptr, dt_ptr, b_ptr, c_ptr, a_log_ptr, d_ptr, dt_bias_ptr, y_ptr, pool_ptr,
    cu_ptr,  # [B + 1]: each sequence's first token
    slot_ptr,  # [B]: each sequence's pool slot
    fresh_ptr,  # HAS_FRESH: [B] int8, 1: start from zeros
    snap_ptr,  # HAS_SNAPS: [B + 1] into the snapshots sorted by (sequence, tokens)
    snap_len_ptr,  # HAS_SNAPS: [S] tokens before each snapshot (sorted)
    snap_slot_ptr,  # HAS_SNAPS: [S] its pool slot
    dt_min, dt_max,
    stride_xt, stride_xh, stride_dtt, stride_bt, stride_bg, stride_ct, stride_cg,
    stride_yt, stride_yh,
    stride_ps, stride_ph, stride_pp,  # pool [S, H, P, N], N contiguous
    GROUP: tl.constexpr,  # H / G
    P: tl.constexpr,
    N: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HAS_FRESH: tl.constexpr,
    HAS_SNAPS: tl.constexpr,
):
    seq = tl.program_id(0)
    h = tl.program_id(1)
    grp = h // GROUP
    offs_p = tl.program_id(2) * BLOCK_P + tl.arange(0, BLOCK_P)
    offs_n = tl.arange(0, BLOCK_N)
    mask_p = offs_p < P
    mask_n = offs_n < N
    mask_s = mask_p[:, None] & mask_n[None, :]
    bos = tl.load(cu_ptr + seq).to(tl.int64)
    eos = tl.load(cu_ptr + seq + 1).to(tl.int64)
    slot = tl.load(slot_ptr + seq).to(tl.int64)
    tile = offs_p[:, None] * stride_pp + offs_n[None, :]  # [BLOCK_P, BLOCK_N]
    s_ptrs = pool_ptr + slot * stride_ps + h * stride_ph + tile
    s = tl.load(s_ptrs, mask=mask_s, other=0.0).to(tl.float32)
    if HAS_FRESH:
        # where, not a product: a reused slot may hold NaN or inf
        s = tl.where(tl.load(fresh_ptr + seq) != 0, 0.0, s)
    a = -tl.exp(tl.load(a_log_ptr + h).to(tl.float32))
    skip = tl.load(d_ptr + h).to(tl.float32)
    dt_bias = tl.load(dt_bias_ptr + h).to(tl.float32)
    if HAS_SNAPS:
        snap = tl.load(snap_ptr + seq)
        snap_end = tl.load(snap_ptr + seq + 1)
        next_len = tl.load(snap_len_ptr + snap, mask=snap < snap_end, other=-1)
    for t in range(bos, eos):
        x = tl.load(x_ptr + t * stride_xt + h * stride_xh + offs_p, mask=mask_p,
                    other=0.0).to(tl.float32)
        b = tl.load(b_ptr + t * stride_bt + grp * stride_bg + offs_n, mask=mask_n,
                    other=0.0).to(tl.float32)
        c = tl.load(c_ptr + t * stride_ct + grp * stride_cg + offs_n, mask=mask_n,
                    other=0.0).to(tl.float32)
        dt = tl.load(dt_ptr + t * stride_dtt + h).to(tl.float32) + dt_bias
        dt = tl.where(dt > 20.0, dt, tl.log(1.0 + tl.exp(dt)))  # torch's softplus
        dt = tl.minimum(tl.maximum(dt, dt_min), dt_max)
        s = s * tl.exp(dt * a) + (dt * x)[:, None] * b[None, :]
        y = tl.sum(s * c[None, :], 1) + skip * x
        tl.store(y_ptr + t * stride_yt + h * stride_yh + offs_p, y.to(y_ptr.dtype.element_ty),
                 mask=mask_p)
        if HAS_SNAPS:
            # the snapshots of this sequence come sorted by length: at most one per token
            if next_len == t - bos + 1:
                snap_slot = tl.load(snap_slot_ptr + snap).to(tl.int64)
                tl.store(pool_ptr + snap_slot * stride_ps + h * stride_ph + tile, s,
                         mask=mask_s)
                snap += 1
                next_len = tl.load(snap_len_ptr + snap, mask=snap < snap_end, other=-1)
    tl.store(s_ptrs, s, mask=mask_s)


def fused_recurrent_ssd(
        x: torch.Tensor, dt: torch.Tensor, A_log: torch.Tensor, B: torch.Tensor,
        C: torch.Tensor, D: torch.Tensor, dt_bias: torch.Tensor, pool: torch.Tensor,
        slots: torch.Tensor, seq_lens: SeqLens,
        dt_limit: tuple[float, float] = NO_DT_LIMIT, fresh: torch.Tensor | None = None,
        snapshots: SnapshotSlots | None = None, block_p: int = 16) -> torch.Tensor:
    """The selective scan over packed sequences, token by token, states in the pool.

    x [T, H, P] (after the conv), dt [T, H] (the projection's, before bias and softplus),
    B, C [T, G, N] (H a multiple of G; the last dims of x, B, C contiguous), A_log, D,
    dt_bias [H]; pool [S, H, P, N] float32, updated in place: sequence i
    (``seq_lens[i]`` tokens, in order) starts from ``pool[slots[i]]`` (zeros where
    ``fresh[i]``) and leaves its final state there; ``snapshots`` write the state after
    ``lens[j]`` tokens of sequence ``seqs[j]`` to ``pool[slots[j]]``
    (``snapshots`` = (seqs, lens, slots)) -> y [T, H, P] with the D skip, in x's
    dtype. Slots must be distinct."""
    tokens, heads, head_dim = x.shape
    groups, d_state = B.shape[1], B.shape[2]
    assert dt.shape == (tokens, heads) and dt.stride(1) == 1, dt.shape
    assert B.shape == C.shape == (tokens, groups, d_state) and heads % groups == 0, B.shape
    assert pool.dtype == torch.float32 and pool.shape[1:] == (heads, head_dim, d_state)
    assert pool.stride(3) == 1 and x.stride(2) == B.stride(2) == C.stride(2) == 1
    cu = cu_seqlens(seq_lens, x.device)
    batch = cu.numel() - 1
    assert slots.numel() == batch, (slots.shape, batch)
    if not isinstance(seq_lens, torch.Tensor):  # a host list: checked without a readback
        assert sum(seq_lens) == tokens, (sum(seq_lens), tokens)
    y = torch.empty_like(x)
    if batch == 0:
        return y
    snap_ptr = snap_len = snap_slot = slots  # unread without snapshots
    if snapshots is not None:
        snap_ptr, snap_len, snap_slot = snapshot_order(snapshots, seq_lens, x.device)
    block_p = min(block_p, triton.next_power_of_2(head_dim))
    grid = (batch, heads, triton.cdiv(head_dim, block_p))
    _ssd_recurrent[grid](
        x, dt, B, C, A_log, D, dt_bias, y, pool, cu, slots,
        slots if fresh is None else fresh.to(torch.int8), snap_ptr, snap_len, snap_slot,
        float(dt_limit[0]), float(dt_limit[1]),
        x.stride(0), x.stride(1), dt.stride(0), B.stride(0), B.stride(1),
        C.stride(0), C.stride(1), y.stride(0), y.stride(1),
        pool.stride(0), pool.stride(1), pool.stride(2),
        GROUP=heads // groups, P=head_dim, N=d_state, BLOCK_P=block_p,
        BLOCK_N=triton.next_power_of_2(d_state), HAS_FRESH=fresh is not None,
        HAS_SNAPS=snapshots is not None)
    return y
