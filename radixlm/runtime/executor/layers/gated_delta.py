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
the DeltaNet paper: each chunk's triangular system inverted, batched over all chunks; the
pass over chunks, sequential, carries the state only);
``recurrent_gated_delta_rule_step`` (decode) is the line above. Both compute in float32,
or in float64 when given float64 (the tests' oracle precision). transformers'
``torch_chunk_gated_delta_rule`` / ``torch_recurrent_gated_delta_rule`` are the reference.
``rms_norm_gated`` also serves Mamba2 (``layers/mamba2.py``); the short causal convolution
before the rule is ``layers/short_conv.py``.
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
    xf, gate_f = x.to(cdt), gate.to(cdt)
    silu_gate = F.silu(gate_f, inplace=gate_f is not gate)  # in place on our own copy only
    if not norm_before_gate:
        xf = xf * silu_gate
    groups = xf.unflatten(-1, (-1, group_size or x.shape[-1]))  # [..., G, D / G]
    squares = (groups.pow(2).mean(-1, keepdim=True) if mean_square is None
               else mean_square(groups.pow(2).sum(-1, keepdim=True)))
    out = (groups * torch.rsqrt(squares + eps)).flatten(-2)  # a fresh tensor: the rest in place
    out.mul_(weight.to(cdt))
    if norm_before_gate:
        out.mul_(silu_gate)
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
    unpadded: bool  # every sequence whole chunks: ``rows`` is 0 .. T - 1

    @classmethod
    def build(cls, seq_lens: SeqLens, chunk_size: int, device: torch.device) -> ChunkLayout:
        lens = seq_lens_tensor(seq_lens, device)
        num_chunks = (lens + chunk_size - 1) // chunk_size
        first_chunk = torch.cumsum(num_chunks, 0) - num_chunks
        seq_of_token = torch.repeat_interleave(torch.arange(lens.numel(), device=device), lens)
        pos = torch.arange(int(lens.sum()), device=device) - (torch.cumsum(lens, 0) - lens)[
            seq_of_token]
        rows = first_chunk[seq_of_token] * chunk_size + pos
        return cls(chunk_size, lens, rows, first_chunk, num_chunks, int(num_chunks.sum()),
                   bool((lens % chunk_size == 0).all()))

    def pad(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, ...] -> [total_chunks, chunk_size, ...], zeros in the padding (a view of x,
        when it can be, if there is no padding: read it, do not write it)."""
        if self.unpadded:
            return x.reshape(self.total_chunks, self.chunk_size, *x.shape[1:])
        out = x.new_zeros(self.total_chunks * self.chunk_size, *x.shape[1:])
        out[self.rows] = x
        return out.view(self.total_chunks, self.chunk_size, *x.shape[1:])

    def unpad(self, y: torch.Tensor) -> torch.Tensor:
        """y [total_chunks, chunk_size, ...] -> [T, ...] (the padding rows dropped; a view of
        y, when it can be, if there is none)."""
        flat = y.reshape(self.total_chunks * self.chunk_size, *y.shape[2:])
        return flat if self.unpadded else flat[self.rows]

    def heads_first(self, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """x [T, H, ...] -> [total_chunks, H, chunk_size, ...], contiguous, in ``dtype``: the
        layout of batched matmuls per chunk and head (padded, converted and transposed in
        one copy when there is no padding)."""
        padded = self.pad(x).transpose(1, 2)
        return torch.empty(padded.shape, dtype=dtype, device=x.device).copy_(padded)

    def tokens_first(self, y: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """``heads_first`` undone: y [total_chunks, H, chunk_size, ...] -> [T, H, ...] in
        ``dtype``."""
        flat = y.transpose(1, 2)
        return self.unpad(torch.empty(flat.shape, dtype=dtype, device=y.device).copy_(flat))

    def locate(self, snapshots: Snapshots) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Where each snapshot falls: (the step of the pass over chunks that reaches it, its
        chunk, its row in that chunk), each [S]."""
        snapshots.check(self.lens)
        step = (snapshots.lens - 1) // self.chunk_size
        return (step, self.first_chunk[snapshots.seqs] + step,
                (snapshots.lens - 1) % self.chunk_size)

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
    length = g.shape[-1]
    # [.., s, j]: g_s where s > j, then summed over s <= i: [.., i, j] = g_{j+1} + ... + g_i
    # (0 for i <= j); one buffer, the sums and exps in place
    terms = g[..., :, None].expand(*g.shape, length).tril(-1)
    return g.cumsum(-1), terms.cumsum_(-2).exp_().tril_()


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
            self.step, self.chunk, self.row = layout.locate(snapshots)
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


def _by_key_head(per_key: torch.Tensor, per_value: torch.Tensor) -> torch.Tensor:
    """per_key [C, Hk, ...] times per_value [C, Hv, ...], value head h reading key head
    h // (Hv / Hk) -> [C, Hv, ...]: what q and k give once per key head (``q k^T``,
    ``k k^T``) reaches each of its value heads without repeating q and k first."""
    hk = per_key.shape[1]
    return (per_key.unsqueeze(2) * per_value.unflatten(1, (hk, -1))).flatten(1, 2)


def _unit_lower_inverse(m: torch.Tensor) -> torch.Tensor:
    """``(I + strict_tril(m))^-1`` for m [..., L, L] (its diagonal and upper triangle unread;
    L a power of two) by doubling: the inverse of ``[[A, 0], [C, B]]`` is ``[[A^-1, 0],
    [-B^-1 C A^-1, B^-1]]``, for every diagonal block of 2, 4, ... L rows at once. Batched
    matmuls, where a triangular solve per matrix (LAPACK's, 64 x 64) ran at a few GFLOP/s;
    the inverse then a product is what FLA and transformers compute too."""
    length = m.shape[-1]
    assert length & (length - 1) == 0, f"chunk_size {length} is not a power of two"
    m = m.reshape(-1, length, length).contiguous()
    inv = torch.zeros_like(m)
    inv.diagonal(dim1=-2, dim2=-1).fill_(1)
    size = 1
    while size < length:
        # the diagonal blocks of 2 * size rows, [n, blocks, 2 size, 2 size], as views
        shape = (m.shape[0], length // (2 * size), 2 * size, 2 * size)
        strides = (length * length, 2 * size * (length + 1), length, 1)
        blocks, lower = inv.as_strided(shape, strides), m.as_strided(shape, strides)
        a_inv, b_inv = blocks[..., :size, :size], blocks[..., size:, size:]
        blocks[..., size:, :size] = -(b_inv @ (lower[..., size:, :size] @ a_inv))
        size *= 2
    return inv


def _wy_writes(kc: torch.Tensor, vc: torch.Tensor, bc: torch.Tensor, cum: torch.Tensor,
               pair: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The WY form of a chunk's delta-rule writes: kc [C, Hk, L, Dk] (per key head), vc
    [C, Hv, L, Dv], bc, cum [C, Hv, L], pair [C, Hv, L, L] -> ``u`` [C, Hv, L, Dv] and ``w``
    [C, Hv, L, Dk], which solve ``(I + strict_tril(beta k k^T * pair)) x = beta v`` and
    ``= beta k exp(cum)``; a chunk entered with state S writes the corrected values
    ``u - w S``."""
    dv = vc.shape[-1]
    system = _by_key_head(kc @ kc.transpose(-1, -2), pair)  # [C, Hv, L, L]
    system.mul_(bc[..., None])  # its diagonal and upper triangle unread
    rhs = torch.empty(*vc.shape[:-1], dv + kc.shape[-1], dtype=vc.dtype, device=vc.device)
    torch.mul(vc, bc[..., None], out=rhs[..., :dv])
    hk = kc.shape[1]
    torch.mul(kc.unsqueeze(2), (bc * cum.exp()).unflatten(1, (hk, -1))[..., None],
              out=rhs[..., dv:].unflatten(1, (hk, -1)))
    x = _unit_lower_inverse(system).view(system.shape) @ rhs
    return x[..., :dv], x[..., dv:]


def _chunk_starts(layout: ChunkLayout, state: torch.Tensor, u: torch.Tensor, w: torch.Tensor,
                  k_out: torch.Tensor, end_decay: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """The pass over chunks, its only sequential part: state [B, H, Dk, Dv] (updated in
    place to the final states), ``u``, ``w`` (``_wy_writes``), k_out [C, H, L, Dk] (the keys
    decayed to the chunk's end), end_decay [C, H, 1, 1] -> (the state each chunk starts
    from [C, H, Dk, Dv], the corrected values each writes [C, H, L, Dv])."""
    if layout.lens.numel() == 1:
        return _one_sequence_starts(state, u, w, k_out, end_decay)
    starts = state.new_empty(layout.total_chunks, *state.shape[1:])
    v_new = torch.empty_like(u)
    for seqs, chunks in layout.steps():
        s = state[seqs]  # [n, H, Dk, Dv]
        starts[chunks] = s
        v_new[chunks] = u[chunks] - w[chunks] @ s
        state[seqs] = s * end_decay[chunks] + k_out[chunks].transpose(-1, -2) @ v_new[chunks]
    return starts, v_new


def _one_sequence_starts(state: torch.Tensor, u: torch.Tensor, w: torch.Tensor,
                         k_out: torch.Tensor, end_decay: torch.Tensor
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """``_chunk_starts`` of one sequence (a long prompt's case): each step three ops in
    place on views, each chunk's state computed where the next chunk's start is kept."""
    chunks = u.shape[0]
    starts = state.new_empty(chunks + 1, *state.shape[1:])  # the last: the final state
    starts[0] = state[0]
    v_new = torch.empty_like(u)
    for i in range(chunks):
        torch.baddbmm(u[i], w[i], starts[i], alpha=-1, out=v_new[i])  # u - w S
        torch.mul(starts[i], end_decay[i], out=starts[i + 1])
        starts[i + 1].baddbmm_(k_out[i].transpose(-1, -2), v_new[i])
    state.copy_(starts[chunks:])
    return starts[:chunks], v_new


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
    hk = q.shape[1]
    qs, ks = _prepare_qk(q, k, hk, scale, use_qk_l2norm, cdt)  # per key head
    layout = ChunkLayout.build(seq_lens, chunk_size, q.device)
    assert layout.rows.numel() == q.shape[0], (int(layout.rows.numel()), q.shape)
    # [C, H, L, D] and [C, H, L]: padding rows have k = v = beta = g = 0, so they neither
    # write the state nor decay it
    qc, kc = layout.heads_first(qs, cdt), layout.heads_first(ks, cdt)  # H = Hk
    vc, gc, bc = (layout.heads_first(t, cdt) for t in (v, g, beta))  # H = Hv
    cum, pair = chunk_decay(gc)
    u, w = _wy_writes(kc, vc, bc, cum, pair)
    k_out = _by_key_head(kc, pair[..., -1, :, None])  # writes decayed to the chunk's end
    state = initial_state.to(cdt).clone()
    starts, v_new = _chunk_starts(layout, state, u, w, k_out, cum[..., -1:, None].exp())
    # every chunk at once: the incoming state decayed to each token, then the chunk's writes
    out = torch.matmul(qc.unsqueeze(2), starts.unflatten(1, (hk, -1))).flatten(1, 2)
    out.mul_(cum.exp()[..., None])
    attn = _by_key_head(qc @ kc.transpose(-1, -2), pair)  # [C, Hv, L, L], the diagonal kept
    out.flatten(0, 1).baddbmm_(attn.flatten(0, 1), v_new.flatten(0, 1))
    snaps = None
    if snapshots is not None:
        _, chunk, row = layout.locate(snapshots)
        k_snap = kc[chunk].repeat_interleave(v.shape[1] // hk, dim=1)  # per value head
        snaps = state_inside_chunk(starts[chunk], cum[chunk], pair[chunk], k_snap,
                                   v_new[chunk], torch.arange(chunk.numel()), row)
    return layout.tokens_first(out, q.dtype), state, snaps


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
