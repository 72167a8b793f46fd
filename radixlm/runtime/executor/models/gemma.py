"""Gemma, Gemma 2 and Gemma 3 (text).

Gemma (1) is Llama with ``(1 + w)`` RMSNorms, a GELU-tanh gated MLP (its checkpoints'
legacy ``hidden_act: gelu`` means the tanh approximation, as transformers reads it),
embeddings scaled by sqrt(hidden) and tied embeddings.

Gemma 2 and 3 add the sandwich norm layout,

    x + norm(attn(norm(x))),  then  x + norm(mlp(norm(x)))

GELU-tanh gated MLP, embeddings scaled by sqrt(hidden) (rounded to the dtype), scores
scaled by ``query_pre_attn_scalar ** -0.5``, tied embeddings, and interleaved sliding
layers (``layer_types``: Gemma 2 alternates, Gemma 3 has five local layers per global one).

Gemma 2 soft-caps the attention scores (``attn_logit_softcapping``) and the final logits
(``final_logit_softcapping``). Gemma 3 drops the caps (honoured when its config sets them),
adds per-head ``(1 + w)`` q/k norms, and gives its sliding layers a RoPE of their own
(``rope_local_base_freq`` / ``rope_parameters["sliding_attention"]``).
"""

from __future__ import annotations

from radixlm.runtime.executor.models.decoder import DecoderForCausalLM, DecoderSpec
from radixlm.runtime.model_config import ModelConfig


def _activation(hf: dict) -> str:
    name = hf.get("hidden_activation") or hf.get("hidden_act") or "gelu_pytorch_tanh"
    return "gelu_pytorch_tanh" if name == "gelu" else name  # transformers' reading too


def gemma_spec(config: ModelConfig, qk_norm: str | None) -> DecoderSpec:
    hf = config.hf_config
    return DecoderSpec(
        norms="sandwich",
        norm_offset=1.0,
        qk_norm=qk_norm,
        activation=_activation(hf),
        embed_scale=config.hidden_size**0.5,
        sm_scale=hf.get("query_pre_attn_scalar", config.head_dim) ** -0.5,
        attn_logit_cap=hf.get("attn_logit_softcapping"),
        final_logit_cap=hf.get("final_logit_softcapping"),
    )


class GemmaForCausalLM(DecoderForCausalLM):
    @classmethod
    def spec_for(cls, config: ModelConfig) -> DecoderSpec:
        return DecoderSpec(norm_offset=1.0, activation=_activation(config.hf_config),
                           embed_scale=config.hidden_size**0.5)


class Gemma2ForCausalLM(DecoderForCausalLM):
    @classmethod
    def spec_for(cls, config: ModelConfig) -> DecoderSpec:
        return gemma_spec(config, qk_norm=None)


class Gemma3ForCausalLM(DecoderForCausalLM):
    @classmethod
    def spec_for(cls, config: ModelConfig) -> DecoderSpec:
        return gemma_spec(config, qk_norm="head")


class Gemma3ForConditionalGeneration(Gemma3ForCausalLM):
    """The language model of a multimodal Gemma 3 checkpoint (gemma-3-4b/12b/27b), served
    text-only: config.json's ``text_config`` (``ModelConfig``), the tensors under
    ``language_model.`` (or transformers 5's ``model.language_model.``); the vision tower and
    the projector are not loaded."""

    _PREFIXES = (("language_model.model.", "model."), ("model.language_model.", "model."),
                 ("language_model.lm_head.", "lm_head."), ("lm_head.", "lm_head."))
    _VISION = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.",
               "model.multi_modal_projector.")

    def canonical_checkpoint_name(self, name: str) -> str | None:
        if name.startswith(self._VISION):
            return None
        for prefix, ours in self._PREFIXES:
            if name.startswith(prefix):
                return ours + name[len(prefix):]
        return name  # not a language-model tensor: load_weights reports it as unexpected
