"""Mistral: Llama with a sliding window on every layer (``sliding_window`` in config.json):
a token attends to the ``sliding_window`` positions ending at its own. The window is each
layer's ``ModelConfig.layer_window``; the context is the model's whole
``max_position_embeddings``, not the window. Ministral is Mistral whose ``layer_types``
say which layers slide."""

from __future__ import annotations

from radixlm.runtime.executor.models.llama import LlamaForCausalLM


class MistralForCausalLM(LlamaForCausalLM):
    pass


class MinistralForCausalLM(MistralForCausalLM):
    pass
