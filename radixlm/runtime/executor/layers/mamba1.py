"""Mamba (v1)'s selective scan over packed sequences (Jamba's Mamba layers).

Unlike Mamba2 (one scalar decay per head, ``layers/mamba2.py``), each of the mixer's ``I``
channels has its own state of ``N`` numbers and its own decay per state number, so the
state of one sequence is ``ssm`` [I, N] (float32) and, per token ``t``::

    dt = softplus(dt_t + dt_bias)                             [I]
    S <- exp(dt[:, None] * A) * S + (dt * x_t)[:, None] * B_t[None, :]
    y_t = S C_t + D * x_t                                     (A = -exp(A_log) [I, N])

``selective_scan`` (prefill / extend) runs that recurrence token by token, one sequence
after another (no padding: the work is the call's tokens, whatever their spread), making
the decays and writes ``SCAN_BLOCK`` tokens at a time and each token's state in place of
its write; the state after chosen tokens inside the sequences (``Snapshots``: the radix
cache's) is copied on the way. ``selective_scan_step`` (decode) is the recurrence once.
transformers' ``mamba_selective_scan`` (its recurrent path) and
``mamba_selective_state_update`` are the reference: the same float32 products in the same
order, to rounding.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from radixlm.runtime.executor.layers.gated_delta import (
    SeqLens,
    Snapshots,
    compute_dtype,
    seq_lens_tensor,
)

SCAN_BLOCK = 64  # tokens whose decays and writes [block, I, N] are made at once


def discretize(dt: torch.Tensor, dt_bias: torch.Tensor, A_log: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """dt [..., I] (``dt_proj``'s output without its bias) -> (``softplus(dt + dt_bias)``
    [..., I], A = ``-exp(A_log)`` [I, N]), in the compute dtype."""
    cdt = compute_dtype(dt)
    return F.softplus(dt.to(cdt) + dt_bias.to(cdt)), -A_log.to(cdt).exp()


def _snapshot_steps(snapshots: Snapshots | None, lens: torch.Tensor
                    ) -> dict[tuple[int, int], list[int]]:
    """(sequence, tokens) -> the snapshots j that want its state after that many tokens."""
    steps: dict[tuple[int, int], list[int]] = {}
    if snapshots is None:
        return steps
    snapshots.check(lens)
    for j, key in enumerate(zip(snapshots.seqs.tolist(), snapshots.lens.tolist())):
        steps.setdefault(key, []).append(j)
    return steps


def selective_scan(x: torch.Tensor, dt: torch.Tensor, A_log: torch.Tensor, B: torch.Tensor,
                   C: torch.Tensor, D: torch.Tensor, dt_bias: torch.Tensor,
                   initial_state: torch.Tensor, seq_lens: SeqLens,
                   snapshots: Snapshots | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The selective scan over packed sequences (prefill / extend), each from its state.

    x [T, I] (after the conv), dt [T, I] (before bias and softplus), A_log [I, N], B, C
    [T, N], D, dt_bias [I], initial_state [B, I, N] -> (y [T, I] with the D skip, in x's
    dtype; final states [B, I, N] and the ``snapshots``' states [S, I, N] or None, in the
    compute dtype). Token by token equal (to rounding) to ``selective_scan_step``."""
    lens = seq_lens_tensor(seq_lens, x.device)
    assert int(lens.sum()) == x.shape[0], f"seq_lens sum {int(lens.sum())} != {x.shape[0]}"
    cdt = compute_dtype(x)
    dt, A = discretize(dt, dt_bias, A_log)
    xf, bf, cf = x.to(cdt), B.to(cdt), C.to(cdt)
    states = initial_state.to(cdt).clone()  # [B, I, N]
    ys = torch.empty(xf.shape, dtype=cdt, device=x.device)
    wanted = _snapshot_steps(snapshots, lens)
    snaps = None if snapshots is None else states.new_empty(len(snapshots.seqs),
                                                            *states.shape[1:])
    end = 0
    for seq, n in enumerate(lens.tolist()):
        start, end = end, end + n
        state = states[seq]
        for first in range(start, end, SCAN_BLOCK):
            block = slice(first, min(first + SCAN_BLOCK, end))
            decay = (dt[block, :, None] * A).exp()  # [b, I, N]
            # what each token writes, (dt B) x in transformers' order; then, in its place,
            # each token's state
            block_states = dt[block, :, None] * bf[block, None, :] * xf[block, :, None]
            for i in range(block_states.shape[0]):
                state = block_states[i].addcmul_(decay[i], state)  # exp(dt A) S + dt B x
                for j in wanted.get((seq, first - start + i + 1), ()):
                    snaps[j] = state
            ys[block] = (block_states @ cf[block, :, None])[..., 0]  # S_t C_t
        states[seq] = state
    y = ys + xf * D.to(cdt)
    return y.to(x.dtype), states, snaps


def selective_scan_step(x: torch.Tensor, dt: torch.Tensor, A_log: torch.Tensor,
                        B: torch.Tensor, C: torch.Tensor, D: torch.Tensor,
                        dt_bias: torch.Tensor, state: torch.Tensor
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """One decode token per sequence: x, dt [B, I], B, C [B, N], A_log [I, N], D, dt_bias
    [I], state [B, I, N] -> (y [B, I] with the D skip, in x's dtype; the new state in the
    compute dtype)."""
    cdt = compute_dtype(x)
    dt, A = discretize(dt, dt_bias, A_log)
    xf = x.to(cdt)
    s = (dt[..., None] * A).exp() * state.to(cdt) + dt[..., None] * B.to(cdt)[:, None] * xf[
        ..., None]
    y = (s @ C.to(cdt)[..., None])[..., 0] + xf * D.to(cdt)
    return y.to(x.dtype), s
