"""Qwen3-MoE: Qwen 3 (per-head q/k norms) whose sparse layers' MLP is a mixture of
``num_experts`` experts of ``moe_intermediate_size``, ``num_experts_per_tok`` per token:
softmax over all router logits, the k largest, renormalized only when ``norm_topk_prob``,
then rounded to the model dtype (``layers/moe.py``). A layer is sparse unless it is in
``mlp_only_layers`` or ``(layer + 1) % decoder_sparse_step``; the others keep a dense MLP of
``intermediate_size``. Checkpoints: ``mlp.gate`` and ``mlp.experts.{e}.gate_proj`` /
``up_proj`` / ``down_proj``. With ``use_sliding_window`` every layer slides, as in
transformers' Qwen3-MoE, which reads no ``max_window_layers`` (``ModelConfig.layer_types``)."""

from __future__ import annotations

from dataclasses import replace

from radixlm.runtime.executor.layers.moe import MoESpec, num_experts_of
from radixlm.runtime.executor.models.decoder import DecoderSpec
from radixlm.runtime.executor.models.qwen3 import Qwen3ForCausalLM
from radixlm.runtime.model_config import ModelConfig


def sparse_layers(hf: dict, num_layers: int) -> tuple[bool, ...]:
    """Which layers have experts, as transformers' Qwen3MoeDecoderLayer decides."""
    dense, step = set(hf.get("mlp_only_layers") or ()), hf.get("decoder_sparse_step", 1)
    return tuple(i not in dense and (i + 1) % step == 0 for i in range(num_layers))


class Qwen3MoeForCausalLM(Qwen3ForCausalLM):
    @classmethod
    def spec_for(cls, config: ModelConfig) -> DecoderSpec:
        hf = config.hf_config
        spec = super().spec_for(config)
        if not num_experts_of(hf):  # no experts: the dense Qwen 3
            return spec
        moe = MoESpec(num_experts=num_experts_of(hf), top_k=hf["num_experts_per_tok"],
                      intermediate_size=hf["moe_intermediate_size"],
                      renormalize=bool(hf.get("norm_topk_prob", False)), weights_in_dtype=True,
                      sparse_layers=sparse_layers(hf, config.num_layers))
        return replace(spec, moe=moe)
