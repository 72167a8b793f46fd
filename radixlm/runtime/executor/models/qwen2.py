"""Qwen2: Llama with a bias on the q/k/v projections (and usually tied embeddings).

Both differences come from ``ModelConfig`` (``qkv_bias`` is always set for Qwen2,
``tie_word_embeddings`` is read from the checkpoint), so the Llama code serves as is.
"""

from __future__ import annotations

from radixlm.runtime.executor.models.llama import LlamaForCausalLM
from radixlm.runtime.model_config import ModelConfig


class Qwen2ForCausalLM(LlamaForCausalLM):
    def __init__(self, config: ModelConfig) -> None:
        assert config.qkv_bias, "Qwen2 has a q/k/v bias; ModelConfig.from_hf sets it"
        super().__init__(config)
