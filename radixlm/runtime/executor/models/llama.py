"""Llama: the dense decoder as ``decoder.py`` builds it by default.

    embed -> N x [RMSNorm -> attention -> RMSNorm -> SiLU-gated MLP] -> RMSNorm -> lm_head

RoPE default, linear, llama3 or yarn (``rope_scaling``); a bias on q/k/v/o with
``attention_bias``, on the MLP with ``mlp_bias``.
"""

from __future__ import annotations

from radixlm.runtime.executor.models.decoder import DecoderForCausalLM, DecoderSpec
from radixlm.runtime.model_config import ModelConfig


class LlamaForCausalLM(DecoderForCausalLM):
    @classmethod
    def spec_for(cls, config: ModelConfig) -> DecoderSpec:
        return DecoderSpec(activation=config.hf_config.get("hidden_act", "silu"))
