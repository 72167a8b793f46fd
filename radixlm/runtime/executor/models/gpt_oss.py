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
``down_proj`` as ``*_blocks`` / ``*_scales`` in our layout (``mxfp4.py``). Interleaving keeps
a tensor-parallel rank's gate/up pairs one contiguous range of the checkpoint's columns. A
GGUF file (``runtime/gguf_families.py``) holds gate and up apart, stacked ``[E, I, H]`` as
ours (``mlp.experts.gate_proj`` / ``up_proj``, and ``down_proj`` [E, H, I], ``*_bias``):
they are put back in alternate rows.

MXFP4 experts from either source stay quantized on one CPU rank where the kernel library
is built (``executor/quant/loader.py``: exact int8 codes times powers of two, packed as w6,
0.8 bytes a weight; gate and up interleaved row by row, so the activation is the same);
elsewhere they are dequantized at load to the model dtype.
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
    """The sparse MLP of an MXFP4 checkpoint (experts quantized on a CPU, else
    dequantized at load)."""

    mxfp4 = True


class GptOssGGUFMoeBlock(SparseMoeBlock):
    """The sparse MLP of a GGUF file: gate and up stacked apart, placed in alternate rows of
    ``gate_up_proj`` (quantized rows interleaved, float ones copied: ``executor/quant``)."""

    def checkpoint_layout(self, prefix: str) -> dict[str, Placement]:
        rows = self.shard
        cols = Shard(1, rows.start, rows.stop, rows.full)  # [E, I, ...]: this rank's I
        ex = f"{prefix}.experts"
        gate, up = (slice(None), slice(0, None, 2)), (slice(None), slice(1, None, 2))
        return {f"{prefix}.router.weight": Placement(f"{prefix}.gate.weight"),
                f"{prefix}.router.bias": Placement(f"{prefix}.gate.bias"),
                f"{ex}.gate_proj": Placement(f"{ex}.gate_up_proj", gate, cols),
                f"{ex}.up_proj": Placement(f"{ex}.gate_up_proj", up, cols),
                f"{ex}.gate_proj_bias": Placement(f"{ex}.gate_up_proj_bias", gate, cols),
                f"{ex}.up_proj_bias": Placement(f"{ex}.gate_up_proj_bias", up, cols),
                f"{ex}.down_proj": Placement(f"{ex}.down_proj", None,
                                             Shard(2, rows.start, rows.stop, rows.full)),
                f"{ex}.down_proj_bias": Placement(f"{ex}.down_proj_bias")}


# config.json's quantization_config.quant_method -> the MoE block that reads its layout
_QUANT_BLOCKS = {"mxfp4": GptOssMxfp4MoeBlock, "gguf": GptOssGGUFMoeBlock}


def moe_block_of(hf: dict) -> type[SparseMoeBlock]:
    """The MoE block for config.json's ``quantization_config`` (none, MXFP4 or a GGUF
    file's view); ValueError naming the field for any other quantization."""
    quant = hf.get("quantization_config")
    if not quant:
        return GptOssMoeBlock
    method = quant.get("quant_method") if isinstance(quant, dict) else None
    block = _QUANT_BLOCKS.get(method) if isinstance(method, str) else None
    if block is None:
        raise ValueError(f"quantization_config.quant_method {method!r} in config.json is not "
                         "supported for gpt-oss (supported: 'mxfp4' and a GGUF file's "
                         "view)")
    return block


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
        return DecoderSpec(moe=moe, attn_sinks=True, moe_block=moe_block_of(hf))
