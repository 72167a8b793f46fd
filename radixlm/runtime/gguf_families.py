"""How each GGUF ``general.architecture`` maps onto the Hugging Face family we serve: the
names of its tensors in our checkpoint layout and the config.json its metadata describes.

``FAMILIES`` (``family_of`` picks one, Mixtral and Mistral from a llama file's tensors and
metadata) names every tensor as the checkpoint our models load would (``hf_names``):
``blk.3.attn_q.weight`` is ``model.layers.3.self_attn.q_proj.weight``, its ``TensorInfo``
carrying the logical HF shape ``(out, in)`` (GGUF lists dimensions innermost first), the GGML
type and byte range. Stacked experts (``blk.N.ffn_gate_exps.weight`` ``[E, I, H]``) appear one
per expert (``model.layers.N.mlp.experts.E.gate_proj.weight``), each its own byte range.
Two conversions of llama.cpp's ``convert_hf_to_gguf.py`` are recorded for the reader to undo:
the rows of ``attn_q`` / ``attn_k`` of RoPE-"normal" architectures (llama) are permuted per
head (``unpermute_heads``), and Gemma's norms are stored as ``1 + w`` (``norm_shift``).

gpt-oss keeps its experts stacked, one tensor per projection (``_GPT_OSS``): the converter
splits the checkpoint's interleaved ``gate_up_proj`` into ``ffn_gate_exps`` / ``ffn_up_exps``
(columns 0, 2, 4, ... and 1, 3, 5, ..., biases likewise), each ``[E, I, H]`` in MXFP4 blocks
(ggml's ``block_mxfp4``: an E8M0 scale byte, then 16 bytes whose low nibbles are elements
0-15 and high nibbles 16-31), read as ``mlp.experts.gate_proj`` etc.; the model's GGUF
layout (``models/gpt_oss.py``) interleaves them back.

``build_hf_config`` is the config.json transformers would write for the family, from the
``{arch}.*`` metadata (read with types and ranges checked: ``GGUFError`` naming the key) and
the tensors llama.cpp stores RoPE scaling in (``CONFIG_TENSORS``).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

import numpy as np
from gguf.constants import GGMLQuantizationType

from radixlm.runtime.gguf_container import GGUFError, RawTensor
from radixlm.runtime.gguf_rope import rope_scaling


@dataclass(frozen=True)
class TensorInfo:
    """One tensor under its HF checkpoint name: logical shape ``(out, in)`` (or ``(n,)``),
    GGML type, the absolute byte range of its blocks in the file, whether its rows must
    be un-permuted (``unpermute_heads``: the head count llama.cpp permuted with), and the
    constant to add to its values (``norm_shift``: -1 for Gemma's norms)."""

    name: str
    gguf_name: str
    ggml_type: int
    shape: tuple[int, ...]
    offset: int
    nbytes: int
    unpermute_heads: int | None = None
    norm_shift: float = 0.0

    @property
    def type_name(self) -> str:
        return GGMLQuantizationType(self.ggml_type).name


# GGUF block tensor -> our checkpoint name (under model.layers.N.), as llama.cpp's
# convert_hf_to_gguf.py maps them (gguf.constants.TENSOR_NAMES)
_BLOCK = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight", "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.weight": "self_attn.k_proj.weight", "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.weight": "self_attn.v_proj.weight", "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight", "attn_output.bias": "self_attn.o_proj.bias",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight", "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    "ffn_gate_inp.weight": "mlp.gate.weight",
}
_EXPERTS = {"ffn_gate_exps.weight": "mlp.experts.{e}.gate_proj.weight",
            "ffn_up_exps.weight": "mlp.experts.{e}.up_proj.weight",
            "ffn_down_exps.weight": "mlp.experts.{e}.down_proj.weight"}
# Gemma 2 / 3's sandwich norms
_SANDWICH = {"ffn_norm.weight": "pre_feedforward_layernorm.weight",
             "post_attention_norm.weight": "post_attention_layernorm.weight",
             "post_ffw_norm.weight": "post_feedforward_layernorm.weight"}
_PHI3 = {"attn_qkv.weight": "self_attn.qkv_proj.weight", "ffn_up.weight": "mlp.gate_up_proj.weight"}
_MIXTRAL = {"ffn_gate_inp.weight": "block_sparse_moe.gate.weight"}
_MIXTRAL_EXPERTS = {"ffn_gate_exps.weight": "block_sparse_moe.experts.{e}.w1.weight",
                    "ffn_up_exps.weight": "block_sparse_moe.experts.{e}.w3.weight",
                    "ffn_down_exps.weight": "block_sparse_moe.experts.{e}.w2.weight"}
# gpt-oss: post_attention_norm is the pre-MLP norm; experts stacked [E, out, in] (see above)
_GPT_OSS = {
    **{k: v for k, v in _BLOCK.items()
       if k.startswith("attn_") and k not in ("attn_q_norm.weight", "attn_k_norm.weight")},
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "attn_sinks.weight": "self_attn.sinks",
    "ffn_gate_inp.weight": "mlp.router.weight", "ffn_gate_inp.bias": "mlp.router.bias",
    **{f"ffn_{p}_exps.{kind}": f"mlp.experts.{p}_proj{suffix}"
       for p in ("gate", "up", "down") for kind, suffix in (("weight", ""), ("bias", "_bias"))},
}
_TOP = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
        "output.weight": "lm_head.weight"}
# read into the config (RoPE scaling), not loaded
CONFIG_TENSORS = ("rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight")


@dataclass(frozen=True)
class Family:
    """How one GGUF ``general.architecture`` maps onto the HF family we serve."""

    hf_arch: str
    model_type: str
    block: dict[str, str]
    experts: dict[str, str]
    permuted: bool = False  # llama.cpp permuted attn_q / attn_k rows (RoPE "normal")
    norm_shift: float = 0.0  # stored norm weights are HF's plus this
    hidden_act: str = "silu"


FAMILIES: dict[str, Family] = {
    "llama": Family("LlamaForCausalLM", "llama", _BLOCK, {}, permuted=True),
    "qwen2": Family("Qwen2ForCausalLM", "qwen2", _BLOCK, {}),
    "qwen3": Family("Qwen3ForCausalLM", "qwen3", _BLOCK, {}),
    "qwen3moe": Family("Qwen3MoeForCausalLM", "qwen3_moe", _BLOCK, _EXPERTS),
    "gemma": Family("GemmaForCausalLM", "gemma", _BLOCK, {}, norm_shift=1.0,
                    hidden_act="gelu_pytorch_tanh"),
    "gemma2": Family("Gemma2ForCausalLM", "gemma2", {**_BLOCK, **_SANDWICH}, {},
                     norm_shift=1.0, hidden_act="gelu_pytorch_tanh"),
    "gemma3": Family("Gemma3ForCausalLM", "gemma3_text", {**_BLOCK, **_SANDWICH}, {},
                     norm_shift=1.0, hidden_act="gelu_pytorch_tanh"),
    "phi3": Family("Phi3ForCausalLM", "phi3", {**_BLOCK, **_PHI3}, {}),
    "gpt-oss": Family("GptOssForCausalLM", "gpt_oss", _GPT_OSS, {}),
}
# llama with experts is Mixtral; with a sliding window (our writer's), Mistral
MIXTRAL = Family("MixtralForCausalLM", "mixtral", {**_BLOCK, **_MIXTRAL}, _MIXTRAL_EXPERTS,
                 permuted=True)
MISTRAL = Family("MistralForCausalLM", "mistral", _BLOCK, {}, permuted=True)


def family_of(meta: dict[str, Any], tensors: list[RawTensor], where: str) -> tuple[str, Family]:
    arch = meta.get("general.architecture")
    if not isinstance(arch, str):
        raise GGUFError(f"{where}: general.architecture is missing or not a string")
    if arch not in FAMILIES:
        raise GGUFError(f"{where}: radixlm does not serve GGUF architecture {arch!r} (general."
                        f"architecture); it reads {', '.join(sorted(FAMILIES))}")
    family = FAMILIES[arch]
    if arch == "llama" and any(t.name.endswith("_exps.weight") for t in tensors):
        family = MIXTRAL
    elif arch == "llama" and meta.get("llama.attention.sliding_window"):
        family = MISTRAL
    return arch, family


# ---------------------------------------------------------------- metadata -> config.json

_LIMIT = 1 << 31  # no dimension of a model we serve comes near


class Meta:
    """Typed reads of ``{arch}.*`` metadata: GGUFError naming the key when a value has the
    wrong type or an absurd size."""

    def __init__(self, meta: dict[str, Any], arch: str, where: str) -> None:
        self.meta, self.arch, self.where = meta, arch, where

    def raw(self, key: str) -> Any:
        return self.meta.get(key.replace("{arch}", self.arch))

    def int(self, key: str, default: int | None = None, low: int = 1) -> int | None:
        value = self.raw(key)
        if value is None:
            return default
        if isinstance(value, list) and value and len(set(value)) == 1:
            value = value[0]  # per-layer arrays of one value
        if isinstance(value, bool) or not isinstance(value, int) or not low <= value < _LIMIT:
            raise GGUFError(f"{self.where}: {key.replace('{arch}', self.arch)} is {value!r}, "
                            f"expected an integer from {low} to {_LIMIT - 1}")
        return value

    def need_int(self, key: str) -> int:
        value = self.int(key)
        if value is None:
            raise GGUFError(f"{self.where}: {key.replace('{arch}', self.arch)} is missing")
        return value

    def float(self, key: str, default: float | None = None) -> float | None:
        value = self.raw(key)
        if value is None:
            return default
        if isinstance(value, bool) or not isinstance(value, (int, float)) \
                or not math.isfinite(value):
            raise GGUFError(f"{self.where}: {key.replace('{arch}', self.arch)} is {value!r}, "
                            "expected a finite number")
        return float(value)


def _layer_types(m: Meta, layers: int, default_pattern: int | None) -> list[str] | None:
    """Per-layer sliding / full attention: the file's ``sliding_window_pattern`` (an array of
    booleans, or llama.cpp's period: the last layer of each period is full), else the
    family's default period (Gemma 2: 2, Gemma 3: 6), else every layer sliding."""
    pattern = m.raw("{arch}.attention.sliding_window_pattern")
    if isinstance(pattern, list):
        if len(pattern) != layers or not all(isinstance(p, bool) for p in pattern):
            raise GGUFError(f"{m.where}: {m.arch}.attention.sliding_window_pattern must be "
                            f"{layers} booleans, got {pattern!r}"[:300])
        swa = pattern
    else:
        period = m.int("{arch}.attention.sliding_window_pattern", default_pattern, low=0)
        swa = [True] * layers if not period else [i % period < period - 1 for i in range(layers)]
    return ["sliding_attention" if s else "full_attention" for s in swa]


def _special_ids(meta: dict[str, Any], vocab: int, where: str) -> dict[str, int]:
    out = {}
    for name in ("bos", "eos", "eot", "eom", "padding", "unknown"):
        key = f"tokenizer.ggml.{name}_token_id"
        value = meta.get(key)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < vocab:
            raise GGUFError(f"{where}: {key} {value!r} is not a token id (vocabulary {vocab})")
        out[name] = value
    return out


def _float_dtype(tensors: list[RawTensor]) -> str:
    """The checkpoint dtype the view declares: the 16-bit float type of the 2-D float
    tensors when the file has one, else float32 (quantized files compute in float32, as
    llama.cpp does)."""
    types = {t.ggml_type for t in tensors if len(t.dims) >= 2}
    if GGMLQuantizationType.BF16 in types:
        return "bfloat16"
    if GGMLQuantizationType.F16 in types:
        return "float16"
    return "float32"


def _gemma_attn_scalar(m: Meta, hidden: int, heads: int, head_dim: int,
                       layers: int) -> float:
    """Gemma 2 / 3's ``query_pre_attn_scalar``: from ``attention.scale`` when the file has it
    (our writer's), else llama.cpp's rule (hidden / heads for the 27B models, else
    head_dim)."""
    scale = m.float("{arch}.attention.scale")
    if scale:
        value = scale**-2  # stored as a float32: 32 comes back as 32.000002
        return int(round(value)) if abs(value - round(value)) < 1e-3 else value
    big = {"gemma2": 46, "gemma3": 62}.get(m.arch)
    return hidden // heads if layers == big else head_dim


def build_hf_config(meta: dict[str, Any], arch: str, family: Family,
                    tensors: dict[str, RawTensor], extra: dict[str, np.ndarray],
                    where: str) -> dict[str, Any]:
    """config.json for the file, as transformers writes it for ``family``."""
    m = Meta(meta, arch, where)
    hidden = m.need_int("{arch}.embedding_length")
    layers = m.need_int("{arch}.block_count")
    heads = m.need_int("{arch}.attention.head_count")
    kv_heads = m.int("{arch}.attention.head_count_kv", heads)
    head_dim = m.int("{arch}.attention.key_length", hidden // heads)
    embd = tensors.get("token_embd.weight")
    if embd is None or len(embd.dims) != 2:
        raise GGUFError(f"{where}: token_embd.weight is missing or not 2-D")
    vocab = embd.dims[1]
    ctx = m.int("{arch}.context_length", 4096)
    theta = m.float("{arch}.rope.freq_base", 10000.0)
    ids = _special_ids(meta, vocab, where)
    cfg: dict[str, Any] = {
        "architectures": [family.hf_arch], "model_type": family.model_type,
        "hidden_size": hidden, "num_hidden_layers": layers, "num_attention_heads": heads,
        "num_key_value_heads": kv_heads, "head_dim": head_dim, "vocab_size": vocab,
        "intermediate_size": m.int("{arch}.feed_forward_length", 4 * hidden),
        "max_position_embeddings": ctx, "hidden_act": family.hidden_act,
        "rms_norm_eps": m.float("{arch}.attention.layer_norm_rms_epsilon", 1e-6),
        "rope_theta": theta,
        "rope_scaling": rope_scaling(m, extra, ctx, head_dim, theta),
        "tie_word_embeddings": "output.weight" not in tensors,
        "attention_bias": "blk.0.attn_q.bias" in tensors and family.model_type != "qwen2",
        "bos_token_id": ids.get("bos"), "eos_token_id": ids.get("eos"),
        "pad_token_id": ids.get("padding"), "torch_dtype": _float_dtype(list(tensors.values())),
    }
    window = m.int("{arch}.attention.sliding_window", None, low=0) or None
    _FAMILY_CONFIG[family.model_type](cfg, m, window, tensors)
    return cfg


def _sliding(cfg: dict, m: Meta, window: int | None, pattern: int | None = None) -> None:
    cfg["sliding_window"] = window
    cfg["use_sliding_window"] = window is not None
    if window is not None:
        cfg["layer_types"] = _layer_types(m, cfg["num_hidden_layers"], pattern)


def _experts(cfg: dict, m: Meta, tensors: dict[str, RawTensor]) -> tuple[int, int]:
    """(expert count, expert intermediate size), checked against the stacked tensors."""
    n = m.need_int("{arch}.expert_count")
    used = m.need_int("{arch}.expert_used_count")
    if used > n:
        raise GGUFError(f"{m.where}: {m.arch}.expert_used_count {used} exceeds "
                        f"{m.arch}.expert_count {n}")
    gate = next((t for name, t in tensors.items() if name.endswith("ffn_gate_exps.weight")), None)
    if gate is None or len(gate.dims) != 3:
        raise GGUFError(f"{m.where}: {m.arch}.expert_count {n} but no 3-D ffn_gate_exps tensor")
    cfg["num_experts_per_tok"] = used
    return n, m.int("{arch}.expert_feed_forward_length", gate.dims[1])


def _qwen3_moe(cfg: dict, m: Meta, window: int | None, tensors: dict[str, RawTensor]) -> None:
    n, inter = _experts(cfg, m, tensors)
    dense = [i for i in range(cfg["num_hidden_layers"])
             if f"blk.{i}.ffn_gate_exps.weight" not in tensors]
    # llama.cpp renormalizes the top-k weights of every Qwen3-MoE (norm_topk_prob)
    norm = m.raw("{arch}.expert_weights_norm")
    cfg.update(num_experts=n, moe_intermediate_size=inter, mlp_only_layers=dense,
               decoder_sparse_step=1, norm_topk_prob=True if norm is None else bool(norm))
    _sliding(cfg, m, window)


def _mixtral(cfg: dict, m: Meta, window: int | None, tensors: dict[str, RawTensor]) -> None:
    n, inter = _experts(cfg, m, tensors)
    cfg.update(num_local_experts=n, intermediate_size=inter, sliding_window=window)


def _gemma(cfg: dict, m: Meta, window: int | None, tensors: dict[str, RawTensor]) -> None:
    cfg["hidden_activation"] = cfg["hidden_act"]
    if m.arch == "gemma":
        return
    cfg["query_pre_attn_scalar"] = _gemma_attn_scalar(
        m, cfg["hidden_size"], cfg["num_attention_heads"], cfg["head_dim"],
        cfg["num_hidden_layers"])
    cfg["final_logit_softcapping"] = m.float("{arch}.final_logit_softcapping")
    if m.arch == "gemma2":
        cfg["attn_logit_softcapping"] = m.float("{arch}.attn_logit_softcapping")
        cfg["sliding_window"] = window or 4096  # llama.cpp's default for Gemma 2
        cfg["layer_types"] = _layer_types(m, cfg["num_hidden_layers"], 2)
        return
    cfg["rope_theta"] = m.float("{arch}.rope.freq_base", 1_000_000.0)
    cfg["rope_local_base_freq"] = m.float("{arch}.rope.freq_base_swa", 10000.0)
    cfg["sliding_window"] = window
    if window is not None:
        cfg["layer_types"] = _layer_types(m, cfg["num_hidden_layers"], 6)


def _phi3(cfg: dict, m: Meta, window: int | None, tensors: dict[str, RawTensor]) -> None:
    rope_dims = m.int("{arch}.rope.dimension_count", cfg["head_dim"])
    cfg["partial_rotary_factor"] = rope_dims / cfg["head_dim"]
    cfg["original_max_position_embeddings"] = m.int(
        "{arch}.rope.scaling.original_context_length", cfg["max_position_embeddings"])
    cfg["sliding_window"] = window


# llama.cpp's gpt-oss graph (llama-graph.cpp, LLM_FFN_SWIGLU_OAI_MOE): the file has no key
GPT_OSS_SWIGLU = {"swiglu_alpha": 1.702, "swiglu_limit": 7.0}


def _gpt_oss(cfg: dict, m: Meta, window: int | None, tensors: dict[str, RawTensor]) -> None:
    """Every layer sparse, sliding and full layers alternating (sliding first: llama.cpp's
    default period of 2), the clamped SwiGLU's constants as llama.cpp computes them, and
    yarn's ramp without truncation (gpt-oss's own definition, which transformers follows
    for the released checkpoints; llama.cpp rounds the ramp's ends outwards)."""
    n, inter = _experts(cfg, m, tensors)
    if window is None:
        raise GGUFError(f"{m.where}: {m.arch}.attention.sliding_window is missing (gpt-oss "
                        "alternates sliding and full layers)")
    cfg.update(num_local_experts=n, intermediate_size=inter, **GPT_OSS_SWIGLU)
    _sliding(cfg, m, window, 2)
    if cfg["rope_scaling"] and cfg["rope_scaling"]["rope_type"] == "yarn":
        cfg["rope_scaling"]["truncate"] = False


def _plain(cfg: dict, m: Meta, window: int | None, tensors: dict[str, RawTensor]) -> None:
    if cfg["model_type"] == "llama":
        cfg["mlp_bias"] = False
    elif cfg["model_type"] == "mistral":
        cfg["sliding_window"] = window
    else:  # qwen2, qwen3: llama.cpp keeps no window; our writer's files may
        _sliding(cfg, m, window)


_FAMILY_CONFIG = {"llama": _plain, "mistral": _plain, "qwen2": _plain, "qwen3": _plain,
                  "qwen3_moe": _qwen3_moe, "mixtral": _mixtral, "gemma": _gemma,
                  "gemma2": _gemma, "gemma3_text": _gemma, "phi3": _phi3,
                  "gpt_oss": _gpt_oss}


# ---------------------------------------------------------------- tensors under HF names

_BLK = re.compile(r"blk\.(\d+)\.(.+)")


def hf_names(raw: RawTensor, family: Family, layers: int, where: str
             ) -> list[tuple[str, int | None]]:
    """Our checkpoint names for one GGUF tensor, with the expert index of each (stacked
    experts give one name per expert)."""
    if raw.name in _TOP:
        return [(_TOP[raw.name], None)]
    match = _BLK.fullmatch(raw.name)
    if match is None:
        raise GGUFError(f"{where}: unexpected tensor {raw.name!r} for {family.hf_arch}")
    layer, suffix = int(match[1]), match[2]
    if layer >= layers:
        raise GGUFError(f"{where}: tensor {raw.name!r} is in layer {layer}, but block_count "
                        f"is {layers}")
    prefix = f"model.layers.{layer}."
    if suffix in family.experts:
        count = raw.dims[-1] if len(raw.dims) == 3 else 0
        return [(prefix + family.experts[suffix].format(e=e), e) for e in range(count)]
    if suffix not in family.block:
        raise GGUFError(f"{where}: unexpected tensor {raw.name!r} for {family.hf_arch}")
    return [(prefix + family.block[suffix], None)]


def tensor_info(raw: RawTensor, name: str, expert: int | None, family: Family,
                cfg: dict[str, Any]) -> TensorInfo:
    """``raw`` as the tensor ``name`` (``expert``: its slice of a stacked tensor), with the
    conversions llama.cpp made for the family to undo."""
    dims = raw.dims[:2] if expert is not None else raw.dims
    shape = tuple(reversed(dims))
    offset, nbytes = raw.offset, raw.nbytes
    if expert is not None:  # one expert's [out, in] blocks: a contiguous slice
        nbytes = raw.nbytes // raw.dims[2]
        offset += expert * nbytes
    heads = None
    if family.permuted and raw.name.endswith(("attn_q.weight", "attn_q.bias")):
        heads = cfg["num_attention_heads"]
    elif family.permuted and raw.name.endswith(("attn_k.weight", "attn_k.bias")):
        heads = cfg["num_key_value_heads"]
    shift = -family.norm_shift if family.norm_shift and name.endswith("norm.weight") else 0.0
    return TensorInfo(name, raw.name, raw.ggml_type, shape, offset, nbytes, heads, shift)


