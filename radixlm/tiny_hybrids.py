"""Tiny random checkpoints of the hybrid families (linear-attention layers beside attention),
written by transformers' own config and model classes as ``tiny_families.py`` writes the
others, plus the built-in tokenizer.

Qwen3-Next (dense: ``num_experts`` 0) and Qwen3.5 (``Qwen3_5TextConfig``, whose causal LM is
``Qwen3_5ForCausalLM``): hidden 64, four layers with an attention layer second and a linear
one last (``layer_types``), 2 key heads serving 4 value heads in the linear layers (so
Qwen3-Next's tensors grouped by key head are exercised), a conv of 4 taps, partial RoPE
(a quarter of head_dim 16). ``qwen3_5mm``: the same language model inside a Qwen3.5
vision-language checkpoint, as Qwen3.5 is released.

The Mamba2 hybrids (``MAMBA2_HYBRIDS``): hidden 64, Mamba2 mixers of 8 heads of 16 in 2
groups with a state of 16 and chunks of 32 (so prompts span several), attention of 4 heads
(2 KV) of 16. Nemotron-H: the five blocks ``M * - M E`` (Mamba2, attention, relu^2 MLP,
Mamba2, MoE of 4 relu^2 experts, 2 a token, in 2 groups, plus a shared expert). Granite 4
hybrid: ``mamba attention mamba mamba`` with Granite's multipliers, RoPE, 4 experts and the
shared MLP. Falcon-H1: three layers of attention beside Mamba2, every muP multiplier set. Bamba:
``mamba attention mamba mamba`` (RoPE on half of each head) and a gated MLP.

Jamba (``MAMBA1_HYBRIDS``): the same sizes, ``mamba attention mamba mamba`` with Mamba (v1)
mixers of 128 channels and a state of 16, attention without RoPE, and 4 experts (2 a token,
not renormalized) in layers 1 and 3, a gated MLP in the others.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tokenizers import Tokenizer

from radixlm.tiny_families import _redraw
from radixlm.tiny_model import VOCAB_SIZE, train_tokenizer, write_tokenizer

if TYPE_CHECKING:
    import torch
    import transformers

logger = logging.getLogger(__name__)

LAYER_TYPES = ["linear_attention", "full_attention", "linear_attention", "linear_attention"]
_SIZE = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4,
         "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
         "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 16,
         "linear_value_head_dim": 16, "linear_conv_kernel_dim": 4,
         "layer_types": LAYER_TYPES, "max_position_embeddings": 4096, "rms_norm_eps": 1e-5,
         "bos_token_id": 0, "eos_token_id": 0, "pad_token_id": 0,
         "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                             "partial_rotary_factor": 0.25}}

# arch -> (transformers config class, what is special about it)
GATED_DELTA_HYBRIDS: dict[str, tuple[str, dict[str, Any]]] = {
    "qwen3_next": ("Qwen3NextConfig", {"num_experts": 0}),
    "qwen3_5": ("Qwen3_5TextConfig", {}),
    # 4 experts, 2 a token, a shared expert of 48; Qwen3-Next's layer 2 dense
    # (mlp_only_layers), its weights not renormalized (norm_topk_prob false)
    "qwen3_next_moe": ("Qwen3NextConfig", {
        "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 48, "mlp_only_layers": [2],
        "norm_topk_prob": False}),
    "qwen3_5_moe": ("Qwen3_5MoeTextConfig", {
        "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 48}),
    # as Qwen3.5 is released: a vision-language model (a one-block vision tower) whose
    # language model is served
    "qwen3_5mm": ("Qwen3_5Config", {"vision_config": {
        "depth": 1, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2,
        "out_hidden_size": 64, "num_position_embeddings": 16, "patch_size": 14}}),
}
_MAMBA2_SIZE = {"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
                "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 4096,
                "bos_token_id": 0, "eos_token_id": 0, "pad_token_id": 0}
# arch -> (config class, its fields besides _MAMBA2_SIZE)
MAMBA2_HYBRIDS: dict[str, tuple[str, dict[str, Any]]] = {
    "nemotron_h": ("NemotronHConfig", {
        "layers_block_type": ["linear_attention", "full_attention", "mlp", "linear_attention",
                              "moe"],
        "mamba_num_heads": 8, "mamba_head_dim": 16, "n_groups": 2, "ssm_state_size": 16,
        "chunk_size": 32, "layer_norm_epsilon": 1e-5, "n_routed_experts": 4,
        "num_experts_per_tok": 2, "n_group": 2, "topk_group": 1, "moe_intermediate_size": 32,
        "moe_shared_expert_intermediate_size": 48, "routed_scaling_factor": 1.5}),
    # Granite's multipliers (as tiny_families' granite), RoPE on, 4 experts of 32, 2 a
    # token, a shared MLP of 48
    "granitemoehybrid": ("GraniteMoeHybridConfig", {
        "layer_types": ["mamba", "attention", "mamba", "mamba"], "num_hidden_layers": 4,
        "mamba_n_heads": 8, "mamba_d_head": 16, "mamba_n_groups": 2, "mamba_d_state": 16,
        "mamba_chunk_size": 32, "rms_norm_eps": 1e-5, "intermediate_size": 32,
        "num_local_experts": 4, "num_experts_per_tok": 2, "shared_intermediate_size": 48,
        "position_embedding_type": "rope", "embedding_multiplier": 2.0,
        "attention_multiplier": 0.2, "residual_multiplier": 0.5, "logits_scaling": 2.0}),
    # every muP multiplier away from 1, the mixer's gated norm on (normed before the gate)
    "falcon_h1": ("FalconH1Config", {
        "num_hidden_layers": 3, "mamba_d_ssm": 128, "mamba_n_heads": 8, "mamba_d_head": 16,
        "mamba_n_groups": 2, "mamba_d_state": 16, "mamba_chunk_size": 32, "rms_norm_eps": 1e-5,
        "mamba_rms_norm": True, "mamba_norm_before_gate": True, "embedding_multiplier": 2.0,
        "lm_head_multiplier": 0.5, "key_multiplier": 0.5, "attention_in_multiplier": 0.8,
        "attention_out_multiplier": 0.9, "ssm_in_multiplier": 1.2, "ssm_out_multiplier": 0.7,
        "ssm_multipliers": [1.1, 0.9, 1.2, 0.8, 1.3], "mlp_multipliers": [1.5, 0.6]}),
    "bamba": ("BambaConfig", {
        "num_hidden_layers": 4, "attn_layer_indices": [1], "mamba_n_heads": 8,
        "mamba_d_head": 16, "mamba_n_groups": 2, "mamba_d_state": 16, "mamba_chunk_size": 32,
        "rms_norm_eps": 1e-5}),
}
# arch -> (config class, its fields besides _MAMBA2_SIZE); dt_rank auto: hidden / 16
MAMBA1_HYBRIDS: dict[str, tuple[str, dict[str, Any]]] = {
    "jamba": ("JambaConfig", {
        "num_hidden_layers": 4, "attn_layer_period": 4, "attn_layer_offset": 1,
        "expert_layer_period": 2, "expert_layer_offset": 1, "num_experts": 4,
        "num_experts_per_tok": 2, "mamba_d_state": 16, "mamba_d_conv": 4, "mamba_expand": 2,
        "rms_norm_eps": 1e-5}),
}
HYBRIDS = {**GATED_DELTA_HYBRIDS, **MAMBA2_HYBRIDS, **MAMBA1_HYBRIDS}


def hybrid_config(arch: str, vocab_size: int) -> transformers.PretrainedConfig:
    """The transformers config of the tiny ``arch`` checkpoint."""
    import torch
    import transformers

    if arch not in HYBRIDS:
        raise ValueError(f"arch must be one of {sorted(HYBRIDS)}, got {arch!r}")
    cls_name, special = HYBRIDS[arch]
    mamba = arch in MAMBA2_HYBRIDS or arch in MAMBA1_HYBRIDS
    text = {**(_MAMBA2_SIZE if mamba else _SIZE), "vocab_size": vocab_size}
    if "vision_config" in special:  # multimodal: the sizes are the language model's
        config = getattr(transformers, cls_name)(text_config=text, **special)
    else:
        config = getattr(transformers, cls_name)(**{**text, **special})
    config.dtype = torch.float32
    return config


def make_hybrid_model(out_dir: str | Path, arch: str, seed: int = 0,
                      tokenizer: Tokenizer | None = None) -> Path:
    """Write the tiny ``arch`` checkpoint (config, safetensors, tokenizer) to ``out_dir``."""
    import torch
    import transformers

    out = Path(out_dir)
    tok = tokenizer or train_tokenizer(vocab_size=VOCAB_SIZE)
    config = hybrid_config(arch, tok.get_vocab_size())
    torch.manual_seed(seed)
    auto = (transformers.AutoModelForImageTextToText if "vision_config" in HYBRIDS[arch][1]
            else transformers.AutoModelForCausalLM)
    model = auto.from_config(config, dtype=torch.float32)
    _redraw(model, seed)
    _spread_routers(model)
    model.save_pretrained(out)
    write_tokenizer(out, VOCAB_SIZE, tok)
    logger.info("wrote a tiny %s model (%s) to %s", arch, type(model).__name__, out)
    return out


def _spread_routers(model: torch.nn.Module) -> None:
    """Nemotron-H's, Granite's and Jamba's routers drawn wide, as ``_redraw`` draws the others:
    scores far apart, so no near-tie picks other experts at other precisions."""
    import torch

    hidden = model.config.get_text_config().hidden_size
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("mixer.gate.weight", "block_sparse_moe.router.weight",
                              "feed_forward.router.weight")):
                p.mul_(2.0 / hidden**0.5 / p.std())
