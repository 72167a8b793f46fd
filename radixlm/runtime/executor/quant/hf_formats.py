"""Which quantized layout a Hugging Face checkpoint uses, from its config.json's
``quantization_config`` (or the older ``compression_config``), every field checked.

``scheme_for(hf_config, requested)`` detects the scheme (SGLang's ``--quantization`` names,
``QUANTIZATION_NAMES``) and builds it from the config's fields: one builder a
``quant_method`` (``BUILDERS``: AutoAWQ, GPTQ, HF fine-grained FP8, compressed-tensors,
SGLang's own W8A8). What the checkpoint stores and how it is read is the scheme's
(``hf_layouts.py``). An unknown name, a name the checkpoint disagrees with, or a variant no
layout reads (mixed precision, per-module overrides, asymmetric activations, ...) is a
ValueError naming the field.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Mapping

from radixlm.runtime.executor.quant.hf_layouts import (
    AwqScheme,
    GptqScheme,
    PackedScheme,
    QuantScheme,
    UnpackedScheme,
)

logger = logging.getLogger(__name__)

# SGLang's --quantization name -> the checkpoint quant_methods it serves
QUANTIZATION_NAMES: dict[str, tuple[str, ...]] = {
    "awq": ("awq",), "awq_marlin": ("awq",),
    "gptq": ("gptq",), "gptq_marlin": ("gptq",),
    "fp8": ("fp8",),
    "compressed-tensors": ("compressed-tensors",),
    "w8a8_int8": ("w8a8_int8", "compressed-tensors"),
    "w8a8_fp8": ("w8a8_fp8", "compressed-tensors"),
    "gguf": (),  # a .gguf file: read by the GGUF loader, never through quantization_config
}


def _field(cfg: Mapping, key: str, allowed: tuple, default: object = None) -> object:
    """``cfg[key]`` (or ``default``), ValueError naming the field unless it is allowed."""
    value = cfg.get(key, default)
    if value not in allowed:
        raise ValueError(f"quantization_config.{key} = {value!r} is not supported "
                         f"(supported: {', '.join(repr(a) for a in allowed)})")
    return value


def _group(cfg: Mapping, key: str = "group_size") -> int:
    """A group size: positive, or -1 / None for the whole row (0 here)."""
    g = cfg.get(key)
    if g in (-1, None):
        return 0
    if not isinstance(g, int) or isinstance(g, bool) or g < 1:
        raise ValueError(f"quantization_config.{key} = {g!r} is not supported "
                         "(a positive integer or -1)")
    return g


def _names(cfg: Mapping, *keys: str) -> tuple[str, ...]:
    for key in keys:
        value = cfg.get(key)
        if value:
            if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
                raise ValueError(f"quantization_config.{key} must be a list of module names")
            return tuple(value)
    return ()


def _awq(cfg: Mapping) -> QuantScheme:
    _field(cfg, "bits", (4,), cfg.get("w_bit", 4))
    _field(cfg, "zero_point", (True,), True)
    version = str(cfg.get("version", cfg.get("format", "gemm"))).lower()
    if version != "gemm":
        raise ValueError(f"quantization_config.version = {version!r} is not supported "
                         "(AutoAWQ's 'gemm' layout only)")
    return AwqScheme("awq", "w4", _group(cfg, "group_size" if "group_size" in cfg
                                         else "q_group_size"),
                     skip=_names(cfg, "modules_to_not_convert"))


def _gptq_skips(cfg: Mapping) -> tuple[str, ...]:
    """GPTQModel's ``dynamic``: ``-:regex`` keys skip modules; per-module overrides of
    bits or groups (``+:`` keys) are refused."""
    dynamic = cfg.get("dynamic") or {}
    skips = []
    for key, override in dynamic.items():
        if key.startswith("-:"):
            skips.append(key[2:])
        elif override:
            raise ValueError(f"quantization_config.dynamic[{key!r}] = {override!r}: "
                             "per-module overrides are not supported")
    return tuple(skips)


def _gptq(cfg: Mapping) -> QuantScheme:
    bits = _field(cfg, "bits", (4, 8))
    fmt = cfg.get("checkpoint_format") or cfg.get("format") or "gptq"
    _field({"checkpoint_format": fmt}, "checkpoint_format", ("gptq", "gptq_v2"))
    _field(cfg, "pack_dtype", ("int32",), "int32")
    desc_act = bool(_field(cfg, "desc_act", (True, False, None), False))
    _field(cfg, "sym", (True, False, None), True)
    keep = tuple(m for block in cfg.get("modules_in_block_to_quantize") or ()
                 for m in ([block] if isinstance(block, str) else block))
    skip, mode = _gptq_skips(cfg), "regex"
    if keep:  # optimum's list: every other linear of a block stays float
        skip = skip + (rf"(?!.*\.({'|'.join(map(re.escape, keep))})$)",)
    return GptqScheme("gptq", "w4" if bits == 4 else "w8", _group(cfg), skip=skip,
                      skip_mode=mode, lm_head=bool(cfg.get("lm_head", False)), bits=bits,
                      v1=fmt == "gptq", desc_act=desc_act)


def _fp8(cfg: Mapping) -> QuantScheme:
    _field(cfg, "fmt", ("e4m3",), "e4m3")
    _field(cfg, "scale_fmt", (None, "ue8m0"))  # ue8m0: float32 powers of two (V3.1)
    static = _field(cfg, "activation_scheme", ("dynamic", "static"), "dynamic") == "static"
    skip = _names(cfg, "modules_to_not_convert", "ignored_layers")
    block = cfg.get("weight_block_size")
    if block is None:
        return UnpackedScheme("fp8", "fp8", 0, skip=skip, strategy="tensor",
                              static_input=static)
    if (not isinstance(block, list) or len(block) != 2
            or not all(isinstance(b, int) and b > 0 for b in block)):
        raise ValueError(f"quantization_config.weight_block_size = {block!r} is not "
                         "supported (two positive integers, [128, 128] as shipped)")
    return UnpackedScheme("fp8", "fp8", block[1], skip=skip, strategy="block", block=block[0],
                          scale_suffix=".weight_scale_inv", static_input=static)


def _sglang_w8a8(method: str) -> Callable[[Mapping], QuantScheme]:
    """SGLang's own ``w8a8_int8`` / ``w8a8_fp8``: per-channel weights, dynamic tokens."""
    def build(cfg: Mapping) -> QuantScheme:
        kind = "w8" if method == "w8a8_int8" else "fp8"
        return UnpackedScheme(method, kind, 0, skip=_names(cfg, "ignore",
                                                           "modules_to_not_convert"),
                              skip_mode="ct", strategy="channel")
    return build


def _ct_weights(cfg: Mapping) -> tuple[Mapping, Mapping | None, str, tuple[str, ...]]:
    """The one weight scheme of compressed-tensors' config_groups (all groups alike), its
    input activations, the format and every group's targets."""
    groups = cfg.get("config_groups") or {}
    if not groups:
        raise ValueError("quantization_config.config_groups is empty")
    schemes = list(groups.values())
    weights = schemes[0].get("weights")
    if weights is None or any(s.get("weights") != weights for s in schemes):
        raise ValueError("quantization_config.config_groups: groups with different weight "
                         "schemes (mixed precision) are not supported")
    acts = schemes[0].get("input_activations")
    fmt = cfg.get("format")
    if fmt in (None, "mixed-precision"):  # then each group names its own
        fmt = schemes[0].get("format")
        if any(s.get("format") != fmt for s in schemes):
            raise ValueError("quantization_config.config_groups: groups in different "
                             "formats (mixed precision) are not supported")
    targets = tuple(t for s in schemes for t in s.get("targets") or ())
    return weights, acts, str(fmt), targets


def _ct_acts(acts: Mapping | None) -> bool:
    """Whether the input activations carry static scales (ignored). ValueError for what a
    kernel could not honour: asymmetric activations."""
    if acts is None:
        return False
    _field(acts, "symmetric", (True,), True)
    _field(acts, "num_bits", (8,))
    return not acts.get("dynamic", False)


def _ct(cfg: Mapping) -> QuantScheme:
    _field(cfg, "quantization_status", ("compressed",), "compressed")
    _field(cfg, "kv_cache_scheme", (None,))
    for key in ("sparsity_config", "transform_config"):
        if cfg.get(key):
            raise ValueError(f"quantization_config.{key} is not supported")
    w, acts, fmt, targets = _ct_weights(cfg)
    _field(w, "dynamic", (False,), False)
    kind_of = {"int": "w8", "float": "fp8"}
    wtype = _field(w, "type", tuple(kind_of))
    strategy = _field(w, "strategy", ("tensor", "channel", "group", "block"))
    group = _group(w) if strategy == "group" else 0
    actorder = _field(w, "actorder", (None, "group", "weight", "static", "dynamic"))
    sym = bool(w.get("symmetric", True))
    common = dict(skip=_names(cfg, "ignore"), skip_mode="ct", targets=targets, lm_head=True)
    if fmt == "pack-quantized":
        if acts is not None:  # W4A8: its activation scales would have no reader
            raise ValueError("quantization_config input_activations with pack-quantized "
                             "weights (W4A8) are not supported")
        bits = _field(w, "num_bits", (4, 8))
        _field(w, "strategy", ("channel", "group"))
        _field(w, "type", ("int",))
        return PackedScheme("compressed-tensors", "w4" if bits == 4 else "w8", group,
                            bits=bits, symmetric=sym, g_idx=actorder in ("group", "dynamic"),
                            **common)
    _field({"format": fmt}, "format", ("pack-quantized", "int-quantized", "float-quantized",
                                       "naive-quantized"))
    _field(w, "num_bits", (8,))
    if wtype == "float" and not sym:
        raise ValueError("quantization_config: asymmetric FP8 weights are not supported")
    if actorder in ("group", "dynamic") and strategy == "group":
        raise ValueError(f"quantization_config actorder = {actorder!r} is supported for "
                         "pack-quantized only")
    block, bk = 0, group
    if strategy == "block":
        bs = w.get("block_structure")
        if not (isinstance(bs, list) and len(bs) == 2 and all(isinstance(b, int) and b > 0
                                                              for b in bs)):
            raise ValueError(f"quantization_config block_structure = {bs!r} is not supported")
        block, bk = bs
    return UnpackedScheme("compressed-tensors", kind_of[str(wtype)], bk, strategy=strategy,
                          block=block, zero_point=not sym, static_input=_ct_acts(acts),
                          **common)


BUILDERS: dict[str, Callable[[Mapping], QuantScheme]] = {
    "awq": _awq, "gptq": _gptq, "fp8": _fp8, "compressed-tensors": _ct,
    "w8a8_int8": _sglang_w8a8("w8a8_int8"), "w8a8_fp8": _sglang_w8a8("w8a8_fp8"),
}


def scheme_for(hf_config: Mapping, requested: str | None) -> QuantScheme | None:
    """The checkpoint's scheme, from ``hf_config["quantization_config"]`` (or the older
    ``compression_config``), checked against ``requested`` (SGLang's ``--quantization``
    name, None to detect). None when the checkpoint is not quantized and nothing was
    requested, for ``gguf`` (the GGUF loader's) and gpt-oss's ``mxfp4``. ValueError
    naming the field for an unknown name, a name the checkpoint disagrees with, or an
    unsupported variant."""
    cfg = hf_config.get("quantization_config") or hf_config.get("compression_config")
    name = None
    if requested is not None:
        name = requested.lower().replace("compressed_tensors", "compressed-tensors")
        if name not in QUANTIZATION_NAMES:
            raise ValueError(f"--quantization {requested!r} is not one of "
                             f"{', '.join(QUANTIZATION_NAMES)}")
    if cfg is None:
        if name not in (None, "gguf"):
            raise ValueError(f"--quantization {requested}: the checkpoint has no "
                             "quantization_config (quantizing at load is not supported)")
        return None
    if not isinstance(cfg, Mapping):
        raise ValueError("quantization_config must be an object")
    method = str(cfg.get("quant_method") or "").lower()
    if not method and name:  # an old quantize_config.json carries no quant_method
        method = (QUANTIZATION_NAMES[name] or ("",))[0]
    method = method.replace("compressed_tensors", "compressed-tensors")
    if method in ("gguf", "mxfp4") and name in (None, method):
        return None  # a GGUF file's view; gpt-oss's MXFP4 experts (its family's business)
    if name is not None and method not in QUANTIZATION_NAMES[name]:
        raise ValueError(f"--quantization {requested} does not match the checkpoint's "
                         f"quantization_config.quant_method = {method!r}")
    if method not in BUILDERS:
        raise ValueError(f"quantization_config.quant_method = {method!r} is not supported "
                         f"(supported: {', '.join(BUILDERS)})")
    scheme = BUILDERS[method](cfg)
    wanted = {"w8a8_int8": "w8", "w8a8_fp8": "fp8"}.get(name or "")
    if wanted and scheme.kind != wanted:
        raise ValueError(f"--quantization {requested}: the checkpoint's weights are "
                         f"{scheme.kind}, not {wanted}")
    if getattr(scheme, "static_input", False):
        logger.info("%s: static input scales are ignored (activations are quantized "
                    "dynamically, or not at all)", method)
    return scheme
