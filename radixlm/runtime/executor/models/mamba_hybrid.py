"""The Mamba2 mixer of the Mamba2 hybrids (Nemotron-H, Granite 4 hybrid, Falcon-H1, Bamba) as
a layer whose state lives in the state pool, and what those families share.

    x -> in_proj -> gate [I] | xBC [conv_dim] | dt [H]
      -> layers/mamba2.py (conv with its state, SSD scan with its state, gated norm)
      -> out_proj

An extend continues each sequence from its slot's state (zeros for a sequence with nothing
computed, ``ForwardBatch.state.fresh``) and writes the new state back, as the Gated DeltaNet
layers of ``qwen3_next.py`` do; a decode steps each sequence by one token, on a CPU in place
in the pool (``kernels/state_step``; elsewhere gathered, stepped and scattered back). The
radix cache's snapshots inside an extend (``StateIndices.saves``) come from the chunked
scan's and the conv's ``Snapshots`` and go to their own slots (``save_slots``).

Under tensor parallelism each rank holds ``1 / tp_size`` of the mixer's heads and of its
groups (as SGLang splits it): its rows of ``in_proj``'s gate, x, B, C and dt sections, its
conv channels of x, B and C, its heads' ``A_log``, ``D`` and ``dt_bias`` and its channels of
the gated norm, whose groups are then whole on one rank (the norm over a group needs no
communication); ``out_proj`` is row-parallel (one all-reduce). Its state is of its own
heads and groups (``state_spec``).
"""

from __future__ import annotations

import importlib
from dataclasses import replace
from typing import Any

import torch
from torch import nn

from radixlm.kernels import state_step
from radixlm.radix_cache.state_pool import StateSpec
from radixlm.runtime.distributed.layers import (
    ColumnParallelLinear,
    Placement,
    RowParallelLinear,
    Shard,
    section_shards,
    sliced_placement,
)
from radixlm.runtime.distributed.parallel_state import TpGroup, get_tp_group
from radixlm.runtime.executor.forward_batch import ForwardBatch, StateIndices
from radixlm.runtime.executor.layers.attention import RadixAttention
from radixlm.runtime.executor.layers.gated_delta import (
    RecurrentState,
)
from radixlm.runtime.executor.layers.mamba2 import (
    NO_DT_LIMIT,
    Mamba2Spec,
    Mamba2Weights,
    _gate_and_norm,
    _split_xbc,
    mamba2_mixer,
    mamba2_mixer_step,
    mamba2_mixer_step_in_place,
)
from radixlm.runtime.executor.layers.short_conv import (
    conv_in_pool,
)
from radixlm.runtime.executor.models.decoder import Attention, DecoderSpec
from radixlm.runtime.model_config import ModelConfig


def local_mamba2_spec(spec: Mamba2Spec, tp: TpGroup) -> Mamba2Spec:
    """The mixer of this rank: its heads, and its groups (with fewer groups than ranks, the
    one group its heads read). ValueError naming what does not split."""
    if spec.num_heads % tp.size:
        raise ValueError(f"the Mamba2 heads ({spec.num_heads}) are not divisible by tp_size "
                         f"({tp.size})")
    if spec.n_groups % tp.size and tp.size % spec.n_groups:
        raise ValueError(f"the Mamba2 groups (n_groups {spec.n_groups}) neither divide nor are "
                         f"divisible by tp_size ({tp.size})")
    return replace(spec, num_heads=spec.num_heads // tp.size,
                   n_groups=max(spec.n_groups // tp.size, 1))


def mamba2_shards(spec: Mamba2Spec, tp: TpGroup) -> tuple[tuple[Shard, ...], ...]:
    """This rank's rows of ``in_proj`` (gate | x | B | C | dt) and channels of the conv
    (x | B | C): its heads' rows of gate, x and dt, its groups' of B and C (with fewer
    groups than ranks, the one group its heads read: ranks ``r * G / tp`` share one)."""
    inter, heads, n = spec.intermediate_size, spec.num_heads, spec.d_state
    groups = spec.n_groups * n
    first = tp.rank * spec.n_groups // tp.size  # this rank's first group
    local = max(spec.n_groups // tp.size, 1) * n

    def part(offset: int, start: int, stop: int, full: int) -> Shard:
        return Shard(0, offset + start, offset + stop, full)

    mine = section_shards([inter], tp)[0]
    b = (first * n, first * n + local)
    proj_full, conv_full = 2 * inter + 2 * groups + heads, inter + 2 * groups
    head = section_shards([heads], tp)[0]
    in_proj = (part(0, mine.start, mine.stop, proj_full),
               part(inter, mine.start, mine.stop, proj_full),
               part(2 * inter, *b, proj_full), part(2 * inter + groups, *b, proj_full),
               part(2 * inter + 2 * groups, head.start, head.stop, proj_full))
    conv = (part(0, mine.start, mine.stop, conv_full), part(inter, *b, conv_full),
            part(inter + groups, *b, conv_full))
    return in_proj, conv


def json_float(value: Any) -> float:
    """A float of config.json: transformers writes infinity as ``{"__float__": "Infinity"}``."""
    if isinstance(value, dict) and "__float__" in value:
        return float(value["__float__"])
    return float(value)


def dt_limit_of(hf: dict) -> tuple[float, float]:
    """``time_step_limit`` (None or absent: no limit)."""
    limit = hf.get("time_step_limit")
    if not limit:
        return NO_DT_LIMIT
    low, high = (json_float(v) for v in limit)
    return (low, high)


def mamba2_spec_of(config: ModelConfig, norm_before_gate: bool = False) -> Mamba2Spec:
    """The mixer of the families that name it ``mamba_*`` (Bamba, Granite 4 hybrid,
    Falcon-H1): its width ``mamba_d_ssm`` or ``mamba_expand * hidden_size``, ``mamba_d_head``
    (or ``auto``: the width over the heads); ``norm_before_gate``: the default where the
    config does not say (``mamba_norm_before_gate``)."""
    hf = config.hf_config
    inter = hf.get("mamba_d_ssm") or int(hf.get("mamba_expand", 2) * config.hidden_size)
    heads = hf["mamba_n_heads"]
    head_dim = hf.get("mamba_d_head", "auto")
    head_dim = inter // heads if head_dim == "auto" else head_dim
    if heads * head_dim != inter:
        raise ValueError(f"mamba_n_heads * mamba_d_head ({heads} * {head_dim}) must be the "
                         f"mixer's width (mamba_d_ssm or mamba_expand * hidden_size: {inter})")
    return Mamba2Spec(num_heads=heads, head_dim=head_dim, n_groups=hf.get("mamba_n_groups", 1),
                      d_state=hf["mamba_d_state"], chunk_size=hf.get("mamba_chunk_size", 256),
                      dt_limit=dt_limit_of(hf), norm_eps=config.rms_norm_eps,
                      norm_before_gate=bool(hf.get("mamba_norm_before_gate", norm_before_gate)),
                      activation=hf.get("hidden_act", "silu"))


class Mamba2Layer(nn.Module):
    """A Mamba2 mixer over packed sequences, its conv and SSM states in the state pool
    (slot of ``fb.state``, layer ``layer_id``). Parameter names are transformers'.
    ``spec``: the whole mixer's; ``self.spec``: this rank's share of it (module doc)."""

    def __init__(self, hidden: int, spec: Mamba2Spec, layer_id: int, kernel: int,
                 conv_bias: bool, proj_bias: bool, norm: bool = True) -> None:
        super().__init__()
        tp = get_tp_group()
        self.spec, self.layer_id, self.kernel = local_mamba2_spec(spec, tp), layer_id, kernel
        inter, conv_dim, heads = (self.spec.intermediate_size, self.spec.conv_dim,
                                  self.spec.num_heads)
        self.sizes = [inter, conv_dim, heads]
        full_inter = spec.intermediate_size
        in_proj, self.conv_shards = mamba2_shards(spec, tp)
        self.head_shard = section_shards([spec.num_heads], tp)[0]
        self.norm_shard = section_shards([full_inter], tp)[0]
        self.in_proj = ColumnParallelLinear(hidden, {"in_proj": in_proj}, proj_bias)
        # fewer groups than ranks: a norm group spans tp_size / n_groups ranks
        self.norm_group = (tp.rank * spec.n_groups // tp.size, spec.n_groups, full_inter //
                           spec.n_groups, tp) if spec.n_groups < tp.size else None
        self.conv1d = nn.Conv1d(conv_dim, conv_dim, kernel, bias=conv_bias, groups=conv_dim,
                                padding=kernel - 1)
        self.dt_bias = nn.Parameter(torch.ones(heads))
        self.A_log = nn.Parameter(torch.zeros(heads))
        self.D = nn.Parameter(torch.ones(heads))
        if norm:  # Falcon-H1 may have none (mamba_rms_norm false)
            self.norm = nn.Module()
            self.norm.weight = nn.Parameter(torch.ones(inter))
        self.has_norm = norm
        self.out_proj = RowParallelLinear(full_inter, hidden, proj_bias)

    def checkpoint_layout(self, prefix: str) -> dict[str, Placement]:
        """This rank's conv channels, heads and norm channels (the projections say their
        own)."""
        layout = {}
        for name in ("conv1d.weight", "conv1d.bias"):
            if name == "conv1d.weight" or self.conv1d.bias is not None:
                layout[f"{prefix}.{name}"] = sliced_placement(f"{prefix}.{name}",
                                                              self.conv_shards)
        for name in ("A_log", "D", "dt_bias"):
            layout[f"{prefix}.{name}"] = Placement(f"{prefix}.{name}", None, self.head_shard)
        if self.has_norm:
            layout[f"{prefix}.norm.weight"] = Placement(f"{prefix}.norm.weight", None,
                                                        self.norm_shard)
        return layout

    def state_spec(self) -> StateSpec:
        return StateSpec(self.spec.conv_dim, self.kernel - 1, self.spec.ssm_shape)

    def _weights(self) -> Mamba2Weights:
        return Mamba2Weights(self.conv1d.weight[:, 0], self.conv1d.bias, self.dt_bias,
                             self.A_log, self.D, self.norm.weight if self.has_norm else None,
                             None if self.norm_group is None else self._group_mean_square)

    def _group_mean_square(self, sums: torch.Tensor) -> torch.Tensor:
        """This rank's sums of squares [T, 1, 1] -> its norm group's mean squares over the
        ranks that share the group: each adds its sums into its group's column of [T, G]."""
        assert self.norm_group is not None
        group, groups, size, tp = self.norm_group
        by_group = sums.new_zeros(sums.shape[0], groups)
        by_group[:, group] = sums[:, 0, 0]
        return (tp.all_reduce(by_group)[:, group] / size)[:, None, None]

    def project(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, hidden] -> gate | xBC | dt [T, I + conv_dim + H] (Falcon-H1 scales it)."""
        return self.in_proj(x)

    def forward(self, x: torch.Tensor, fb: ForwardBatch) -> torch.Tensor:
        """[T, hidden] -> [T, hidden]; reads and writes the sequences' states."""
        st = fb.state
        assert st is not None, "a Mamba2 layer needs ForwardBatch.state"
        gate, xbc, dt = self.project(x).split(self.sizes, dim=-1)
        if xbc.is_cuda and st.pool.ssm_dtype == torch.float32:
            out = self._in_pool_triton(gate, xbc, dt, st, fb.mode.is_decode)
        elif fb.mode.is_decode and self._in_place(st, xbc):
            out = mamba2_mixer_step_in_place(gate, xbc, dt, self._weights(), self.spec,
                                             st.pool.conv[self.layer_id],
                                             st.pool.ssm[self.layer_id], st.slots)
        else:
            out = self._gathered(gate, xbc, dt, st, fb.mode.is_decode)
        return self.out_proj(out)

    def _in_place(self, st: StateIndices, xbc: torch.Tensor) -> bool:
        """Whether a decode step can update the pool in place (``kernels/state_step``):
        CPU tensors the library takes, a float32 SSM pool, no fresh state to zero (asked
        last: on a GPU ``fresh.any()`` would wait for the device)."""
        pool = st.pool
        return (state_step.supports(xbc, self.conv1d.weight, pool.conv[self.layer_id])
                and pool.ssm_dtype == torch.float32
                and (st.fresh is None or not st.fresh.any()))

    def _in_pool_triton(self, gate: torch.Tensor, xbc: torch.Tensor, dt: torch.Tensor,
                        st: StateIndices, decode: bool) -> torch.Tensor:
        """CUDA tensors (prefill and decode): the conv on gathered conv states (torch), the
        scan token by token on the SSM states where they lie in the pool, fresh ones zeroed
        and the snapshots written to their slots by the kernel (``kernels/mamba2_triton``,
        imported on first use as ``radixlm.kernels`` does its Triton modules: importing it
        defines the kernel, and a CPU engine never pays) -> out [T, I]."""
        pool, layer, w, spec = st.pool, self.layer_id, self._weights(), self.spec
        xbc, snapshots = conv_in_pool(xbc, w.conv_weight, w.conv_bias, spec.activation, st,
                                      layer, decode)
        x, B, C = _split_xbc(xbc, spec)
        kernel = importlib.import_module("radixlm.kernels.mamba2_triton")
        y = kernel.fused_recurrent_ssd(
            x, dt, w.A_log, B, C, w.D, w.dt_bias, pool.ssm[layer], st.slots,
            [1] * x.shape[0] if decode else st.seq_lens, spec.dt_limit, fresh=st.fresh,
            snapshots=snapshots)
        return _gate_and_norm(y.flatten(1), gate, w, spec)

    def _gathered(self, gate: torch.Tensor, xbc: torch.Tensor, dt: torch.Tensor,
                  st: StateIndices, decode: bool) -> torch.Tensor:
        """The sequences' states gathered from the pool, stepped or run over their chunks
        (with the radix cache's snapshots inside them), and scattered back -> out [T, I]."""
        state = RecurrentState(*st.pool.read(self.layer_id, st.slots, st.fresh))
        snaps = None  # the radix cache's snapshots inside the sequences (``st.saves``)
        if decode:
            out, state = mamba2_mixer_step(gate, xbc, dt, self._weights(), self.spec, state)
        else:
            out, state, snaps = mamba2_mixer(gate, xbc, dt, self._weights(), self.spec, state,
                                             st.seq_lens, st.saves)
        st.pool.write(self.layer_id, st.slots, state.conv, state.ssm)
        if snaps is not None and st.save_slots is not None:
            st.pool.write(self.layer_id, st.save_slots, snaps.conv, snaps.ssm)
        return out


class KVAttention(Attention):
    """The decoder's attention in a hybrid: its K/V in the KV pool's layer of its rank among
    the layers that have K/V (``ModelConfig.kv_layer_index``)."""

    def __init__(self, config: ModelConfig, spec: DecoderSpec, layer_id: int) -> None:
        super().__init__(config, spec, layer_id)
        self.attn = RadixAttention(config.kv_layer_index(layer_id), self.num_heads,
                                   self.num_kv_heads, self.head_dim,
                                   spec.sm_scale or config.sm_scale, None, spec.attn_logit_cap)


def mamba2_state_specs(layers: nn.ModuleList, name: str) -> dict[int, StateSpec]:
    """Each Mamba2 layer's state of one sequence by layer id (the state pool's layout):
    the layers holding a ``Mamba2Layer`` at attribute ``name``."""
    return {i: getattr(layer, name).state_spec() for i, layer in enumerate(layers)
            if isinstance(getattr(layer, name, None), Mamba2Layer)}
