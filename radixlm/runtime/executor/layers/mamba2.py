"""Mamba2's mixer math (Nemotron-H, Granite 4 hybrid, Falcon-H1, Bamba) over packed sequences.

The mixer, after ``in_proj`` split its output into ``gate`` [T, I], ``xBC`` [T, conv_dim]
and ``dt`` [T, H] (``I = H * head_dim``, ``conv_dim = I + 2 * n_groups * d_state``)::

    xBC = silu(causal_conv1d(xBC))            (layers/gated_delta.py, the same short conv)
    x, B, C = split(xBC)                      x [T, H, P], B and C [T, G, N]
    y = ssd(x, dt, A = -exp(A_log), B, C) + D * x
    out = norm(y * silu(gate)) * w            (grouped by G; Falcon-H1 may norm first)

and the selective state space model, per head ``h`` (state ``S`` [P, N], float32), with
``dt = clamp(softplus(dt + dt_bias), *dt_limit)`` and head ``h`` reading group
``h // (H / G)`` of B and C::

    S <- exp(dt * A_h) * S + dt * x_t B_t^T;   y_t = S C_t + D_h x_t

``chunk_ssd_scan`` (prefill / extend) computes it ``chunk_size`` tokens at a time (the SSD
form: a masked attention inside chunks, a sequential pass over chunk states);
``ssd_step`` (decode) is the line above. States are per sequence (``RecurrentState``:
conv [B, conv_dim, K - 1], ssm [B, H, P, N]), taken and returned, and ``Snapshots`` ask
for states inside the sequences, as in gated_delta.py; ``mamba2_mixer_step_in_place``
steps them where they lie in the state pool instead (``kernels/state_step``, on a CPU).
transformers' ``mamba2_chunk_scan`` / ``mamba2_selective_state_update`` and the mixers'
forward are the reference; unlike its decode step, ours applies ``dt_limit`` there too,
so that decode continues exactly what prefill computes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from radixlm.kernels import state_step
from radixlm.runtime.executor.layers.gated_delta import (
    ChunkLayout,
    ChunkStarts,
    RecurrentState,
    SeqLens,
    Snapshots,
    chunk_decay,
    compute_dtype,
    rms_norm_gated,
)
from radixlm.runtime.executor.layers.short_conv import causal_conv1d, causal_conv1d_step

NO_DT_LIMIT = (0.0, float("inf"))


@dataclass(frozen=True)
class Mamba2Spec:
    """The mixer's geometry and options, from config.json."""

    num_heads: int  # H
    head_dim: int  # P
    n_groups: int  # G: heads share B and C in G groups (and the norm's groups)
    d_state: int  # N (``ssm_state_size``)
    chunk_size: int = 256
    dt_limit: tuple[float, float] = NO_DT_LIMIT  # ``time_step_limit``
    norm_eps: float = 1e-5
    norm_before_gate: bool = False  # Falcon-H1's ``mamba_norm_before_gate``
    activation: str | None = "silu"  # of the conv

    @property
    def intermediate_size(self) -> int:  # I
        return self.num_heads * self.head_dim

    @property
    def conv_dim(self) -> int:  # x, B and C: the conv's channels
        return self.intermediate_size + 2 * self.n_groups * self.d_state

    @property
    def ssm_shape(self) -> tuple[int, int, int]:  # one sequence's ssm state
        return (self.num_heads, self.head_dim, self.d_state)


@dataclass(frozen=True)
class Mamba2Weights:
    """One mixer's tensors besides the projections (this rank's, under tensor parallelism)."""

    conv_weight: torch.Tensor  # [conv_dim, K] (the checkpoint's conv1d.weight [conv_dim, 1, K])
    conv_bias: torch.Tensor | None  # [conv_dim]
    dt_bias: torch.Tensor  # [H]
    A_log: torch.Tensor  # [H]: A = -exp(A_log)
    D: torch.Tensor  # [H]: the skip
    norm_weight: torch.Tensor | None  # [I]; None: no norm, y * silu(gate) (Falcon-H1 option)
    # tensor parallelism with fewer groups than ranks: a norm group spread over ranks, this
    # rank's sums of squares [T, 1, 1] -> its whole group's mean squares (an all-reduce)
    norm_mean_square: Callable[[torch.Tensor], torch.Tensor] | None = None


def discretize_dt(dt: torch.Tensor, dt_bias: torch.Tensor,
                  dt_limit: tuple[float, float] = NO_DT_LIMIT) -> torch.Tensor:
    """dt [..., H] (the projection's) -> ``clamp(softplus(dt + dt_bias), *dt_limit)`` in the
    compute dtype (transformers adds the bias in dt's own dtype: bf16 in a bf16 model)."""
    cdt = compute_dtype(dt)
    return F.softplus(dt.to(cdt) + dt_bias.to(cdt)).clamp(dt_limit[0], dt_limit[1])


def _group_to_heads(t: torch.Tensor, num_heads: int) -> torch.Tensor:
    """B or C [..., G, N] -> [..., H, N]: head h reads group h // (H / G)."""
    return t.repeat_interleave(num_heads // t.shape[-2], dim=-2)


def chunk_ssd_scan(x: torch.Tensor, dt: torch.Tensor, A_log: torch.Tensor, B: torch.Tensor,
                   C: torch.Tensor, D: torch.Tensor, dt_bias: torch.Tensor,
                   initial_state: torch.Tensor, seq_lens: SeqLens, chunk_size: int = 256,
                   dt_limit: tuple[float, float] = NO_DT_LIMIT,
                   snapshots: Snapshots | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The selective scan over packed sequences (prefill / extend), in chunks (SSD).

    x [T, H, P] (after the conv), dt [T, H] (the projection's, before bias and softplus),
    A_log, D, dt_bias [H], B, C [T, G, N], initial_state [B, H, P, N] -> (y [T, H, P] with
    the D skip, in x's dtype; final state [B, H, P, N] and the ``snapshots``' states
    [S, H, P, N] or None, in the compute dtype). Token by token equal (to rounding) to
    ``ssd_step``."""
    heads = x.shape[1]
    cdt = compute_dtype(x)
    xf = x.to(cdt)
    dt = discretize_dt(dt, dt_bias, dt_limit)  # [T, H], before padding: softplus(0) != 0
    layout = ChunkLayout.build(seq_lens, chunk_size, x.device)
    assert layout.rows.numel() == x.shape[0], (int(layout.rows.numel()), x.shape)
    # [chunks, H, L, ...]; padding rows have dt = 0: no decay, no write
    xc = layout.pad(xf * dt[..., None]).transpose(1, 2)  # dt * x: what each token writes
    bc, cc = (layout.pad(_group_to_heads(t.to(cdt), heads)).transpose(1, 2) for t in (B, C))
    log_decay = layout.pad(dt * -A_log.to(cdt).exp()).transpose(1, 2)  # [chunks, H, L]
    cum, pair = chunk_decay(log_decay)
    y = ((cc @ bc.transpose(-1, -2)) * pair) @ xc  # within the chunk: [chunks, H, L, P]
    c_in = cc * cum.exp()[..., None]  # reads the incoming state decayed to each token
    # the chunk's own writes, decayed to its end: [chunks, H, P, N]
    written = (xc * (cum[..., -1:] - cum).exp()[..., None]).transpose(-1, -2) @ bc
    end_decay = cum[..., -1].exp()[..., None, None]  # [chunks, H, 1, 1]
    state = initial_state.to(cdt).clone()
    starts = ChunkStarts(layout, snapshots, state)
    for i, (seqs, chunks) in enumerate(layout.steps()):
        s = starts.record(i, state)[seqs]  # [n, H, P, N]
        y[chunks] += c_in[chunks] @ s.transpose(-1, -2)
        state[seqs] = s * end_decay[chunks] + written[chunks]
    y = layout.unpad(y.transpose(1, 2)) + xf * D.to(cdt)[:, None]
    return y.to(x.dtype), state, starts.states_inside(cum, pair, xc, bc)


def ssd_step(x: torch.Tensor, dt: torch.Tensor, A_log: torch.Tensor, B: torch.Tensor,
             C: torch.Tensor, D: torch.Tensor, dt_bias: torch.Tensor, state: torch.Tensor,
             dt_limit: tuple[float, float] = NO_DT_LIMIT) -> tuple[torch.Tensor, torch.Tensor]:
    """One decode token per sequence: x [B, H, P], dt [B, H], B, C [B, G, N], A_log, D,
    dt_bias [H], state [B, H, P, N] -> (y [B, H, P] in x's dtype, new state in the compute
    dtype). transformers' ``mamba2_selective_state_update``, plus ``dt_limit``."""
    heads = x.shape[1]
    cdt = compute_dtype(x)
    xf = x.to(cdt)
    dt = discretize_dt(dt, dt_bias, dt_limit)  # [B, H]
    decay = (dt * -A_log.to(cdt).exp()).exp()[..., None, None]  # [B, H, 1, 1]
    b, c = _group_to_heads(B.to(cdt), heads), _group_to_heads(C.to(cdt), heads)  # [B, H, N]
    s = state.to(cdt) * decay + (dt[..., None] * xf)[..., None] * b[:, :, None, :]
    y = (s @ c[..., None]).squeeze(-1) + xf * D.to(cdt)[:, None]
    return y.to(x.dtype), s


def _gate_and_norm(y: torch.Tensor, gate: torch.Tensor, weights: Mamba2Weights,
                   spec: Mamba2Spec) -> torch.Tensor:
    """y, gate [T, I] -> the gated (grouped) norm, or y * silu(gate) without a norm."""
    if weights.norm_weight is None:
        cdt = compute_dtype(y)
        return (y.to(cdt) * F.silu(gate.to(cdt))).to(y.dtype)
    return rms_norm_gated(y, gate, weights.norm_weight, spec.norm_eps,
                          group_size=spec.intermediate_size // spec.n_groups,
                          norm_before_gate=spec.norm_before_gate,
                          mean_square=weights.norm_mean_square)


def _split_xbc(xbc: torch.Tensor, spec: Mamba2Spec):
    """xBC [T, conv_dim] -> x [T, H, P], B [T, G, N], C [T, G, N]."""
    group_dim = spec.n_groups * spec.d_state
    x, B, C = xbc.split([spec.intermediate_size, group_dim, group_dim], dim=-1)
    return (x.unflatten(-1, (spec.num_heads, spec.head_dim)),
            B.unflatten(-1, (spec.n_groups, spec.d_state)),
            C.unflatten(-1, (spec.n_groups, spec.d_state)))


def mamba2_mixer(gate: torch.Tensor, xbc: torch.Tensor, dt: torch.Tensor,
                 weights: Mamba2Weights, spec: Mamba2Spec, state: RecurrentState,
                 seq_lens: SeqLens, snapshots: Snapshots | None = None
                 ) -> tuple[torch.Tensor, RecurrentState, RecurrentState | None]:
    """The mixer between ``in_proj`` and ``out_proj`` over packed sequences (prefill /
    extend): gate [T, I], xbc [T, conv_dim], dt [T, H] (``in_proj``'s output split in that
    order), state per sequence -> (out [T, I] in xbc's dtype, the new state, the
    ``snapshots``' states or None)."""
    xbc, conv, conv_snaps = causal_conv1d(xbc, weights.conv_weight, weights.conv_bias,
                                          state.conv, seq_lens, spec.activation, snapshots)
    x, B, C = _split_xbc(xbc, spec)
    y, ssm, ssm_snaps = chunk_ssd_scan(x, dt, weights.A_log, B, C, weights.D, weights.dt_bias,
                                       state.ssm, seq_lens, spec.chunk_size, spec.dt_limit,
                                       snapshots)
    snaps = None if snapshots is None else RecurrentState(conv_snaps, ssm_snaps)
    return _gate_and_norm(y.flatten(1), gate, weights, spec), RecurrentState(conv, ssm), snaps


def mamba2_mixer_step(gate: torch.Tensor, xbc: torch.Tensor, dt: torch.Tensor,
                      weights: Mamba2Weights, spec: Mamba2Spec, state: RecurrentState
                      ) -> tuple[torch.Tensor, RecurrentState]:
    """``mamba2_mixer`` for one decode token per sequence (gate [B, I], xbc [B, conv_dim],
    dt [B, H])."""
    xbc, conv = causal_conv1d_step(xbc, weights.conv_weight, weights.conv_bias, state.conv,
                                   spec.activation)
    x, B, C = _split_xbc(xbc, spec)
    y, ssm = ssd_step(x, dt, weights.A_log, B, C, weights.D, weights.dt_bias, state.ssm,
                      spec.dt_limit)
    return _gate_and_norm(y.flatten(1), gate, weights, spec), RecurrentState(conv, ssm)


def mamba2_mixer_step_in_place(gate: torch.Tensor, xbc: torch.Tensor, dt: torch.Tensor,
                               weights: Mamba2Weights, spec: Mamba2Spec, conv: torch.Tensor,
                               ssm: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """``mamba2_mixer_step`` with the states stepped where they lie: ``conv``
    [S, conv_dim, K - 1] and ``ssm`` [S, H, P, N] float32, a layer's tensors of the state
    pool, updated in place at ``slots`` [B] (``kernels/state_step``: CPU tensors its
    ``supports`` takes) -> out [B, I] in xbc's dtype."""
    xbc = state_step.conv1d_step(xbc, weights.conv_weight, weights.conv_bias, conv, slots,
                                 spec.activation)
    y = state_step.mamba2_step(xbc, dt, weights.A_log, weights.D, weights.dt_bias, ssm, slots,
                               spec.dt_limit)  # [B, H, P]
    return _gate_and_norm(y.flatten(1), gate, weights, spec)
