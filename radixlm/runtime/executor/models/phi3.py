"""Phi-3 (and Phi-4-mini, which has Phi-3's architecture): Llama whose checkpoints keep
q/k/v as one ``qkv_proj`` tensor and gate/up as one ``gate_up_proj``, a sliding window on
every layer when config.json sets one, ``longrope`` RoPE scaling (short factors up to
``original_max_position_embeddings``, long ones past it: see ``layers/rotary.py``) and
partial rotary (Phi-4-mini rotates 3/4 of each head).

The fused checkpoint tensor fills the fused parameter part by part: under tensor
parallelism each rank reads its own q, k and v (gate and up) rows out of it.
"""

from __future__ import annotations

from radixlm.runtime.distributed.layers import ColumnParallelLinear, Placement, Shard
from radixlm.runtime.executor.models.llama import LlamaForCausalLM


class Phi3ForCausalLM(LlamaForCausalLM):
    def checkpoint_layout(self) -> dict[str, Placement | tuple[Placement, ...]]:
        """Llama's layout, with each fused projection's parts read from one checkpoint
        tensor (named like the parameter) at their offsets in it."""
        layout: dict[str, Placement | tuple[Placement, ...]] = dict(super().checkpoint_layout())
        for prefix, module in self.named_modules():
            if not isinstance(module, ColumnParallelLinear) or len(module.parts) < 2:
                continue
            module_path = prefix.rpartition(".")[0]
            full = sum(shard.full for shard in module.parts.values())
            places, offset = [], 0
            for part, shard in module.parts.items():
                place = layout.pop(f"{module_path}.{part}.weight")
                places.append(Placement(place.param, place.rows,
                                        Shard(0, offset + shard.start, offset + shard.stop, full)))
                offset += shard.full
            layout[f"{prefix}.weight"] = tuple(places)
        return layout
