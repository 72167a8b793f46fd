"""Gated DeltaNet linear attention (Qwen3-Next, Qwen3.5): the math over packed sequences.

A linear-attention layer keeps, per sequence, a fixed-size ``RecurrentState`` instead of
K/V rows: the short convolution's last ``K - 1`` inputs (``conv``) and the delta rule's
matrix (``ssm``, float32). Every function here is pure: it takes the batch's states
(dim 0 = sequence, in the order of ``seq_lens``) and returns new ones, so a prefix split
anywhere, or a batch packed any way, gives the same numbers as one run::

    tokens  [ seq 0: 1 | seq 1: 17 ........ | seq 2: 70 ........................ ]   x [T, C]
    states  [ s0, s1, s2 ]  --causal_conv1d / chunk_gated_delta_rule-->  [ s0', s1', s2' ]

A call may also return states inside its sequences (``Snapshots``: after the first n tokens
of sequence i), for a radix cache that keeps them at page or chunk boundaries of a prompt.

The gated delta rule, per head, with ``S`` [k_dim, v_dim], l2-normalised ``q``/``k`` and
``q`` scaled by ``k_dim ** -0.5``::

    S <- exp(g_t) * S;   S <- S + k_t (beta_t * (v_t - S^T k_t))^T;   o_t = S^T q_t

``chunk_gated_delta_rule`` (prefill) computes it 64 tokens at a time (the WY / UT form of
the DeltaNet paper: one triangular solve per chunk, a sequential pass over chunks only);
``recurrent_gated_delta_rule_step`` (decode) is the line above. Both compute in float32,
or in float64 when given float64 (the tests' oracle precision). transformers'
``torch_chunk_gated_delta_rule`` / ``torch_recurrent_gated_delta_rule`` are the reference.
``causal_conv1d`` and ``rms_norm_gated`` also serve Mamba2 (``layers/mamba2.py``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

SeqLens = Sequence[int] | torch.Tensor


@dataclass
class RecurrentState:
    """One layer's state for a batch of sequences (dim 0 = sequence).

    ``conv``: [B, conv_dim, K - 1], the conv's last ``K - 1`` inputs, oldest first, in the
    activations' dtype (zeros for a fresh sequence; transformers keeps ``K`` columns, the
    oldest of which no output reads). ``ssm``: float32 (float64 in the oracle tests),
    [B, heads, k_dim, v_dim] for the gated delta rule, [B, heads, head_dim, d_state] for
    Mamba2."""

    conv: torch.Tensor
    ssm: torch.Tensor

    @classmethod
    def zeros(cls, batch: int, conv_dim: int, kernel_size: int, ssm_shape: Sequence[int],
              conv_dtype: torch.dtype, device: torch.device | str = "cpu",
              ssm_dtype: torch.dtype = torch.float32) -> RecurrentState:
        """The state of ``batch`` fresh sequences; ``ssm_shape`` is one sequence's."""
        return cls(torch.zeros(batch, conv_dim, kernel_size - 1, dtype=conv_dtype, device=device),
                   torch.zeros(batch, *ssm_shape, dtype=ssm_dtype, device=device))


@dataclass(frozen=True)
class Snapshots:
    """States wanted inside a packed call besides the final ones: the state after the first
    ``lens[j]`` tokens (1 .. that sequence's length in this call) of sequence ``seqs[j]``.
    A radix cache keeps such states at page or chunk boundaries of a prompt; the chunked
    functions compute them from the chunk's start state at little cost."""

    seqs: torch.Tensor  # [S] int64: index into the call's sequences
    lens: torch.Tensor  # [S] int64: tokens of that sequence before the snapshot

    @classmethod
    def of(cls, pairs: Sequence[tuple[int, int]], device: torch.device | str = "cpu"
           ) -> Snapshots:
        """From ``(sequence index, tokens)`` pairs."""
        t = torch.tensor(list(pairs), dtype=torch.int64, device=device).reshape(-1, 2)
        return cls(t[:, 0], t[:, 1])

    def check(self, lens: torch.Tensor) -> None:
        assert bool(((self.lens >= 1) & (self.lens <= lens[self.seqs])).all()), (
            f"snapshots {self.lens.tolist()} outside sequences {lens[self.seqs].tolist()}")


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """float32, or float64 for float64 inputs (the oracle tests run everything in float64)."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def seq_lens_tensor(seq_lens: SeqLens, device: torch.device) -> torch.Tensor:
    """``seq_lens`` as int64 [B] on ``device``."""
    return torch.as_tensor(seq_lens, dtype=torch.int64, device=device).reshape(-1)


def _activation(out: torch.Tensor, activation: str | None) -> torch.Tensor:
    if activation is None:
        return out
    if activation in ("silu", "swish"):
        return F.silu(out)
    raise ValueError(f"unsupported conv activation {activation!r}; supported: silu, None")


# ----------------------------------------------------------------------------- short conv


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
    ext[token_row] = x.to(cdt)
    w = weight.to(cdt)
    out = torch.zeros(tokens, channels, dtype=cdt, device=x.device) if bias is None else (
        bias.to(cdt).expand(tokens, channels).clone())
    for j in range(width + 1):
        out += w[:, j] * ext[token_row - width + j]
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


# ----------------------------------------------------------------------------- norms, gates


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """``x / sqrt(sum(x^2) + eps)`` over the last dim (FLA's and transformers' form)."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def gated_delta_gates(a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor,
                      dt_bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The per-token decay and write strength from the ``in_proj_ba`` projections:
    a, b [..., Hv], A_log, dt_bias [Hv] -> (g = -exp(A_log) * softplus(a + dt_bias) <= 0,
    beta = sigmoid(b)), both in the compute dtype (float32 for bf16 inputs: exp of a bf16
    A_log would round the decay)."""
    cdt = compute_dtype(a)
    g = -A_log.to(cdt).exp() * F.softplus(a.to(cdt) + dt_bias.to(cdt))
    return g, torch.sigmoid(b.to(cdt))


def rms_norm_gated(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float,
                   group_size: int | None = None, norm_before_gate: bool = True,
                   mean_square: Callable[[torch.Tensor], torch.Tensor] | None = None
                   ) -> torch.Tensor:
    """RMSNorm with a SiLU gate: x, gate [..., D], weight [D] -> [..., D] in x's dtype.

    ``norm_before_gate`` (Qwen3-Next's ``Qwen3NextRMSNormGated``, per head):
    ``norm(x) * w * silu(gate)``; otherwise (Mamba2's ``MambaRMSNormGated``: Nemotron-H,
    Bamba, Granite 4; Falcon-H1 by its config) ``norm(x * silu(gate)) * w``. ``group_size``:
    the RMS is taken over groups of that many channels (Mamba2: ``D / n_groups``), else
    over all D. Computed in float32, rounded once. ``mean_square``: a group spread over
    tensor-parallel ranks (Mamba2 with fewer groups than ranks): this rank's sums of squares
    [..., G, 1] -> the whole groups' mean squares."""
    cdt = compute_dtype(x)
    xf, silu_gate = x.to(cdt), F.silu(gate.to(cdt))
    if not norm_before_gate:
        xf = xf * silu_gate
    groups = xf.unflatten(-1, (-1, group_size or x.shape[-1]))  # [..., G, D / G]
    squares = (groups.pow(2).mean(-1, keepdim=True) if mean_square is None
               else mean_square(groups.pow(2).sum(-1, keepdim=True)))
    groups = groups * torch.rsqrt(squares + eps)
    out = groups.flatten(-2) * weight.to(cdt)
    if norm_before_gate:
        out = out * silu_gate
    return out.to(x.dtype)


# ----------------------------------------------------------------------------- chunk layout


@dataclass(frozen=True)
class ChunkLayout:
    """Packed sequences cut into chunks of ``chunk_size`` tokens, each sequence padded with
    zero rows to whole chunks, so the work inside chunks runs over all of them at once and
    only the pass over chunks is sequential (in step ``i``, chunk ``i`` of every sequence
    that has one). An empty sequence has no chunk: its state passes through."""

    chunk_size: int
    lens: torch.Tensor  # [B]: tokens per sequence
    rows: torch.Tensor  # [T]: each token's row in the padded [total_chunks * chunk_size]
    first_chunk: torch.Tensor  # [B]: each sequence's first chunk
    num_chunks: torch.Tensor  # [B]: chunks per sequence, ceil(len / chunk_size)
    total_chunks: int

    @classmethod
    def build(cls, seq_lens: SeqLens, chunk_size: int, device: torch.device) -> ChunkLayout:
        lens = seq_lens_tensor(seq_lens, device)
        num_chunks = (lens + chunk_size - 1) // chunk_size
        first_chunk = torch.cumsum(num_chunks, 0) - num_chunks
        seq_of_token = torch.repeat_interleave(torch.arange(lens.numel(), device=device), lens)
        pos = torch.arange(int(lens.sum()), device=device) - (torch.cumsum(lens, 0) - lens)[
            seq_of_token]
        rows = first_chunk[seq_of_token] * chunk_size + pos
        return cls(chunk_size, lens, rows, first_chunk, num_chunks, int(num_chunks.sum()))

    def pad(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, ...] -> [total_chunks, chunk_size, ...], zeros in the padding."""
        out = x.new_zeros(self.total_chunks * self.chunk_size, *x.shape[1:])
        out[self.rows] = x
        return out.view(self.total_chunks, self.chunk_size, *x.shape[1:])

    def unpad(self, y: torch.Tensor) -> torch.Tensor:
        """y [total_chunks, chunk_size, ...] -> [T, ...] (the padding rows dropped)."""
        return y.reshape(self.total_chunks * self.chunk_size, *y.shape[2:])[self.rows]

    def steps(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per step ``i`` of the pass over chunks: (the sequences with a chunk ``i``,
        those chunks' indices)."""
        out = []
        for i in range(int(self.num_chunks.max()) if self.num_chunks.numel() else 0):
            seqs = torch.nonzero(self.num_chunks > i).flatten()
            out.append((seqs, self.first_chunk[seqs] + i))
        return out


def chunk_decay(g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """g [chunks, H, L] (log decays, <= 0) -> (cum [chunks, H, L], the cumulative log decay
    from the chunk's start; pair [chunks, H, L, L], the decay from token j to token i,
    exp(g_{j+1} + ... + g_i) for j <= i, 0 above the diagonal).

    ``pair`` sums each segment of ``g`` itself (a cumulative sum down the rows of ``g``
    masked to s > j, as Mamba2's ``segsum``) rather than take ``cum_i - cum_j``: over a
    chunk ``cum`` reaches hundreds (|g| up to 6 a token in the tiny Qwen3.5), and the
    difference of two such float32 sums loses their rounding, 1e-5 of a decay near 1,
    which made the float32 chunked rule 10x less exact than the token-by-token one."""
    cum = g.cumsum(-1)
    length = g.shape[-1]
    causal = torch.ones(length, length, dtype=torch.bool, device=g.device).tril()
    # [.., s, j]: g_s where s > j, then summed over s <= i: [.., i, j] = g_{j+1} + ... + g_i
    terms = torch.where(causal.tril(-1), g[..., :, None], 0.0)
    return cum, torch.where(causal, terms.cumsum(-2), float("-inf")).exp()


def state_inside_chunk(start: torch.Tensor, cum: torch.Tensor, pair: torch.Tensor,
                       left: torch.Tensor, right: torch.Tensor, chunk: torch.Tensor,
                       row: torch.Tensor) -> torch.Tensor:
    """The state after row ``row`` of chunk ``chunk`` of a scan whose state update over a
    chunk is ``S_end = exp(cum_last) S_start + sum_s exp(cum_last - cum_s) left_s^T right_s``
    (the gated delta rule: left = k, right = the corrected values; Mamba2: left = dt * x,
    right = B): the same sum stopped at ``row``. start [S, H, A, B'] (the chunk's start
    states), cum [chunks, H, L], pair [chunks, H, L, L] (``chunk_decay``), left
    [chunks, H, L, A], right [chunks, H, L, B'], chunk, row [S] -> [S, H, A, B']."""
    weights = pair[chunk, :, row]  # [S, H, L]: exp(cum_row - cum_s) for s <= row, else 0
    decay = cum[chunk, :, row].exp()[..., None, None]  # [S, H, 1, 1]
    return decay * start + (left[chunk] * weights[..., None]).transpose(-1, -2) @ right[chunk]


class ChunkStarts:
    """Snapshots inside a chunked scan: the pass over chunks records the start state of each
    chunk that holds one (``record``), then ``states_inside`` finishes them with
    ``state_inside_chunk``. Without snapshots both do nothing."""

    def __init__(self, layout: ChunkLayout, snapshots: Snapshots | None,
                 state: torch.Tensor) -> None:
        self.snapshots = snapshots
        if snapshots is not None:
            snapshots.check(layout.lens)
            # the step of the pass that reaches each snapshot, its chunk, its row there
            self.step = (snapshots.lens - 1) // layout.chunk_size
            self.chunk = layout.first_chunk[snapshots.seqs] + self.step
            self.row = (snapshots.lens - 1) % layout.chunk_size
            self.starts = state.new_empty(snapshots.seqs.numel(), *state.shape[1:])

    def record(self, step: int, state: torch.Tensor) -> torch.Tensor:
        """Before step ``step`` updates ``state`` [B, ...]; returns ``state``."""
        if self.snapshots is not None:
            hit = torch.nonzero(self.step == step).flatten()
            self.starts[hit] = state[self.snapshots.seqs[hit]]
        return state

    def states_inside(self, cum: torch.Tensor, pair: torch.Tensor, left: torch.Tensor,
                      right: torch.Tensor) -> torch.Tensor | None:
        if self.snapshots is None:
            return None
        return state_inside_chunk(self.starts, cum, pair, left, right, self.chunk, self.row)


# ----------------------------------------------------------------------------- delta rule


def _prepare_qk(q: torch.Tensor, k: torch.Tensor, num_v_heads: int, scale: float | None,
                use_qk_l2norm: bool, cdt: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """q, k [..., Hk, Dk] -> [..., Hv, Dk] in cdt: each q/k head serves Hv / Hk consecutive
    value heads; l2-normalised when asked (in float32, as FLA), q times ``scale``."""
    q, k = q.to(cdt), k.to(cdt)
    if use_qk_l2norm:
        q, k = l2norm(q), l2norm(k)
    repeat = num_v_heads // q.shape[-2]
    if repeat > 1:
        q, k = q.repeat_interleave(repeat, dim=-2), k.repeat_interleave(repeat, dim=-2)
    return q * (q.shape[-1] ** -0.5 if scale is None else scale), k


def _wy_writes(kc: torch.Tensor, vc: torch.Tensor, bc: torch.Tensor, cum: torch.Tensor,
               pair: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The WY form of a chunk's delta-rule writes: ``u`` and ``w`` [chunks, H, L, Dv / Dk]
    solve ``(I + strict_tril(beta k k^T * pair)) x = beta v`` and ``= beta k exp(cum)``; a
    chunk entered with state S writes the corrected values ``u - w S``."""
    k_beta = kc * bc[..., None]
    system = ((k_beta @ kc.transpose(-1, -2)) * pair).tril(-1)
    system = system + torch.eye(system.shape[-1], dtype=system.dtype, device=system.device)
    u = torch.linalg.solve_triangular(system, vc * bc[..., None], upper=False,
                                      unitriangular=True)
    w = torch.linalg.solve_triangular(system, k_beta * cum.exp()[..., None], upper=False,
                                      unitriangular=True)
    return u, w


def chunk_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                           beta: torch.Tensor, initial_state: torch.Tensor, seq_lens: SeqLens,
                           scale: float | None = None, use_qk_l2norm: bool = True,
                           chunk_size: int = 64, snapshots: Snapshots | None = None
                           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The gated delta rule over packed sequences (prefill / extend), ``chunk_size`` tokens
    at a time.

    q, k [T, Hk, Dk]; v [T, Hv, Dv] (Hv a multiple of Hk); g, beta [T, Hv] (``g`` the log
    decay, <= 0; see ``gated_delta_gates``); initial_state [B, Hv, Dk, Dv] (zeros for a fresh
    sequence); ``scale`` defaults to Dk ** -0.5 -> (out [T, Hv, Dv] in q's dtype, final state
    [B, Hv, Dk, Dv] and the ``snapshots``' states [S, Hv, Dk, Dv] or None, in the compute
    dtype). Token by token equal (to rounding) to ``recurrent_gated_delta_rule_step``;
    ``use_qk_l2norm`` as the model's kernel flag."""
    cdt = compute_dtype(q)
    qs, ks = _prepare_qk(q, k, v.shape[1], scale, use_qk_l2norm, cdt)
    layout = ChunkLayout.build(seq_lens, chunk_size, q.device)
    assert layout.rows.numel() == q.shape[0], (int(layout.rows.numel()), q.shape)
    # [chunks, H, L, D] and [chunks, H, L]: padding rows have k = v = beta = g = 0, so they
    # neither write the state nor decay it
    qc, kc, vc = (layout.pad(t).transpose(1, 2) for t in (qs, ks, v.to(cdt)))
    gc, bc = (layout.pad(t.to(cdt)).transpose(1, 2) for t in (g, beta))
    cum, pair = chunk_decay(gc)
    u, w = _wy_writes(kc, vc, bc, cum, pair)
    attn = (qc @ kc.transpose(-1, -2)) * pair  # [chunks, H, L, L], the diagonal kept
    q_in = qc * cum.exp()[..., None]  # reads the incoming state decayed to each token
    k_out = kc * pair[..., -1, :, None]  # writes decayed to the chunk's end
    end_decay = cum[..., -1].exp()[..., None, None]  # [chunks, H, 1, 1]
    state = initial_state.to(cdt).clone()
    starts = ChunkStarts(layout, snapshots, state)
    v_new = torch.empty_like(vc)  # the corrected values each chunk writes
    out = torch.empty_like(vc)
    for i, (seqs, chunks) in enumerate(layout.steps()):
        s = starts.record(i, state)[seqs]  # [n, H, Dk, Dv]
        v_new[chunks] = u[chunks] - w[chunks] @ s
        out[chunks] = q_in[chunks] @ s + attn[chunks] @ v_new[chunks]
        state[seqs] = s * end_decay[chunks] + k_out[chunks].transpose(-1, -2) @ v_new[chunks]
    return (layout.unpad(out.transpose(1, 2)).to(q.dtype), state,
            starts.states_inside(cum, pair, kc, v_new))


def recurrent_gated_delta_rule_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                    g: torch.Tensor, beta: torch.Tensor, state: torch.Tensor,
                                    scale: float | None = None, use_qk_l2norm: bool = True
                                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """One decode token per sequence: q, k [B, Hk, Dk], v [B, Hv, Dv], g, beta [B, Hv],
    state [B, Hv, Dk, Dv] -> (out [B, Hv, Dv] in q's dtype, new state in the compute dtype).
    transformers' ``torch_recurrent_gated_delta_rule`` at one token."""
    cdt = compute_dtype(q)
    qs, ks = _prepare_qk(q, k, v.shape[1], scale, use_qk_l2norm, cdt)
    s = state.to(cdt) * g.to(cdt).exp()[..., None, None]  # [B, Hv, Dk, Dv]
    predicted = (ks[..., None, :] @ s).squeeze(-2)  # [B, Hv, Dv]: what the state recalls for k
    delta = (v.to(cdt) - predicted) * beta.to(cdt)[..., None]
    s = s + ks[..., :, None] * delta[..., None, :]
    return (qs[..., None, :] @ s).squeeze(-2).to(q.dtype), s
