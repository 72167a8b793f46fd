"""Mamba (v1)'s selective scan over packed sequences (Jamba's Mamba layers).

Unlike Mamba2 (one scalar decay per head, ``layers/mamba2.py``), each of the mixer's ``I``
channels has its own state of ``N`` numbers and its own decay per state number, so the
state of one sequence is ``ssm`` [I, N] (float32) and, per token ``t``::

    dt = softplus(dt_t + dt_bias)                             [I]
    S <- exp(dt[:, None] * A) * S + (dt * x_t)[:, None] * B_t[None, :]
    y_t = S C_t + D * x_t                                     (A = -exp(A_log) [I, N])

``selective_scan`` (prefill / extend) runs that recurrence token by token, all the
sequences of a call side by side (padded to the longest: a padding row has dt = 0, so it
neither decays nor writes), computing the decays and writes a block of tokens at a time;
the state after chosen tokens inside the sequences (``Snapshots``: the radix cache's) is
copied on the way. ``selective_scan_step`` (decode) is the recurrence once. transformers'
``mamba_selective_scan`` (its recurrent path) and ``mamba_selective_state_update`` are the
reference: the same float32 products in the same order, summed over N the same way.
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

SCAN_BLOCK = 64  # tokens whose decays and writes [B, block, I, N] are made at once


def discretize(dt: torch.Tensor, dt_bias: torch.Tensor, A_log: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """dt [..., I] (``dt_proj``'s output without its bias) -> (``softplus(dt + dt_bias)``
    [..., I], A = ``-exp(A_log)`` [I, N]), in the compute dtype."""
    cdt = compute_dtype(dt)
    return F.softplus(dt.to(cdt) + dt_bias.to(cdt)), -A_log.to(cdt).exp()


def _padded(t: torch.Tensor, rows: torch.Tensor, batch: int, length: int) -> torch.Tensor:
    """Packed t [T, ...] -> [batch, length, ...], zeros after each sequence's end."""
    out = t.new_zeros(batch * length, *t.shape[1:])
    out[rows] = t
    return out.view(batch, length, *t.shape[1:])


def _snapshot_steps(snapshots: Snapshots | None, lens: torch.Tensor
                    ) -> dict[int, list[tuple[int, int]]]:
    """Token index -> [(snapshot j, sequence)] whose state is wanted after that token."""
    steps: dict[int, list[tuple[int, int]]] = {}
    if snapshots is None:
        return steps
    snapshots.check(lens)
    for j, (seq, n) in enumerate(zip(snapshots.seqs.tolist(), snapshots.lens.tolist())):
        steps.setdefault(n - 1, []).append((j, seq))
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
    compute dtype). Token by token equal to ``selective_scan_step``."""
    lens = seq_lens_tensor(seq_lens, x.device)
    batch, tokens = lens.numel(), x.shape[0]
    assert int(lens.sum()) == tokens, f"seq_lens sum {int(lens.sum())} != {tokens} tokens"
    cdt = compute_dtype(x)
    length = int(lens.max()) if batch else 0
    seq_of_token = torch.repeat_interleave(torch.arange(batch, device=x.device), lens)
    starts = torch.cumsum(lens, 0) - lens
    rows = seq_of_token * length + torch.arange(tokens, device=x.device) - starts[seq_of_token]
    dt, A = discretize(dt, dt_bias, A_log)  # before padding: softplus(0) != 0
    xf = x.to(cdt)
    # [B, L, ...]; a padding row has dt = 0: decay 1, nothing written
    dtp, xp, bp, cp = (_padded(t.to(cdt), rows, batch, length) for t in (dt, xf, B, C))
    state = initial_state.to(cdt).clone()  # [B, I, N]
    ys = torch.empty(batch, length, x.shape[1], dtype=cdt, device=x.device)
    wanted = _snapshot_steps(snapshots, lens)
    snaps = None if snapshots is None else state.new_empty(len(snapshots.seqs), *state.shape[1:])
    for first in range(0, length, SCAN_BLOCK):
        block = slice(first, min(first + SCAN_BLOCK, length))
        decay = (dtp[:, block, :, None] * A).exp()  # [B, b, I, N]
        # (dt B) x, transformers' order of the products
        write = dtp[:, block, :, None] * bp[:, block, None, :] * xp[:, block, :, None]
        for i in range(decay.shape[1]):
            state = decay[:, i] * state + write[:, i]
            ys[:, first + i] = (state @ cp[:, first + i, :, None])[..., 0]
            for j, seq in wanted.get(first + i, ()):
                snaps[j] = state[seq]
    y = ys.view(batch * length, -1)[rows] + xf * D.to(cdt)
    return y.to(x.dtype), state, snaps


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
