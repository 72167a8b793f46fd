"""Qwen 3 (dense): Llama with an RMSNorm over each q and k head before RoPE (``q_norm``,
``k_norm`` of size head_dim), no q/k/v bias, ``head_dim`` set apart from hidden / heads,
and sliding layers from ``max_window_layers`` on when ``use_sliding_window``."""

from __future__ import annotations

from dataclasses import replace

from radixlm.runtime.executor.models.decoder import DecoderSpec
from radixlm.runtime.executor.models.llama import LlamaForCausalLM
from radixlm.runtime.model_config import ModelConfig


class Qwen3ForCausalLM(LlamaForCausalLM):
    @classmethod
    def spec_for(cls, config: ModelConfig) -> DecoderSpec:
        return replace(super().spec_for(config), qk_norm="head")
