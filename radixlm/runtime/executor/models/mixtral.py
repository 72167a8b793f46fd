"""Mixtral: Mistral whose every MLP is a mixture of ``num_local_experts`` SiLU-gated experts,
``num_experts_per_tok`` of them per token: softmax over all experts' router logits, the k
largest, renormalized to sum to 1 (``layers/moe.py``). Checkpoints name the router
``block_sparse_moe.gate`` and each expert's gate / up / down ``w1`` / ``w3`` / ``w2``."""

from __future__ import annotations

from dataclasses import replace

from radixlm.runtime.executor.layers.moe import MoESpec, num_experts_of
from radixlm.runtime.executor.models.decoder import DecoderSpec
from radixlm.runtime.executor.models.mistral import MistralForCausalLM
from radixlm.runtime.model_config import ModelConfig


class MixtralForCausalLM(MistralForCausalLM):
    @classmethod
    def spec_for(cls, config: ModelConfig) -> DecoderSpec:
        hf = config.hf_config
        moe = MoESpec(num_experts=num_experts_of(hf), top_k=hf["num_experts_per_tok"],
                      intermediate_size=config.intermediate_size, renormalize=True,
                      block_name="block_sparse_moe", expert_names=("w1", "w3", "w2"))
        return replace(super().spec_for(config), moe=moe)
