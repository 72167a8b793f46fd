"""SmolLM3: Llama with NoPE layers: ``no_rope_layers[i]`` is 1 where layer ``i`` applies
RoPE and 0 where it does not (by default every fourth layer has none)."""

from __future__ import annotations

from dataclasses import replace

from radixlm.runtime.executor.models.decoder import DecoderSpec
from radixlm.runtime.executor.models.llama import LlamaForCausalLM
from radixlm.runtime.model_config import ModelConfig


class SmolLM3ForCausalLM(LlamaForCausalLM):
    @classmethod
    def spec_for(cls, config: ModelConfig) -> DecoderSpec:
        hf, n = config.hf_config, config.num_layers
        flags = hf.get("no_rope_layers")
        if flags is None:
            interval = hf.get("no_rope_layer_interval", 4)
            flags = [int((i + 1) % interval != 0) for i in range(n)]
        return replace(super().spec_for(config), rope_layers=tuple(bool(f) for f in flags))
