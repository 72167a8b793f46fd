"""gpt-oss: a pre-norm decoder whose every MLP is a mixture of experts, with

- attention sinks: a learned logit per head in every softmax, with no value
  (``self_attn.sinks``; ``layers/attention.py``);
- sliding and full layers alternating (``layer_types``, sliding first), yarn RoPE, q/k/v/o
  biases;
- a router with a bias whose top-k logits are softmaxed (``topk_softmax``);
- experts with biases, gate and up interleaved, and a clamped SwiGLU
  (``(clamp(up, -l, l) + 1) * g * sigmoid(alpha * g)``, ``g = min(gate, l)``;
  ``swiglu_alpha`` 1.702, ``swiglu_limit`` 7.0; ``layers/activation.py``).

Checkpoints stack the experts: ``mlp.experts.gate_up_proj`` [E, H, 2I] and ``down_proj``
[E, I, H] (in, out: the transpose of our [E, out, in] parameters), ``*_bias``, and
``mlp.router.weight`` / ``bias``; the released MXFP4 checkpoints hold ``gate_up_proj`` and
``down_proj`` as ``*_blocks`` / ``*_scales`` in our layout, dequantized at load
(``mxfp4.py``). Interleaving keeps a tensor-parallel rank's gate/up pairs one contiguous
range of the checkpoint's columns.
"""

from __future__ import annotations

from radixlm.runtime.distributed.layers import Placement, Shard
from radixlm.runtime.executor.layers.moe import MoESpec, SparseMoeBlock, num_experts_of
from radixlm.runtime.executor.models.decoder import DecoderForCausalLM, DecoderSpec
from radixlm.runtime.model_config import ModelConfig


class GptOssMoeBlock(SparseMoeBlock):
    """The sparse MLP, placed from gpt-oss's stacked checkpoint tensors (bf16)."""

    mxfp4 = False  # a class per format: specs compare equal (weight updates check them)

    def checkpoint_layout(self, prefix: str) -> dict[str, Placement]:
        rows = self.shard  # this rank's intermediate rows of every expert
        pairs = (2 * rows.start, 2 * rows.stop, 2 * rows.full)  # interleaved gate/up
        ex = f"{prefix}.experts"
        out = {f"{prefix}.router.weight": Placement(f"{prefix}.gate.weight"),
               f"{prefix}.router.bias": Placement(f"{prefix}.gate.bias"),
               f"{ex}.gate_up_proj_bias": Placement(f"{ex}.gate_up_proj_bias", None,
                                                    Shard(1, *pairs)),
               f"{ex}.down_proj_bias": Placement(f"{ex}.down_proj_bias")}
        if self.mxfp4:  # [E, 2I, H] and [E, H, I], as ours
            out[f"{ex}.gate_up_proj_blocks"] = Placement(f"{ex}.gate_up_proj", None,
                                                         Shard(1, *pairs))
            out[f"{ex}.down_proj_blocks"] = Placement(f"{ex}.down_proj", None,
                                                      Shard(2, rows.start, rows.stop, rows.full))
        else:  # [E, H, 2I] and [E, I, H]
            out[f"{ex}.gate_up_proj"] = Placement(f"{ex}.gate_up_proj", None, Shard(2, *pairs),
                                                  transposed=True)
            out[f"{ex}.down_proj"] = Placement(f"{ex}.down_proj", None,
                                               Shard(1, rows.start, rows.stop, rows.full),
                                               transposed=True)
        return out


class GptOssMxfp4MoeBlock(GptOssMoeBlock):
    """The sparse MLP of an MXFP4 checkpoint (experts dequantized at load)."""

    mxfp4 = True


def is_mxfp4(hf: dict) -> bool:
    """Whether config.json's ``quantization_config`` says MXFP4 experts; ValueError naming
    the field for any other quantization."""
    quant = hf.get("quantization_config")
    if not quant:
        return False
    method = quant.get("quant_method") if isinstance(quant, dict) else None
    if method != "mxfp4":
        raise ValueError(f"quantization_config.quant_method {method!r} in config.json is not "
                         "supported for gpt-oss (supported: 'mxfp4', dequantized at load)")
    return True


class GptOssForCausalLM(DecoderForCausalLM):
    @classmethod
    def spec_for(cls, config: ModelConfig) -> DecoderSpec:
        hf = config.hf_config
        moe = MoESpec(num_experts=num_experts_of(hf), top_k=hf["num_experts_per_tok"],
                      intermediate_size=config.intermediate_size, scoring="topk_softmax",
                      router_bias=True, activation="gpt_oss_swiglu",
                      activation_params=(("alpha", float(hf.get("swiglu_alpha", 1.702))),
                                         ("limit", float(hf.get("swiglu_limit", 7.0)))),
                      expert_bias=True)
        return DecoderSpec(moe=moe, attn_sinks=True,
                           moe_block=GptOssMxfp4MoeBlock if is_mxfp4(hf) else GptOssMoeBlock)
