"""Bamba: Llama's pre-norm layers whose mixer is Mamba2 (``mamba_hybrid.Mamba2Layer``, state in
the state pool) except at ``attn_layer_indices``, which attend (RoPE on half of each head:
transformers fixes ``partial_rotary_factor`` at 0.5)::

    h = x + mixer(RMSNorm(x));   out = h + feed_forward(RMSNorm(h))   (a gated MLP)

Names: ``mamba`` / ``self_attn``, ``pre_ff_layernorm``, ``feed_forward``, and the final norm
``final_layernorm``.
"""

from __future__ import annotations

from torch import nn

from radixlm.radix_cache.state_pool import StateSpec
from radixlm.runtime.executor.forward_batch import ForwardBatch
from radixlm.runtime.executor.layers.norm import RMSNorm
from radixlm.runtime.executor.layers.rotary import RotaryEmbedding
from radixlm.runtime.executor.models.decoder import MLP, DecoderForCausalLM, DecoderSpec
from radixlm.runtime.executor.models.mamba_hybrid import (
    KVAttention,
    Mamba2Layer,
    mamba2_spec_of,
    mamba2_state_specs,
)
from radixlm.runtime.model_config import LINEAR, ModelConfig


class BambaDecoderLayer(nn.Module):
    """A Mamba2 or attention mixer, then the gated MLP (module doc)."""

    def __init__(self, config: ModelConfig, spec: DecoderSpec, layer_id: int) -> None:
        super().__init__()
        hf, hidden, eps = config.hf_config, config.hidden_size, config.rms_norm_eps
        self.input_layernorm = RMSNorm(hidden, eps)
        self.pre_ff_layernorm = RMSNorm(hidden, eps)
        self.is_mamba = config.layer_types[layer_id] == LINEAR
        if self.is_mamba:
            self.mamba = Mamba2Layer(hidden, mamba2_spec_of(config), layer_id,
                                     hf.get("mamba_d_conv", 4),
                                     bool(hf.get("mamba_conv_bias", True)),
                                     bool(hf.get("mamba_proj_bias", False)))
        else:
            self.self_attn = KVAttention(config, spec, layer_id)
        self.feed_forward = MLP(config, spec)

    def forward(self, x, residual, fb: ForwardBatch, rotary: RotaryEmbedding | None,
                last_rows: bool = False):
        """``(out, residual)`` as ``DecoderLayer``; ``last_rows``: of only the rows of
        ``fb.logits_indices`` (the mixer still runs every row: K/V and state)."""
        b = fb.attention_backend
        if residual is None:
            residual, x = x, self.input_layernorm(x, backend=b)
        else:
            x, residual = self.input_layernorm(x, residual, backend=b)
        if self.is_mamba:
            x = self.mamba(x, fb)
            if last_rows:
                x = x[fb.logits_indices]
        else:
            x = self.self_attn(x, fb, rotary, last_rows)
        if last_rows:
            residual = residual[fb.logits_indices]
            if not x.shape[0]:
                return x, residual
        x, residual = self.pre_ff_layernorm(x, residual, backend=b)
        return self.feed_forward(x, b), residual


class BambaForCausalLM(DecoderForCausalLM):
    layer_class = BambaDecoderLayer

    @classmethod
    def spec_for(cls, config: ModelConfig) -> DecoderSpec:
        return DecoderSpec(activation=config.hf_config.get("hidden_act", "silu"))

    # its Mamba2 layers write ``StateIndices.saves`` (snapshots inside an extend)
    inner_state_snapshots = True

    def state_specs(self) -> dict[int, StateSpec]:
        return mamba2_state_specs(self.model.layers, "mamba")

    def canonical_checkpoint_name(self, name: str) -> str | None:
        """Its final norm is ``final_layernorm``."""
        if name.startswith("model.final_layernorm."):
            return "model.norm." + name[len("model.final_layernorm."):]
        return name
