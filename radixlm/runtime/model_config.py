"""ModelConfig: the numbers the engine needs from a Hugging Face ``config.json``.

``ModelConfig.from_hf(dir)`` normalises the quirks of the formats in the wild (missing
``num_key_value_heads``, ``rope_scaling`` with ``type`` or ``rope_type``, transformers 5's
``rope_parameters``, ``eos_token_id`` as an int or a list, ...) into one frozen object.
"""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any

import torch

from radixlm.runtime.model_dir import ModelDirError, read_config, served_architecture

logger = logging.getLogger(__name__)

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope")
FULL, SLIDING = "full_attention", "sliding_attention"  # transformers' layer_types values
LINEAR = "linear_attention"  # a hybrid's recurrent layers (Gated DeltaNet, Mamba2)
MLP_ONLY = "mlp"  # a layer with no mixer: no K/V, no state (Nemotron-H's MLP and MoE blocks)
_KV_TYPES = (FULL, SLIDING)
_DTYPES = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "half": torch.float16,
    "float": torch.float32,
}
_ROPE_KEYS_NOT_SCALING = ("rope_theta", "partial_rotary_factor")


@dataclass(frozen=True)
class ModelConfig:
    """Architecture numbers of one checkpoint, plus the serving dtype and context length.

    ``rope_scaling`` is None for plain RoPE, else a dict with a ``rope_type`` key
    (``linear``, ``llama3``, ``yarn`` or ``longrope``) and that type's parameters; with
    per-layer-type RoPE (Gemma 3) these are the full-attention layers' and the family reads
    the others from ``hf_config`` (``layers/rotary.py``). ``layer_types[i]`` is ``FULL`` or
    ``SLIDING``, or ``LINEAR`` in a hybrid model (a recurrent layer with no K/V rows: its
    state lives in the state pool, ``radix_cache/state_pool.py``); ``layer_window(i)`` the
    window layer ``i`` attends within (None: all).
    ``hf_config`` is config.json as read, for the fields only one family has (soft-caps,
    multipliers, norm layouts): the family files read them.
    """

    model_dir: Path
    architectures: tuple[str, ...]
    model_type: str
    hidden_size: int
    num_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    context_length: int
    tie_word_embeddings: bool
    attention_bias: bool  # Llama's flag: a bias on q, k, v and o
    qkv_bias: bool  # a bias on q, k, v (Qwen2: always, o has none)
    mlp_bias: bool
    sliding_window: int | None
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    torch_dtype: torch.dtype  # the checkpoint's dtype
    dtype: str = "auto"  # requested serving dtype; see resolve_dtype
    layer_types: tuple[str, ...] = ()
    partial_rotary_factor: float = 1.0  # the fraction of head_dim RoPE rotates
    hf_config: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def from_hf(
        cls,
        model_dir: str | Path,
        dtype: str = "auto",
        context_length: int | None = None,
    ) -> ModelConfig:
        """Read ``model_dir``'s config.json: ``ModelDirError`` when it is missing, names an
        architecture radixlm does not serve (checked first: such a config may lack the
        fields below), or lacks a field the architecture needs."""
        model_dir = Path(model_dir)
        raw = read_config(model_dir)
        arch = served_architecture(raw, model_dir / "config.json")
        if dtype != "auto" and dtype not in _DTYPES:
            raise ValueError(f"dtype must be 'auto' or one of {sorted(_DTYPES)}, got {dtype!r}")
        try:
            return cls._from_dict(model_dir, _text_config(raw), dtype, context_length, arch)
        except KeyError as e:
            raise ModelDirError(f"{model_dir / 'config.json'} lacks {e.args[0]!r}, which "
                                f"{arch} needs") from None

    @classmethod
    def _from_dict(cls, model_dir: Path, hf: dict[str, Any], dtype: str,
                   context_length: int | None, arch: str) -> ModelConfig:
        heads = hf["num_attention_heads"]
        model_type = hf.get("model_type", "")
        max_pos = hf.get("max_position_embeddings", 2048)
        sliding_window = _sliding_window(hf)
        return cls(
            model_dir=model_dir,
            # a config saved without architectures: its model_type's causal LM
            architectures=tuple(hf.get("architectures") or (arch,)),
            model_type=model_type,
            hidden_size=hf["hidden_size"],
            num_layers=_num_layers(hf),
            num_attention_heads=heads,
            num_key_value_heads=hf.get("num_key_value_heads") or heads,
            head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
            intermediate_size=hf["intermediate_size"],
            vocab_size=hf["vocab_size"],
            # Nemotron-H names it layer_norm_epsilon (its norms are RMSNorms too)
            rms_norm_eps=float(hf.get("rms_norm_eps", hf.get("layer_norm_epsilon", 1e-6))),
            rope_theta=float(_rope_theta(hf)),
            rope_scaling=_rope_scaling(hf),
            max_position_embeddings=max_pos,
            context_length=_context_length(max_pos, context_length),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            attention_bias=bool(hf.get("attention_bias", False)),
            # Qwen2 checkpoints always carry a q/k/v bias and have no flag for it.
            qkv_bias=model_type == "qwen2" or bool(hf.get("attention_bias", False)),
            mlp_bias=bool(hf.get("mlp_bias", False)),
            sliding_window=sliding_window,
            eos_token_ids=_eos_token_ids(hf, model_dir),
            bos_token_id=hf.get("bos_token_id"),
            torch_dtype=_DTYPES.get(hf.get("torch_dtype") or hf.get("dtype"), torch.float32),
            dtype=dtype,
            layer_types=_layer_types(hf, sliding_window),
            # Bamba rotates half of each head whatever its file says (transformers fixes it)
            partial_rotary_factor=(0.5 if model_type == "bamba" else float(
                hf.get("partial_rotary_factor")
                or _rope_params(hf).get("partial_rotary_factor") or 1.0)),
            hf_config=hf,
        )

    def kv_identity(self) -> str:
        """The architecture and a digest of the numbers that decide what its K/V rows
        mean (sizes, RoPE, windows, layer types): two servers trade KV pages only when
        theirs are equal. Same-shaped checkpoints of one architecture (fine-tunes) share it:
        telling them apart would need the weights."""
        numbers = [self.architectures, self.model_type, self.hidden_size, self.num_layers,
                   self.num_attention_heads, self.num_key_value_heads, self.head_dim,
                   self.intermediate_size, self.vocab_size, self.rms_norm_eps,
                   self.rope_theta, self.rope_scaling, self.sliding_window,
                   self.layer_types, self.partial_rotary_factor, self.qkv_bias,
                   self.attention_bias]
        digest = hashlib.blake2b(json.dumps(numbers, sort_keys=True).encode(),
                                 digest_size=8).hexdigest()
        return f"{'+'.join(self.architectures)}/{digest}"

    def layer_window(self, layer_id: int) -> int | None:
        """The sliding window of layer ``layer_id`` (None: it attends to every key)."""
        if self.sliding_window is None or self.layer_types[layer_id] != SLIDING:
            return None
        return self.sliding_window

    @property
    def kv_layers(self) -> int:
        """Layers with K/V rows in the KV pool (a hybrid's linear and MLP-only layers have
        none)."""
        return sum(t in _KV_TYPES for t in self.layer_types)

    @property
    def is_hybrid(self) -> bool:
        """Whether some layers keep a recurrent state (``LINEAR``, or Falcon-H1's Mamba2
        beside attention in every layer)."""
        return LINEAR in self.layer_types or self.model_type in _PARALLEL_HYBRID_TYPES

    def kv_layer_index(self, layer_id: int) -> int:
        """The KV pool's layer of attention layer ``layer_id`` (its rank among the layers
        with K/V)."""
        assert self.layer_types[layer_id] in _KV_TYPES, f"layer {layer_id} has no K/V"
        return sum(t in _KV_TYPES for t in self.layer_types[:layer_id])

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    @property
    def num_kv_groups(self) -> int:
        return self.num_attention_heads // self.num_key_value_heads

    @property
    def sm_scale(self) -> float:
        return self.head_dim**-0.5

    def resolve_dtype(self, device: torch.device | str = "cpu") -> torch.dtype:
        """The dtype to serve in: explicit when asked; ``auto`` is the checkpoint's dtype
        on an accelerator, and on a CPU bfloat16 for a bfloat16 checkpoint where the CPU
        computes in bf16 (``cpu_has_bf16``, as vLLM's CPU build does), else float32."""
        if self.dtype != "auto":
            return _DTYPES[self.dtype]
        if torch.device(device).type != "cpu":
            return self.torch_dtype
        if self.torch_dtype == torch.bfloat16 and cpu_has_bf16():
            return torch.bfloat16
        return torch.float32


@cache
def cpu_has_bf16() -> bool:
    """Whether this CPU has bfloat16 arithmetic (AVX512-BF16 or AMX), which oneDNN's bf16
    matmuls use; without it they emulate bf16, slower than float32."""
    return bool(torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())


def _text_config(hf: dict) -> dict:
    """A multimodal checkpoint's language model: its ``text_config``, under the top level's
    architectures and tied-embeddings flag, with the top level's dtype and BOS/EOS ids where
    the text config has none. Other configs as they are."""
    text = hf.get("text_config")
    if not isinstance(text, dict):
        return hf
    out = dict(text)
    for key in ("architectures", "tie_word_embeddings"):
        if key in hf:
            out[key] = hf[key]
    for key in ("torch_dtype", "dtype", "eos_token_id", "bos_token_id"):
        if out.get(key) is None and hf.get(key) is not None:
            out[key] = hf[key]
    return out


def _rope_params(hf: dict, layer_type: str = FULL) -> dict[str, Any]:
    # transformers >= 5 writes `rope_parameters` (with rope_theta inside; Gemma 3: one dict
    # per layer type); older files write `rope_scaling` beside a top-level `rope_theta`.
    params = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    return dict(params.get(layer_type) or {}) if FULL in params else params


def _per_type_rope(hf: dict) -> bool:
    """Whether sliding layers have RoPE of their own (Gemma 3: ``rope_local_base_freq``,
    or transformers 5's ``rope_parameters`` keyed by layer type)."""
    return FULL in (hf.get("rope_parameters") or {}) or "rope_local_base_freq" in hf


def rope_theta_of(hf: dict, layer_type: str = FULL) -> float:
    """The RoPE base of layers of ``layer_type``."""
    if layer_type == SLIDING and _per_type_rope(hf) and FULL not in (hf.get("rope_parameters")
                                                                      or {}):
        return float(hf["rope_local_base_freq"])
    if layer_type == SLIDING and _per_type_rope(hf):
        return float(_rope_params(hf, SLIDING).get("rope_theta") or 10000.0)
    return float(hf.get("rope_theta") or _rope_params(hf).get("rope_theta") or 10000.0)


def _rope_theta(hf: dict) -> float:
    return rope_theta_of(hf, FULL)


def _rope_scaling(hf: dict) -> dict[str, Any] | None:
    return rope_scaling_of(hf, FULL)


def rope_scaling_of(hf: dict, layer_type: str = FULL) -> dict[str, Any] | None:
    """The RoPE scaling of layers of ``layer_type`` (None: plain RoPE), checked."""
    if layer_type == SLIDING and _per_type_rope(hf) and FULL not in (hf.get("rope_parameters")
                                                                      or {}):
        return None  # legacy Gemma 3: scaling (rope_scaling) is the global layers' only
    params = _rope_params(hf, layer_type)
    rope_type = params.pop("rope_type", None) or params.pop("type", None) or "default"
    params.pop("type", None)
    for key in _ROPE_KEYS_NOT_SCALING:
        params.pop(key, None)
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"unsupported rope_scaling type {rope_type!r} in config.json; "
            f"supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    if rope_type == "default":
        return None
    required = {"linear": ("factor",), "llama3": ("factor", "low_freq_factor", "high_freq_factor"),
                "yarn": ("factor",), "longrope": ("short_factor", "long_factor")}[rope_type]
    missing = [k for k in required if k not in params]
    if missing:
        raise ValueError(f"rope_scaling of type {rope_type!r} lacks {missing} in config.json")
    if rope_type != "linear":
        params.setdefault("original_max_position_embeddings",
                          hf.get("original_max_position_embeddings")
                          or hf.get("max_position_embeddings", 8192))
    return {"rope_type": rope_type, **params}


def _sliding_window(hf: dict) -> int | None:
    if hf.get("use_sliding_window") is False:  # Qwen2 sets a window but leaves it off
        return None
    return hf.get("sliding_window")


_GATED_DELTANET_TYPES = ("qwen3_next", "qwen3_5_text", "qwen3_5_moe_text")
# every layer has attention and a Mamba2 mixer side by side: K/V and a state
_PARALLEL_HYBRID_TYPES = ("falcon_h1",)
# Nemotron-H's blocks (``layers_block_type``, or the released files' hybrid_override_pattern)
_NEMOTRON_H_NAMES = {LINEAR: LINEAR, FULL: FULL, "mlp": MLP_ONLY, "moe": MLP_ONLY,
                     "mamba": LINEAR, "attention": FULL}
# Granite 4's and Bamba's names as released (transformers 5 writes linear / full_attention)
_MAMBA_NAMES = {"mamba": LINEAR, "attention": FULL}


def nemotron_h_blocks(hf: dict) -> list[str]:
    """Nemotron-H's block of each layer as transformers names them (``linear_attention``,
    ``full_attention``, ``mlp``, ``moe``), from ``layers_block_type`` or
    ``hybrid_override_pattern`` (``M * - E``)."""
    if hf.get("layers_block_type"):
        return list(hf["layers_block_type"])
    pattern = hf["hybrid_override_pattern"]
    names = {"M": LINEAR, "*": FULL, "-": "mlp", "E": "moe"}
    if set(pattern) - set(names):
        raise ValueError(f"hybrid_override_pattern in config.json must be of M * - E, got "
                         f"{pattern!r}")
    return [names[c] for c in pattern]


def _num_layers(hf: dict) -> int:
    if hf.get("model_type") == "nemotron_h":  # its file may omit num_hidden_layers
        return len(nemotron_h_blocks(hf))
    return hf["num_hidden_layers"]


def _layer_types(hf: dict, sliding_window: int | None) -> tuple[str, ...]:
    """config.json's ``layer_types``, else the family's rule as transformers derives it:
    Gemma 3 every ``sliding_window_pattern``-th layer full, Gemma 2 alternating, OLMo 3
    every fourth full, Qwen2's and Qwen3's layers from ``max_window_layers`` on sliding,
    every layer sliding elsewhere (Mistral, Phi-3) when there is a window. Qwen3-MoE slides
    every layer whatever the file says: its transformers config has neither
    ``max_window_layers`` nor ``layer_types`` (real checkpoints carry the first anyway).
    Qwen3-Next's and Qwen3.5's files may give ``full_attention_interval`` instead: every
    that-many-th layer attention, the others ``LINEAR``."""
    n = _num_layers(hf)
    if hf.get("model_type") == "nemotron_h":
        blocks = nemotron_h_blocks(hf)
        if set(blocks) - set(_NEMOTRON_H_NAMES):
            raise ValueError(f"layers_block_type in config.json must be of "
                             f"{sorted(_NEMOTRON_H_NAMES)}, got {blocks}")
        return tuple(_NEMOTRON_H_NAMES[b] for b in blocks)
    if hf.get("model_type") == "granitemoehybrid" and hf.get("layer_types"):
        hf = {**hf, "layer_types": [_MAMBA_NAMES.get(t, t) for t in hf["layer_types"]]}
    if hf.get("model_type") == "bamba":  # attention at attn_layer_indices, Mamba2 elsewhere
        attn = set(hf.get("attn_layer_indices") or ())
        return tuple(FULL if i in attn else LINEAR for i in range(n))
    if hf.get("model_type") == "jamba":  # attention where i % period == offset, Mamba elsewhere
        period, offset = hf.get("attn_layer_period", 8), hf.get("attn_layer_offset", 4)
        return tuple(FULL if i % period == offset else LINEAR for i in range(n))
    if hf.get("model_type") in _GATED_DELTANET_TYPES and not hf.get("layer_types"):
        # the released config.json files: one attention layer every full_attention_interval
        interval = hf.get("full_attention_interval", 4)
        return tuple(LINEAR if (i + 1) % interval else FULL for i in range(n))
    if hf.get("model_type") == "qwen3_moe":
        return (FULL if sliding_window is None else SLIDING,) * n
    if hf.get("layer_types"):
        types = tuple(hf["layer_types"])
        if len(types) != n or set(types) - {FULL, SLIDING, LINEAR}:
            raise ValueError(f"layer_types in config.json must be {n} of {FULL!r} / "
                             f"{SLIDING!r} / {LINEAR!r}, got {list(types)}")
        return types
    if sliding_window is None:
        return (FULL,) * n
    if "sliding_window_pattern" in hf:
        pattern = hf["sliding_window_pattern"]
        return tuple(SLIDING if (i + 1) % pattern else FULL for i in range(n))
    if hf.get("model_type") in ("gemma2", "gpt_oss"):  # sliding first, then alternating
        return tuple(SLIDING if (i + 1) % 2 else FULL for i in range(n))
    if hf.get("model_type") == "olmo3":  # three sliding layers, then a full one
        return tuple(SLIDING if (i + 1) % 4 else FULL for i in range(n))
    if "max_window_layers" in hf:
        return tuple(SLIDING if i >= hf["max_window_layers"] else FULL for i in range(n))
    return (SLIDING,) * n


def _context_length(max_pos: int, requested: int | None) -> int:
    length = requested if requested is not None else max_pos
    if requested is not None and requested > max_pos:
        logger.warning(
            "context_length %d exceeds max_position_embeddings %d of the model", requested, max_pos
        )
    return length


# what a checkpoint's generation_config.json may set as a request's default (SGLang's and
# vLLM's list)
SAMPLING_DEFAULT_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def model_sampling_defaults(model_dir: str | Path) -> dict[str, float]:
    """The sampling defaults ``generation_config.json`` names (``SAMPLING_DEFAULT_KEYS``);
    {} without the file. A value that is not a number is a ValueError naming the key."""
    path = Path(model_dir) / "generation_config.json"
    if not path.is_file():
        return {}
    data = json.loads(path.read_text(encoding="utf-8"))
    out: dict[str, float] = {}
    for key in SAMPLING_DEFAULT_KEYS:
        value = data.get(key) if isinstance(data, dict) else None
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"{path}: {key} must be a number, got {value!r}")
        if key == "top_k":  # transformers' 0 is "no top-k", ours -1
            if value != int(value):
                raise ValueError(f"{path}: top_k must be an integer, got {value!r}")
            value = int(value) or -1
        out[key] = value
    return out


def _eos_token_ids(hf: dict, model_dir: Path) -> tuple[int, ...]:
    """EOS ids of config.json, then any more from generation_config.json (chat models list
    their end-of-turn token there)."""
    ids: list[int] = []
    sources = [hf.get("eos_token_id")]
    gen_path = model_dir / "generation_config.json"
    if gen_path.is_file():
        sources.append(json.loads(gen_path.read_text(encoding="utf-8")).get("eos_token_id"))
    for value in sources:
        for i in [value] if isinstance(value, int) else value or []:
            if i not in ids:
                ids.append(i)
    return tuple(ids)
