"""Granite 4 hybrid (``GraniteMoeHybridForCausalLM``): Granite's multipliers over pre-norm
layers whose mixer is Mamba2 or attention (``layer_types``: ``mamba`` / ``attention`` as
released, ``linear_attention`` / ``full_attention`` as transformers 5 writes them)::

    h = x + residual_multiplier * mixer(RMSNorm(x))
    out = h + residual_multiplier * (experts(n) + shared_mlp(n)),  n = RMSNorm(h)

The experts (``num_local_experts`` > 0; none in the dense checkpoints) route as Mixtral's
routers do but softmax over the top k logits only; the shared MLP is a gated MLP of
``shared_intermediate_size`` every token takes. Embeddings times ``embedding_multiplier``,
scores times ``attention_multiplier`` (the softmax scale), logits over ``logits_scaling``;
RoPE only when ``position_embedding_type`` is ``rope`` (the released checkpoints have none).
The Mamba2 layers are ``mamba_hybrid.Mamba2Layer`` (state in the state pool).

Checkpoints hold the experts stacked: ``block_sparse_moe.input_linear`` [E, 2I, H] (gate
then up), ``output_linear`` [E, H, I], the router as ``router.layer``.
"""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import nn

from radixlm.radix_cache.state_pool import StateSpec
from radixlm.runtime.distributed.layers import (
    ColumnParallelLinear,
    Placement,
    Placements,
    RowParallelLinear,
    Shard,
    section_shards,
    split_rows,
)
from radixlm.runtime.distributed.parallel_state import get_tp_group
from radixlm.runtime.executor.forward_batch import ForwardBatch
from radixlm.runtime.executor.layers.activation import act_and_mul
from radixlm.runtime.executor.layers.moe import MoESpec, SparseMoeBlock
from radixlm.runtime.executor.layers.norm import RMSNorm
from radixlm.runtime.executor.layers.rotary import RotaryEmbedding
from radixlm.runtime.executor.models.decoder import DecoderForCausalLM, DecoderSpec
from radixlm.runtime.executor.models.mamba_hybrid import (
    KVAttention,
    Mamba2Layer,
    mamba2_spec_of,
    mamba2_state_specs,
)
from radixlm.runtime.model_config import LINEAR, ModelConfig


class SharedMLP(nn.Module):
    """A gated MLP every token takes: ``input_linear`` gives gate then up (a rank reads its
    rows of each)."""

    def __init__(self, hidden: int, inter: int, activation: str) -> None:
        super().__init__()
        tp = get_tp_group()
        split_rows(inter, tp, "shared_intermediate_size")
        self.input_linear = ColumnParallelLinear(
            hidden, {"input_linear": section_shards([inter, inter], tp)}, False)
        self.output_linear = RowParallelLinear(inter, hidden, False)
        self.act_and_mul = act_and_mul(activation)

    def forward(self, x: torch.Tensor, backend: str | None = None) -> torch.Tensor:
        return self.output_linear(self.act_and_mul(self.input_linear(x), backend=backend))


class StackedMoeBlock(SparseMoeBlock):
    """``layers/moe.py``'s experts filled from Granite's stacked checkpoint tensors (under
    tensor parallelism: this rank's rows of every expert's gate and up, columns of down)."""

    def checkpoint_layout(self, prefix: str) -> dict[str, Placement | Placements]:
        gate_up, down = f"{prefix}.experts.gate_up_proj", f"{prefix}.experts.down_proj"
        layout: dict[str, Placement | Placements] = {
            f"{prefix}.router.layer.weight": Placement(f"{prefix}.gate.weight"),
            f"{prefix}.input_linear.weight": Placement(gate_up),
            f"{prefix}.output_linear.weight": Placement(down)}
        if self.tp.size > 1:  # input_linear [E, 2I, H]: gate's rows, then up's
            rows = self.shard
            layout[f"{prefix}.input_linear.weight"] = Placements(
                Placement(gate_up, (slice(None), slice(i * rows.size, (i + 1) * rows.size)),
                          Shard(1, i * rows.full + rows.start, i * rows.full + rows.stop,
                                2 * rows.full)) for i in (0, 1))
            layout[f"{prefix}.output_linear.weight"] = Placement(
                down, None, Shard(2, rows.start, rows.stop, rows.full))
        return layout


class GraniteMoeHybridDecoderLayer(nn.Module):
    """A Mamba2 or attention mixer, then experts plus the shared MLP (module doc)."""

    def __init__(self, config: ModelConfig, spec: DecoderSpec, layer_id: int) -> None:
        super().__init__()
        hf, hidden, eps = config.hf_config, config.hidden_size, config.rms_norm_eps
        self.residual_multiplier = spec.residual_multiplier or 1.0
        self.input_layernorm = RMSNorm(hidden, eps)
        self.post_attention_layernorm = RMSNorm(hidden, eps)
        self.is_mamba = config.layer_types[layer_id] == LINEAR
        if self.is_mamba:
            self.mamba = Mamba2Layer(hidden, mamba2_spec_of(config), layer_id,
                                     hf.get("mamba_d_conv", 4),
                                     bool(hf.get("mamba_conv_bias", True)),
                                     bool(hf.get("mamba_proj_bias", False)))
        else:
            self.self_attn = KVAttention(config, spec, layer_id)
        self.block_sparse_moe = (StackedMoeBlock(hidden, spec.moe, spec.activation)
                                 if spec.moe is not None else None)
        self.shared_mlp = SharedMLP(hidden, hf["shared_intermediate_size"], spec.activation)

    def forward(self, x, residual, fb: ForwardBatch, rotary: RotaryEmbedding | None,
                last_rows: bool = False):
        """``(out, residual)`` as ``DecoderLayer``; ``last_rows``: of only the rows of
        ``fb.logits_indices`` (the mixer still runs every row: K/V and state)."""
        b = fb.attention_backend
        if residual is None:
            residual, x = x, self.input_layernorm(x, backend=b)
        else:
            x, residual = self.input_layernorm(x, residual, backend=b)
        if self.is_mamba:
            x = self.mamba(x, fb)
            if last_rows:
                x = x[fb.logits_indices]
        else:
            x = self.self_attn(x, fb, rotary, last_rows)
        if last_rows:
            residual = residual[fb.logits_indices]
            if not x.shape[0]:
                return x, residual
        x, residual = self.post_attention_layernorm(x * self.residual_multiplier, residual,
                                                    backend=b)
        out = self.shared_mlp(x, b)
        if self.block_sparse_moe is not None:
            out = self.block_sparse_moe(x, b) + out
        return out * self.residual_multiplier, residual


class GraniteMoeHybridForCausalLM(DecoderForCausalLM):
    layer_class = GraniteMoeHybridDecoderLayer

    @classmethod
    def spec_for(cls, config: ModelConfig) -> DecoderSpec:
        hf = config.hf_config
        experts = hf.get("num_local_experts") or 0
        moe = (MoESpec(num_experts=experts, top_k=hf["num_experts_per_tok"],
                       intermediate_size=config.intermediate_size, scoring="topk_softmax",
                       weights_in_dtype=True, block_name="block_sparse_moe")
               if experts else None)
        rope = hf.get("position_embedding_type") == "rope"
        return replace(DecoderSpec(), activation=hf.get("hidden_act", "silu"), moe=moe,
                       embed_scale=float(hf.get("embedding_multiplier", 1.0)),
                       sm_scale=float(hf.get("attention_multiplier", config.sm_scale)),
                       residual_multiplier=float(hf.get("residual_multiplier", 1.0)),
                       logits_scaling=float(hf.get("logits_scaling", 1.0)),
                       rope_layers=None if rope else (False,) * config.num_layers)

    # its Mamba2 layers write ``StateIndices.saves`` (snapshots inside an extend)
    inner_state_snapshots = True

    def state_specs(self) -> dict[int, StateSpec]:
        return mamba2_state_specs(self.model.layers, "mamba")
