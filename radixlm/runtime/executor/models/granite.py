"""Granite (3.x dense): Llama with four multipliers from config.json:
``embedding_multiplier`` on the embeddings, ``attention_multiplier`` as the score scale,
``residual_multiplier`` on the attention and MLP outputs before each residual add, and
``logits_scaling`` dividing the logits."""

from __future__ import annotations

from dataclasses import replace

from radixlm.runtime.executor.models.decoder import DecoderSpec
from radixlm.runtime.executor.models.llama import LlamaForCausalLM
from radixlm.runtime.model_config import ModelConfig


class GraniteForCausalLM(LlamaForCausalLM):
    @classmethod
    def spec_for(cls, config: ModelConfig) -> DecoderSpec:
        hf = config.hf_config
        return replace(super().spec_for(config),
                       embed_scale=float(hf.get("embedding_multiplier", 1.0)),
                       sm_scale=float(hf.get("attention_multiplier", config.sm_scale)),
                       residual_multiplier=float(hf.get("residual_multiplier", 1.0)),
                       logits_scaling=float(hf.get("logits_scaling", 1.0)))
