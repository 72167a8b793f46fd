"""Tiny random checkpoints of every model family radixlm serves besides the built-in
Llama / Qwen2 (``tiny_model.py``), built with transformers' own config and model classes
(``AutoModelForCausalLM.from_config`` + ``save_pretrained``), so the files are exactly
what transformers writes for that family, plus the built-in tokenizer.

Each family's config turns on what is special about it at a size a test can afford
(hidden 64, 3 layers, windows of 24 tokens): Qwen3's yarn RoPE, Gemma 2's soft-caps, Gemma
3's interleaved sliding layers with their own RoPE base, Phi-3's fused projections with longrope and
partial rotary, SmolLM3's NoPE layer, Granite's multipliers, Mixtral's and Qwen3-MoE's
experts (decisive router logits: no top-k choice is a near-tie; Qwen3-MoE's windows on
every layer), gpt-oss's attention sinks
(drawn large enough that switching them off changes the tokens), biased experts with a
SwiGLU clamp low enough to bite, alternating windows and yarn RoPE. Weights are re-drawn from one
seeded generator at the built-in models' scales (decisive logits: greedy decoding never
hinges on a near-tie), norm weights around their identity (``1`` or Gemma's ``0``).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tokenizers import Tokenizer

from radixlm.tiny_model import (
    EMBED_STD,
    LM_HEAD_STD,
    PROJ_STD,
    VOCAB_SIZE,
    train_tokenizer,
    write_tokenizer,
)

if TYPE_CHECKING:
    import torch
    import transformers

logger = logging.getLogger(__name__)

WINDOW = 24  # sliding windows: shorter than the prompts the tests send
_SIZE = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 3,
         "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
         "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "bos_token_id": 0,
         "eos_token_id": 0, "pad_token_id": 0}

# arch -> (transformers config class, what is special about it)
FAMILIES: dict[str, tuple[str, dict[str, Any]]] = {
    "qwen3": ("Qwen3Config", {"use_sliding_window": True, "sliding_window": WINDOW,
                              "max_window_layers": 1, "tie_word_embeddings": True,
                              "rope_parameters": {"rope_type": "yarn", "factor": 4.0,
                                                  "original_max_position_embeddings": 1024,
                                                  "rope_theta": 10000.0}}),
    "mistral": ("MistralConfig", {"sliding_window": WINDOW}),
    "ministral": ("MinistralConfig", {
        "sliding_window": WINDOW,
        "layer_types": ["sliding_attention", "full_attention", "sliding_attention"]}),
    "gemma": ("GemmaConfig", {}),
    "gemma2": ("Gemma2Config", {"sliding_window": WINDOW, "query_pre_attn_scalar": 32,
                                "attn_logit_softcapping": 2.0,
                                "final_logit_softcapping": 10.0}),
    "gemma3": ("Gemma3TextConfig", {
        "sliding_window": WINDOW, "query_pre_attn_scalar": 16,
        "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
        "rope_parameters": {
            "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 100000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}}),
    # a multimodal checkpoint (vision tower, projector) served as its language model
    "gemma3mm": ("Gemma3Config", {
        "mm_tokens_per_image": 4,
        "text_config": {"sliding_window": WINDOW, "query_pre_attn_scalar": 16,
                        "layer_types": ["sliding_attention", "full_attention",
                                        "sliding_attention"]},
        "vision_config": {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
                          "num_attention_heads": 2, "image_size": 28, "patch_size": 14}}),
    "phi3": ("Phi3Config", {
        "sliding_window": WINDOW, "partial_rotary_factor": 0.75, "tie_word_embeddings": False,
        "original_max_position_embeddings": 1024,
        "rope_parameters": {"rope_type": "longrope", "rope_theta": 10000.0, "factor": 4.0,
                            "partial_rotary_factor": 0.75,
                            "short_factor": [1.0, 1.1, 1.3, 1.6, 2.0, 2.5],
                            "long_factor": [1.0, 1.5, 2.5, 4.0, 6.0, 8.0]}}),
    "olmo2": ("Olmo2Config", {}),
    "olmo3": ("Olmo3Config", {"sliding_window": WINDOW,
                              "layer_types": ["sliding_attention", "sliding_attention",
                                              "full_attention"]}),
    "smollm3": ("SmolLM3Config", {"no_rope_layers": [1, 0, 1]}),
    # 8 experts, 2 per token; Qwen3-MoE's layer 1 dense (mlp_only_layers), weights not
    # renormalized (norm_topk_prob false: Mixtral covers the renormalized rule), every layer
    # sliding (transformers' Qwen3-MoE ignores max_window_layers, which by Qwen2's rule would
    # leave none sliding here)
    "mixtral": ("MixtralConfig", {"num_local_experts": 8, "num_experts_per_tok": 2,
                                  "intermediate_size": 64}),
    "qwen3_moe": ("Qwen3MoeConfig", {"num_experts": 8, "num_experts_per_tok": 2,
                                     "moe_intermediate_size": 32, "mlp_only_layers": [1],
                                     "norm_topk_prob": False, "use_sliding_window": True,
                                     "sliding_window": WINDOW, "max_window_layers": 3}),
    # hidden 128 (whole MXFP4 blocks of 32 along H and, at tp 2, along I), 4 layers
    # alternating sliding / full, 8 experts of 64, top-2
    "gpt_oss": ("GptOssConfig", {
        "hidden_size": 128, "head_dim": 32, "intermediate_size": 64, "num_hidden_layers": 4,
        "sliding_window": WINDOW, "num_local_experts": 8, "num_experts_per_tok": 2,
        "swiglu_limit": 1.5,
        "rope_parameters": {"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0,
                            "beta_slow": 1.0, "truncate": False,
                            "original_max_position_embeddings": 1024,
                            "rope_theta": 150000.0}}),
    "granite": ("GraniteConfig", {"embedding_multiplier": 2.0, "attention_multiplier": 0.2,
                                  "residual_multiplier": 0.5, "logits_scaling": 2.0}),
}


def family_config(arch: str, vocab_size: int) -> transformers.PretrainedConfig:
    """The transformers config of the tiny ``arch`` checkpoint."""
    # torch and transformers are imported where they are used: the command line imports
    # this module for FAMILIES, and a server's start should not wait seconds for them
    import torch
    import transformers

    if arch not in FAMILIES:
        raise ValueError(f"arch must be one of {sorted(FAMILIES)}, got {arch!r}")
    cls_name, special = FAMILIES[arch]
    if "text_config" in special:  # multimodal: the sizes are the language model's
        text = {**_SIZE, "vocab_size": vocab_size, **special["text_config"]}
        config = getattr(transformers, cls_name)(**{**special, "text_config": text})
    else:
        config = getattr(transformers, cls_name)(**{**_SIZE, "vocab_size": vocab_size,
                                                    **special})
    config.dtype = torch.float32
    return config


def _redraw(model: torch.nn.Module, seed: int) -> None:
    """Every parameter from one seeded generator: projections and biases at the built-in
    scales, norms near identity, a tied model's final norm shrunk as ``tiny_model`` does."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    tied = model.config.tie_word_embeddings
    # Gemma multiplies the embeddings by sqrt(hidden): draw them that much smaller, or the
    # residual stream is the input embedding and no layer's feature shows in the tokens
    hidden = model.config.get_text_config().hidden_size
    embed_std = EMBED_STD / (hidden**0.5 if _scales_embeddings(model) else 1.0)
    final_norms = ("model.norm.weight", "model.language_model.norm.weight")
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            if "norm" in name:  # Gemma's (1 + w) norms start at 0, the others at 1
                identity = 0.0 if bool((p == 0).all()) else 1.0
                target = LM_HEAD_STD / embed_std if tied and name in final_norms else 1
                p.copy_(target - 1 + 0.1 * noise if identity == 0.0 else target + 0.1 * noise)
            elif "embed_tokens" in name:
                p.copy_(noise * embed_std)
            elif name == "lm_head.weight":
                p.copy_(noise * LM_HEAD_STD)
            elif name.endswith(("mlp.gate.weight", "mlp.router.weight")):  # MoE router:
                p.copy_(noise * 2.0 / hidden**0.5)  # logits of std ~2, no near-tie in top-k
            elif name.endswith("self_attn.sinks"):  # gpt-oss: about a row's log-sum-exp
                p.copy_(3.0 + noise)
            else:  # projections (scaled by fan-in; stacked experts' too) and their biases
                fan_in = p.shape[-1] if p.dim() >= 2 else 128
                p.copy_(noise * PROJ_STD * (128 / fan_in) ** 0.5)


def _scales_embeddings(model: torch.nn.Module) -> bool:
    return model.config.model_type in ("gemma", "gemma2", "gemma3_text", "gemma3")


def make_family_model(out_dir: str | Path, arch: str, seed: int = 0,
                      tokenizer: Tokenizer | None = None) -> Path:
    """Write the tiny ``arch`` checkpoint (config, safetensors, tokenizer) to ``out_dir``.
    ``tokenizer``: the built-in tokenizer already trained (else trained here)."""
    import torch
    import transformers

    out = Path(out_dir)
    tok = tokenizer or train_tokenizer(vocab_size=VOCAB_SIZE)
    config = family_config(arch, tok.get_vocab_size())
    torch.manual_seed(seed)  # from_config's own init, before _redraw replaces it
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _redraw(model, seed)
    model.save_pretrained(out)
    write_tokenizer(out, VOCAB_SIZE, tok)  # after: its generation_config.json lists the EOS ids
    logger.info("wrote a tiny %s model (%s) to %s", arch, type(model).__name__, out)
    return out
