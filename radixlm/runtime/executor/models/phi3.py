"""Phi-3 (and Phi-4-mini, which has Phi-3's architecture): Llama whose checkpoints keep
q/k/v as one ``qkv_proj`` tensor and gate/up as one ``gate_up_proj``, a sliding window on
every layer when config.json sets one, ``longrope`` RoPE scaling (short factors up to
``original_max_position_embeddings``, long ones past it: see ``layers/rotary.py``) and
partial rotary (Phi-4-mini rotates 3/4 of each head).

The fused tensors are the parameters' own layout at ``--tp-size 1``; splitting them over
ranks (three slices of one tensor into one parameter) is not supported, and refused.
"""

from __future__ import annotations

from radixlm.runtime.distributed.layers import Placement
from radixlm.runtime.distributed.parallel_state import get_tp_group
from radixlm.runtime.executor.models.llama import LlamaForCausalLM
from radixlm.runtime.model_config import ModelConfig


class Phi3ForCausalLM(LlamaForCausalLM):
    def __init__(self, config: ModelConfig) -> None:
        if get_tp_group().size > 1:
            raise ValueError("Phi-3's fused qkv_proj / gate_up_proj checkpoint tensors cannot "
                             "be split over --tp-size > 1 yet; serve it with --tp-size 1")
        super().__init__(config)

    def checkpoint_layout(self) -> dict[str, Placement]:
        """Every parameter under its own name: qkv_proj and gate_up_proj included."""
        return {name: Placement(name) for name, _ in self.named_parameters()}
