"""The short causal convolution before a linear-attention layer (Gated DeltaNet, Mamba2,
Mamba v1) over packed sequences, from each sequence's last ``K - 1`` inputs (its conv
state): ``causal_conv1d`` for an extend (and the radix cache's snapshots inside it),
``causal_conv1d_step`` for one decode token. Pure functions, as ``layers/gated_delta.py``'s:
states in, states out; float32 arithmetic (float64 for float64 inputs)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from radixlm.runtime.executor.forward_batch import StateIndices
from radixlm.runtime.executor.layers.gated_delta import (
    SeqLens,
    Snapshots,
    compute_dtype,
    seq_lens_tensor,
)


def _activation(out: torch.Tensor, activation: str | None) -> torch.Tensor:
    """The conv's activation, in place: ``out`` is a temporary of the caller's."""
    if activation is None:
        return out
    if activation in ("silu", "swish"):
        return F.silu(out, inplace=True)
    raise ValueError(f"unsupported conv activation {activation!r}; supported: silu, None")


def causal_conv1d(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                  conv_state: torch.Tensor, seq_lens: SeqLens, activation: str | None = "silu",
                  snapshots: Snapshots | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Depthwise causal conv over packed sequences, each continuing from its conv state.

    x [T, C] (sequences one after another, ``sum(seq_lens) == T``), weight [C, K] (the
    checkpoint's ``conv1d.weight`` [C, 1, K] squeezed), bias [C] or None, conv_state
    [B, C, K - 1] -> (out [T, C] in x's dtype, new conv_state [B, C, K - 1] in its dtype,
    the ``snapshots``' conv states [S, C, K - 1] or None).
    ``out[t] = act(bias + sum_j weight[:, j] * in[t - (K - 1) + j])``, where ``in`` is the
    sequence's state followed by its tokens (transformers' ``causal_conv1d_fn`` with padding
    K - 1, the state in place of the zeros). A sequence shorter than K - 1 keeps part of its
    old state."""
    tokens, channels = x.shape
    width = weight.shape[1] - 1
    lens = seq_lens_tensor(seq_lens, x.device)
    batch = lens.numel()
    assert int(lens.sum()) == tokens, f"seq_lens sum {int(lens.sum())} != {tokens} tokens"
    assert conv_state.shape == (batch, channels, width), (conv_state.shape, batch, x.shape)
    cdt = compute_dtype(x)
    # each sequence's window [state (K - 1 rows), its tokens], the sequences one after another
    ext_start = torch.cumsum(lens + width, 0) - (lens + width)  # [B]
    seq_of_token = torch.repeat_interleave(torch.arange(batch, device=x.device), lens)
    token_row = torch.arange(tokens, device=x.device) + width * (seq_of_token + 1)  # [T]
    taps = torch.arange(width, device=x.device)
    ext = torch.empty(tokens + batch * width, channels, dtype=cdt, device=x.device)
    ext[(ext_start[:, None] + taps).reshape(-1)] = (
        conv_state.transpose(1, 2).reshape(-1, channels).to(cdt))
    if batch == 1:
        ext[width:] = x  # converted as copied
    else:
        ext[token_row] = x.to(cdt)
    w = weight.to(cdt).t().contiguous()  # [K, C]: each tap's weights contiguous
    # every window of K rows of ext, slid over all of it (views, no gathers): the windows
    # that straddle two sequences end on no token and are dropped
    span = max(ext.shape[0] - width, 0)
    out = ext[:span] * w[0]
    if bias is not None:
        out += bias.to(cdt)
    for j in range(1, width + 1):
        out.addcmul_(ext[j:j + span], w[j])
    if batch > 1:
        out = out[token_row - width]

    def state_after(seqs: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
        # the K - 1 rows of the window before its token ``count``: [n, C, K - 1]
        rows = (ext_start[seqs] + count)[:, None] + taps
        return ext[rows].transpose(1, 2).to(conv_state.dtype)

    snaps = None
    if snapshots is not None:
        snapshots.check(lens)
        snaps = state_after(snapshots.seqs, snapshots.lens)
    new_state = state_after(torch.arange(batch, device=x.device), lens)
    return _activation(out, activation).to(x.dtype), new_state, snaps


def causal_conv1d_step(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                       conv_state: torch.Tensor, activation: str | None = "silu"
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """One decode token per sequence: x [B, C], weight [C, K], bias [C] or None,
    conv_state [B, C, K - 1] -> (out [B, C], new conv_state [B, C, K - 1]): ``causal_conv1d``
    with every ``seq_lens`` 1 (transformers' ``causal_conv1d_update``)."""
    cdt = compute_dtype(x)
    window = torch.cat([conv_state.to(cdt), x.to(cdt)[:, :, None]], dim=-1)  # [B, C, K]
    out = (window * weight.to(cdt)).sum(-1)
    if bias is not None:
        out = out + bias.to(cdt)
    return _activation(out, activation).to(x.dtype), window[:, :, 1:].to(conv_state.dtype)


def conv_in_pool(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                 activation: str | None, st: StateIndices, layer: int, decode: bool
                 ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None]:
    """A step (``decode``) or an extend of ``layer``'s short convolution on its conv states
    gathered from the state pool (a fresh sequence's zeroed), written back, with the conv
    states of the radix cache's snapshots inside the extend written to their slots: (the
    convolved x, the snapshots the recurrence after it still owes as ``(seqs, lens,
    slots)``, or None). What the GPU paths of the linear layers share: their recurrence
    then runs in place in the pool (``kernels/*_triton``)."""
    pool = st.pool
    conv_state = pool.conv[layer][st.slots]
    if st.fresh is not None:
        conv_state[st.fresh] = 0
    conv_snaps = None
    if decode:
        x, conv_state = causal_conv1d_step(x, weight, bias, conv_state, activation)
    else:
        x, conv_state, conv_snaps = causal_conv1d(x, weight, bias, conv_state, st.seq_lens,
                                                  activation, st.saves)
    pool.conv[layer][st.slots] = conv_state.to(pool.conv_dtype)
    if st.saves is None or st.save_slots is None or conv_snaps is None:
        return x, None
    pool.conv[layer][st.save_slots] = conv_snaps.to(pool.conv_dtype)
    return x, (st.saves.seqs, st.saves.lens, st.save_slots)
