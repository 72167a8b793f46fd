"""Triton fused recurrent gated delta rule over packed sequences, states in the pool.

The GPU twin of ``layers/gated_delta.recurrent_gated_delta_rule_step`` applied token by
token (the formulation FLA calls *fused recurrent*): one program per (sequence, value
head, block of ``BLOCK_V`` value columns) keeps its state tile [Dk, BLOCK_V] in registers
while it walks its sequence's tokens, per token::

    S <- exp(g_t) S;   delta = beta_t (v_t - S^T k_t);   S <- S + k_t delta^T;   o_t = S^T q_t

with q and k l2-normalised in the kernel when asked and q scaled; value head ``h`` reads
q/k head ``h // (Hv / Hk)``. The states are read from and written back to the pool
[slots, Hv, Dk, Dv] (float32) at each sequence's slot, in place: no gather or scatter.
Snapshots (the state after the first n tokens of a sequence, for the radix cache) are
written to their own pool slots as the walk passes them. A sequence marked ``fresh``
starts from zeros, whatever its slot holds. Decode is the case of one token a sequence.

The work is sequential in the tokens (the chunked WY form, ``chunk_gated_delta_rule``,
is the faster prefill on a GPU for long prompts; this kernel is exact and simple, and
the decode kernel). ``layers/gated_delta`` is the reference twin.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

SeqLens = Sequence[int] | torch.Tensor
# snapshots (the radix cache's states inside an extend): (sequence index in the call [S],
# its tokens before the snapshot [S], 1 .. that sequence's length, the pool slot [S])
SnapshotSlots = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


@triton.jit
def _gated_delta_recurrent(
    q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, out_ptr, pool_ptr,
    cu_ptr,  # [B + 1]: each sequence's first token
    slot_ptr,  # [B]: each sequence's pool slot
    fresh_ptr,  # HAS_FRESH: [B] int8, 1: start from zeros
    snap_ptr,  # HAS_SNAPS: [B + 1] into the snapshots sorted by (sequence, tokens)
    snap_len_ptr,  # HAS_SNAPS: [S] tokens before each snapshot (sorted)
    snap_slot_ptr,  # HAS_SNAPS: [S] its pool slot
    scale,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
    stride_gt, stride_gh, stride_bt, stride_bh, stride_ot, stride_oh,
    stride_ps, stride_ph, stride_pk,  # pool [S, Hv, Dk, Dv], Dv contiguous
    GROUP: tl.constexpr,  # Hv / Hk
    DK: tl.constexpr,
    DV: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_V: tl.constexpr,
    L2NORM: tl.constexpr,
    HAS_FRESH: tl.constexpr,
    HAS_SNAPS: tl.constexpr,
):
    seq = tl.program_id(0)
    h = tl.program_id(1)
    hk = h // GROUP
    offs_k = tl.arange(0, BLOCK_K)
    offs_v = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)
    mask_k = offs_k < DK
    mask_v = offs_v < DV
    mask_s = mask_k[:, None] & mask_v[None, :]
    bos = tl.load(cu_ptr + seq).to(tl.int64)
    eos = tl.load(cu_ptr + seq + 1).to(tl.int64)
    slot = tl.load(slot_ptr + seq).to(tl.int64)
    tile = offs_k[:, None] * stride_pk + offs_v[None, :]  # [BLOCK_K, BLOCK_V]
    s_ptrs = pool_ptr + slot * stride_ps + h * stride_ph + tile
    s = tl.load(s_ptrs, mask=mask_s, other=0.0).to(tl.float32)
    if HAS_FRESH:
        # where, not a product: a reused slot may hold NaN or inf
        s = tl.where(tl.load(fresh_ptr + seq) != 0, 0.0, s)
    if HAS_SNAPS:
        snap = tl.load(snap_ptr + seq)
        snap_end = tl.load(snap_ptr + seq + 1)
        next_len = tl.load(snap_len_ptr + snap, mask=snap < snap_end, other=-1)
    for t in range(bos, eos):
        q = tl.load(q_ptr + t * stride_qt + hk * stride_qh + offs_k, mask=mask_k,
                    other=0.0).to(tl.float32)
        k = tl.load(k_ptr + t * stride_kt + hk * stride_kh + offs_k, mask=mask_k,
                    other=0.0).to(tl.float32)
        if L2NORM:  # FLA's l2norm: x / sqrt(sum(x^2) + 1e-6)
            q = q / tl.sqrt(tl.sum(q * q, 0) + 1e-6)
            k = k / tl.sqrt(tl.sum(k * k, 0) + 1e-6)
        q = q * scale
        v = tl.load(v_ptr + t * stride_vt + h * stride_vh + offs_v, mask=mask_v,
                    other=0.0).to(tl.float32)
        g = tl.load(g_ptr + t * stride_gt + h * stride_gh).to(tl.float32)
        beta = tl.load(beta_ptr + t * stride_bt + h * stride_bh).to(tl.float32)
        s = s * tl.exp(g)
        recall = tl.sum(s * k[:, None], 0)  # [BLOCK_V]: S^T k
        delta = beta * (v - recall)
        s = s + k[:, None] * delta[None, :]
        o = tl.sum(s * q[:, None], 0)
        tl.store(out_ptr + t * stride_ot + h * stride_oh + offs_v,
                 o.to(out_ptr.dtype.element_ty), mask=mask_v)
        if HAS_SNAPS:
            # the snapshots of this sequence come sorted by length: at most one per token
            if next_len == t - bos + 1:
                snap_slot = tl.load(snap_slot_ptr + snap).to(tl.int64)
                tl.store(pool_ptr + snap_slot * stride_ps + h * stride_ph + tile, s,
                         mask=mask_s)
                snap += 1
                next_len = tl.load(snap_len_ptr + snap, mask=snap < snap_end, other=-1)
    tl.store(s_ptrs, s, mask=mask_s)


def cu_seqlens(seq_lens: SeqLens, device: torch.device) -> torch.Tensor:
    """[B] tokens per sequence -> [B + 1] int32 offsets of each sequence's first token."""
    lens = torch.as_tensor(seq_lens, dtype=torch.int64, device=device).reshape(-1)
    return torch.nn.functional.pad(lens.cumsum(0), (1, 0)).to(torch.int32)


def snapshot_order(snapshots: SnapshotSlots, seq_lens: SeqLens, device: torch.device
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The snapshots as the kernels walk them: sorted by (sequence, tokens) -> ([B + 1]
    int32 offsets of each sequence's first snapshot, [S] int32 tokens before each, [S]
    int64 pool slots). A snapshot outside its sequence, or two of one sequence at the
    same length, are refused."""
    lens = torch.as_tensor(seq_lens, dtype=torch.int64, device=device).reshape(-1)
    seqs, counts, snap_slots = (t.to(device, torch.int64) for t in snapshots)
    if not bool(((counts >= 1) & (counts <= lens[seqs])).all()):
        raise ValueError(f"snapshots {counts.tolist()} outside sequences "
                         f"{lens[seqs].tolist()}")
    order = torch.argsort(seqs * (int(lens.max()) + 1) + counts)
    seqs, counts = seqs[order], counts[order]
    if bool(((seqs[1:] == seqs[:-1]) & (counts[1:] == counts[:-1])).any()):
        raise ValueError("two snapshots of one sequence at the same length")
    per_seq = torch.bincount(seqs, minlength=lens.numel())
    indptr = torch.nn.functional.pad(per_seq.cumsum(0), (1, 0)).to(torch.int32)
    return indptr, counts.to(torch.int32), snap_slots[order]


def fused_recurrent_gated_delta_rule(
        q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
        pool: torch.Tensor, slots: torch.Tensor, seq_lens: SeqLens,
        scale: float | None = None, use_qk_l2norm: bool = True,
        fresh: torch.Tensor | None = None, snapshots: SnapshotSlots | None = None,
        block_v: int = 32) -> torch.Tensor:
    """The gated delta rule over packed sequences, token by token, states in the pool.

    q, k [T, Hk, Dk]; v [T, Hv, Dv] (Hv a multiple of Hk; the last dims contiguous);
    g, beta [T, Hv] (``gated_delta_gates``); pool [S, Hv, Dk, Dv] float32, updated in place:
    sequence i (``seq_lens[i]`` tokens, in order) starts from ``pool[slots[i]]`` (zeros
    where ``fresh[i]``) and leaves its final state there; ``snapshots`` (seqs, lens, slots)
    write the state after ``lens[j]`` tokens of sequence ``seqs[j]`` to ``pool[slots[j]]``.
    ``scale`` defaults to Dk ** -0.5 -> out [T, Hv, Dv] in q's dtype. Slots must be
    distinct."""
    tokens, hk, dk = q.shape
    hv, dv = v.shape[1], v.shape[2]
    assert k.shape == q.shape and v.shape[0] == tokens and hv % hk == 0, (q.shape, v.shape)
    assert g.shape == (tokens, hv) and beta.shape == (tokens, hv), (g.shape, beta.shape)
    assert pool.dtype == torch.float32 and pool.shape[1:] == (hv, dk, dv), pool.shape
    assert pool.stride(3) == 1 and q.stride(2) == k.stride(2) == v.stride(2) == 1
    cu = cu_seqlens(seq_lens, q.device)
    batch = cu.numel() - 1
    assert slots.numel() == batch, (slots.shape, batch)
    if not isinstance(seq_lens, torch.Tensor):  # a host list: checked without a readback
        assert sum(seq_lens) == tokens, (sum(seq_lens), tokens)
    out = torch.empty(tokens, hv, dv, dtype=q.dtype, device=q.device)
    if batch == 0:
        return out
    snap_ptr = snap_len = snap_slot = slots  # unread without snapshots
    if snapshots is not None:
        snap_ptr, snap_len, snap_slot = snapshot_order(snapshots, seq_lens, q.device)
    block_v = min(block_v, triton.next_power_of_2(dv))
    grid = (batch, hv, triton.cdiv(dv, block_v))
    _gated_delta_recurrent[grid](
        q, k, v, g, beta, out, pool, cu, slots,
        slots if fresh is None else fresh.to(torch.int8), snap_ptr, snap_len, snap_slot,
        dk ** -0.5 if scale is None else scale,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        g.stride(0), g.stride(1), beta.stride(0), beta.stride(1), out.stride(0), out.stride(1),
        pool.stride(0), pool.stride(1), pool.stride(2),
        GROUP=hv // hk, DK=dk, DV=dv, BLOCK_K=triton.next_power_of_2(dk), BLOCK_V=block_v,
        L2NORM=use_qk_l2norm, HAS_FRESH=fresh is not None, HAS_SNAPS=snapshots is not None)
    return out
