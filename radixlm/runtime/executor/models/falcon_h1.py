"""Falcon-H1: every layer runs attention and a Mamba2 mixer side by side on the same normed
input, then a gated MLP, with muP multipliers everywhere::

    n = RMSNorm(x)
    h = x + ssm_out_multiplier * mamba(n)
          + attention_out_multiplier * attn(attention_in_multiplier * n)
    m = RMSNorm(h)
    out = h + down_multiplier * down_proj(up(m) * silu(gate_multiplier * gate(m)))

So every layer has K/V rows and a state-pool slot (``ModelConfig.is_hybrid`` by model type).
The mixer's input is scaled by ``ssm_in_multiplier`` and ``in_proj``'s output, section by
section (gate, x, B, C, dt), by ``ssm_multipliers`` (transformers' ``mup_vector``); its
gated norm is optional (``mamba_rms_norm``) and may norm before gating
(``mamba_norm_before_gate``); its width is ``mamba_d_ssm`` when given. ``key_multiplier``
scales k, i.e. the attention scores (``sm_scale``); embeddings are multiplied by
``embedding_multiplier``, logits by ``lm_head_multiplier``.
"""

from __future__ import annotations

import torch
from torch import nn

from radixlm.radix_cache.state_pool import StateSpec
from radixlm.runtime.executor.forward_batch import ForwardBatch
from radixlm.runtime.executor.layers.mamba2 import Mamba2Spec
from radixlm.runtime.executor.layers.norm import RMSNorm
from radixlm.runtime.executor.layers.rotary import RotaryEmbedding
from radixlm.runtime.executor.models.decoder import MLP, DecoderForCausalLM, DecoderSpec
from radixlm.runtime.executor.models.mamba_hybrid import (
    KVAttention,
    Mamba2Layer,
    mamba2_spec_of,
    mamba2_state_specs,
)
from radixlm.runtime.model_config import ModelConfig


def mup_vector(spec: Mamba2Spec, multipliers: list[float]) -> torch.Tensor:
    """``in_proj``'s output scale: ``multipliers`` over its gate, x, B, C and dt columns."""
    group = spec.n_groups * spec.d_state
    sizes = [spec.intermediate_size, spec.intermediate_size, group, group, spec.num_heads]
    return torch.cat([torch.full((n,), float(m)) for n, m in zip(sizes, multipliers)])


class FalconH1Mamba(Mamba2Layer):
    """The mixer with Falcon-H1's input multiplier and per-section ``in_proj`` scale."""

    def __init__(self, config: ModelConfig, layer_id: int) -> None:
        hf = config.hf_config
        spec = mamba2_spec_of(config, norm_before_gate=True)
        super().__init__(config.hidden_size, spec, layer_id, hf.get("mamba_d_conv", 4),
                         bool(hf.get("mamba_conv_bias", True)),
                         bool(hf.get("mamba_proj_bias", False)),
                         norm=bool(hf.get("mamba_rms_norm", False)))
        self.in_multiplier = float(hf.get("ssm_in_multiplier", 1.0))
        multipliers = hf.get("ssm_multipliers") or [1.0] * 5
        self.register_buffer("mup", mup_vector(self.spec, multipliers), persistent=False)

    def project(self, x: torch.Tensor) -> torch.Tensor:
        return self.in_proj(x * self.in_multiplier) * self.mup.to(x.dtype)


class FalconH1MLP(MLP):
    """The gated MLP with ``mlp_multipliers``: the gate's input and the output scaled."""

    def __init__(self, config: ModelConfig, spec: DecoderSpec) -> None:
        super().__init__(config, spec)
        self.gate_multiplier, self.down_multiplier = (
            float(m) for m in config.hf_config.get("mlp_multipliers") or (1.0, 1.0))

    def forward(self, x: torch.Tensor, backend: str | None = None) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)  # [N, 2I]: gate then up
        gate_up[..., :gate_up.shape[-1] // 2] *= self.gate_multiplier
        return self.down_proj(self.act_and_mul(gate_up, backend=backend)) * self.down_multiplier


class FalconH1DecoderLayer(nn.Module):
    """Attention and Mamba2 in parallel, then the MLP (module doc)."""

    def __init__(self, config: ModelConfig, spec: DecoderSpec, layer_id: int) -> None:
        super().__init__()
        hf, hidden, eps = config.hf_config, config.hidden_size, config.rms_norm_eps
        self.input_layernorm = RMSNorm(hidden, eps)
        self.pre_ff_layernorm = RMSNorm(hidden, eps)
        self.mamba = FalconH1Mamba(config, layer_id)
        self.self_attn = KVAttention(config, spec, layer_id)
        self.feed_forward = FalconH1MLP(config, spec)
        self.ssm_out = float(hf.get("ssm_out_multiplier", 1.0))
        self.attn_in = float(hf.get("attention_in_multiplier", 1.0))
        self.attn_out = float(hf.get("attention_out_multiplier", 1.0))

    def forward(self, x, residual, fb: ForwardBatch, rotary: RotaryEmbedding | None,
                last_rows: bool = False):
        """``(out, residual)`` as ``DecoderLayer``; ``last_rows``: of only the rows of
        ``fb.logits_indices`` (both mixers still run every row: K/V and state)."""
        b = fb.attention_backend
        if residual is None:
            residual, x = x, self.input_layernorm(x, backend=b)
        else:
            x, residual = self.input_layernorm(x, residual, backend=b)
        ssm = self.mamba(x, fb) * self.ssm_out
        attn = self.self_attn(x * self.attn_in, fb, rotary, last_rows) * self.attn_out
        if last_rows:
            ssm, residual = ssm[fb.logits_indices], residual[fb.logits_indices]
            if not attn.shape[0]:
                return attn, residual
        x, residual = self.pre_ff_layernorm(ssm + attn, residual, backend=b)
        return self.feed_forward(x, b), residual


class FalconH1ForCausalLM(DecoderForCausalLM):
    layer_class = FalconH1DecoderLayer

    @classmethod
    def spec_for(cls, config: ModelConfig) -> DecoderSpec:
        hf = config.hf_config
        return DecoderSpec(activation=hf.get("hidden_act", "silu"),
                           embed_scale=float(hf.get("embedding_multiplier", 1.0)),
                           sm_scale=config.sm_scale * float(hf.get("key_multiplier", 1.0)),
                           logits_scaling=1.0 / float(hf.get("lm_head_multiplier", 1.0)))

    # its Mamba2 layers write ``StateIndices.saves`` (snapshots inside an extend)
    inner_state_snapshots = True

    def state_specs(self) -> dict[int, StateSpec]:
        return mamba2_state_specs(self.model.layers, "mamba")

    def canonical_checkpoint_name(self, name: str) -> str | None:
        """Its final norm is ``final_layernorm``."""
        if name.startswith("model.final_layernorm."):
            return "model.norm." + name[len("model.final_layernorm."):]
        return name
