"""OLMo 2: norms after attention and the MLP only (no input norm),

    x + norm(attn(x)),  then  x + norm(mlp(x))

and q/k RMSNorms over the whole projection (every head at once, before the reshape; under
tensor parallelism the sum of squares is all-reduced over the ranks). OLMo 3 is OLMo 2
with sliding layers (three in four) and RoPE per layer type."""

from __future__ import annotations

from dataclasses import replace

from radixlm.runtime.executor.models.decoder import DecoderSpec
from radixlm.runtime.executor.models.llama import LlamaForCausalLM
from radixlm.runtime.model_config import ModelConfig


class Olmo2ForCausalLM(LlamaForCausalLM):
    @classmethod
    def spec_for(cls, config: ModelConfig) -> DecoderSpec:
        return replace(super().spec_for(config), norms="post", qk_norm="all")


class Olmo3ForCausalLM(Olmo2ForCausalLM):
    pass
