"""Jamba: Bamba's layers (pre-norm, ``input_layernorm`` / ``pre_ff_layernorm``, the mixer then
``feed_forward``) whose mixer is Mamba (v1) except where ``i % attn_layer_period ==
attn_layer_offset``, which attends without RoPE; the feed-forward is a mixture of experts
where ``i % expert_layer_period == expert_layer_offset`` (softmax over the experts, the k
largest, not renormalized), a gated MLP elsewhere.

The Mamba mixer (``Mamba1Layer``, transformers' ``JambaMambaMixer``), its state in the
state pool (conv [I, K - 1] and ssm [I, N] per sequence)::

    x, z = in_proj(h)                                    [T, I] each
    x = silu(causal_conv1d(x))                           (with the conv state)
    dt, B, C = x_proj(x)                                 [T, R], [T, N], [T, N]
    dt, B, C = rms_norm(dt), rms_norm(B), rms_norm(C)    (Jamba's own norms)
    y = selective_scan(x, dt_proj(dt), A, B, C, D)       (layers/mamba1.py, with the state)
    out = out_proj(y * silu(z))

An extend continues each sequence from its slot's state and writes the radix cache's
snapshots inside it (``StateIndices.saves``), as ``mamba_hybrid.Mamba2Layer`` does; a decode
steps each sequence once. Checkpoints name the router ``feed_forward.router`` (here
``feed_forward.gate``) and the final norm ``final_layernorm``.

Under tensor parallelism each rank holds ``1 / tp_size`` of the mixer's channels (as vLLM
and SGLang split it): its rows of ``in_proj``'s x and z, of the conv, ``dt_proj``, ``A_log``
and ``D``, and its columns of ``x_proj`` (row-parallel: dt, B and C all-reduced, then whole
on every rank with their norms) and ``out_proj``; its state is of its channels.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from radixlm.radix_cache.state_pool import StateSpec
from radixlm.runtime.distributed.layers import (
    ColumnParallelLinear,
    Placement,
    RowParallelLinear,
    section_shards,
)
from radixlm.runtime.distributed.parallel_state import get_tp_group
from radixlm.runtime.executor.forward_batch import ForwardBatch, StateIndices
from radixlm.runtime.executor.layers.gated_delta import (
    compute_dtype,
)
from radixlm.runtime.executor.layers.mamba1 import selective_scan, selective_scan_step
from radixlm.runtime.executor.layers.moe import MoESpec, SparseMoeBlock, num_experts_of
from radixlm.runtime.executor.layers.norm import RMSNorm
from radixlm.runtime.executor.layers.short_conv import causal_conv1d, causal_conv1d_step
from radixlm.runtime.executor.models.bamba import BambaDecoderLayer, BambaForCausalLM
from radixlm.runtime.executor.models.decoder import MLP, DecoderSpec
from radixlm.runtime.executor.models.mamba_hybrid import KVAttention
from radixlm.runtime.model_config import LINEAR, ModelConfig


class Mamba1Layer(nn.Module):
    """Jamba's Mamba mixer over packed sequences, its conv and SSM states in the state pool
    (slot of ``fb.state``, layer ``layer_id``). Parameter names are transformers';
    ``inter``: this rank's channels (module doc)."""

    def __init__(self, config: ModelConfig, layer_id: int) -> None:
        super().__init__()
        tp = get_tp_group()
        hf, hidden, eps = config.hf_config, config.hidden_size, config.rms_norm_eps
        inter = int(hf.get("mamba_expand", 2) * hidden)
        if inter % tp.size:
            raise ValueError(f"JambaForCausalLM: the Mamba mixer's {inter} channels "
                             f"(mamba_expand * hidden_size) are not divisible by tp_size "
                             f"({tp.size})")
        self.layer_id, self.inter = layer_id, inter // tp.size  # this rank's channels
        self.shard = section_shards([inter], tp)[0]
        self.d_state = n = hf.get("mamba_d_state", 16)
        rank = hf.get("mamba_dt_rank", "auto")
        self.dt_rank = r = -(-hidden // 16) if rank == "auto" else int(rank)
        self.kernel = k = hf.get("mamba_d_conv", 4)
        self.activation = hf.get("hidden_act", "silu")
        proj_bias = bool(hf.get("mamba_proj_bias", False))
        # x | z: this rank's channels of each
        self.in_proj = ColumnParallelLinear(
            hidden, {"in_proj": section_shards([inter, inter], tp)}, proj_bias)
        self.conv1d = nn.Conv1d(self.inter, self.inter, k, groups=self.inter, padding=k - 1,
                                bias=bool(hf.get("mamba_conv_bias", True)))
        self.x_proj = RowParallelLinear(inter, r + 2 * n, False)  # dt | B | C, all-reduced
        self.dt_proj = ColumnParallelLinear(r, {"dt_proj": self.shard}, True)
        self.A_log = nn.Parameter(torch.zeros(self.inter, n))
        self.D = nn.Parameter(torch.ones(self.inter))
        self.out_proj = RowParallelLinear(inter, hidden, proj_bias)
        self.dt_layernorm = RMSNorm(r, eps)
        self.b_layernorm = RMSNorm(n, eps)
        self.c_layernorm = RMSNorm(n, eps)

    def checkpoint_layout(self, prefix: str) -> dict[str, Placement]:
        """This rank's channels of the conv, ``A_log`` and ``D``; the norms whole (the
        projections say their own)."""
        layout = {f"{prefix}.{name}.weight": Placement(f"{prefix}.{name}.weight")
                  for name in ("dt_layernorm", "b_layernorm", "c_layernorm")}
        for name in ("conv1d.weight", "conv1d.bias", "A_log", "D"):
            if name != "conv1d.bias" or self.conv1d.bias is not None:
                layout[f"{prefix}.{name}"] = Placement(f"{prefix}.{name}", None, self.shard)
        return layout

    def state_spec(self) -> StateSpec:
        return StateSpec(self.inter, self.kernel - 1, (self.inter, self.d_state))

    def forward(self, h: torch.Tensor, fb: ForwardBatch) -> torch.Tensor:
        """[T, hidden] -> [T, hidden]; reads and writes the sequences' states."""
        st = fb.state
        assert st is not None, "a Mamba layer needs ForwardBatch.state"
        x, z = self.in_proj(h).chunk(2, dim=-1)  # [T, I] each
        y = self._scan(x, st, fb.mode.is_decode, fb.attention_backend)
        cdt = compute_dtype(y)
        return self.out_proj((y.to(cdt) * F.silu(z.to(cdt))).to(h.dtype))

    def _scan(self, x: torch.Tensor, st: StateIndices, decode: bool,
              backend: str | None) -> torch.Tensor:
        """The conv and the selective scan from the sequences' states, the new states (and
        the radix cache's snapshots inside the sequences) written back -> y [T, I]."""
        conv_state, ssm_state = st.pool.read(self.layer_id, st.slots, st.fresh)
        weight, bias = self.conv1d.weight[:, 0], self.conv1d.bias
        if decode:
            x, conv = causal_conv1d_step(x, weight, bias, conv_state, self.activation)
        else:
            x, conv, conv_snaps = causal_conv1d(x, weight, bias, conv_state, st.seq_lens,
                                                self.activation, st.saves)
        dt, B, C = self.x_proj(x).split([self.dt_rank, self.d_state, self.d_state], dim=-1)
        dt = self.dt_proj.matmul(self.dt_layernorm(dt, backend=backend))  # its bias: below
        B, C = self.b_layernorm(B, backend=backend), self.c_layernorm(C, backend=backend)
        args = (self.A_log, B, C, self.D, self.dt_proj.bias)
        if decode:
            y, ssm = selective_scan_step(x, dt, *args, ssm_state)
        else:
            y, ssm, ssm_snaps = selective_scan(x, dt, *args, ssm_state, st.seq_lens, st.saves)
            if st.saves is not None and st.save_slots is not None:
                st.pool.write(self.layer_id, st.save_slots, conv_snaps, ssm_snaps)
        st.pool.write(self.layer_id, st.slots, conv, ssm)
        return y


class JambaDecoderLayer(BambaDecoderLayer):
    """A Mamba or attention mixer, then the experts or the gated MLP; Bamba's forward."""

    def __init__(self, config: ModelConfig, spec: DecoderSpec, layer_id: int) -> None:
        nn.Module.__init__(self)  # Bamba's layout, other mixers: none of Bamba's __init__
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = RMSNorm(hidden, eps)
        self.pre_ff_layernorm = RMSNorm(hidden, eps)
        self.is_mamba = config.layer_types[layer_id] == LINEAR
        if self.is_mamba:
            self.mamba = Mamba1Layer(config, layer_id)
        else:
            self.self_attn = KVAttention(config, spec, layer_id)
        if spec.moe is not None and spec.moe.is_sparse(layer_id):
            self.feed_forward: nn.Module = SparseMoeBlock(hidden, spec.moe, spec.activation)
        else:
            self.feed_forward = MLP(config, spec)


class JambaForCausalLM(BambaForCausalLM):
    layer_class = JambaDecoderLayer

    @classmethod
    def spec_for(cls, config: ModelConfig) -> DecoderSpec:
        hf, layers = config.hf_config, config.num_layers
        experts = num_experts_of(hf)
        moe = None
        if experts > 1:  # transformers' layers_num_experts: 1 is a dense MLP
            period, offset = hf.get("expert_layer_period", 2), hf.get("expert_layer_offset", 1)
            moe = MoESpec(num_experts=experts, top_k=hf["num_experts_per_tok"],
                          intermediate_size=config.intermediate_size, renormalize=False,
                          weights_in_dtype=True, block_name="feed_forward",
                          sparse_layers=tuple(i % period == offset for i in range(layers)))
        return DecoderSpec(activation=hf.get("hidden_act", "silu"), moe=moe,
                           rope_layers=(False,) * layers)

    # its Mamba layers write ``StateIndices.saves`` (snapshots inside an extend)
    inner_state_snapshots = True

    def state_specs(self) -> dict[int, StateSpec]:
        return {i: layer.mamba.state_spec() for i, layer in enumerate(self.model.layers)
                if layer.is_mamba}

    def canonical_checkpoint_name(self, name: str) -> str | None:
        """Bamba's final norm, and the router ``feed_forward.router`` as ``.gate``."""
        name = super().canonical_checkpoint_name(name)
        return None if name is None else name.replace(".feed_forward.router.",
                                                      ".feed_forward.gate.")
