"""A GGUF file, checked whole before anything reads it, seen as a Hugging Face checkpoint.

``open_gguf(path)`` parses the header with our own bounded reader (not ``gguf.GGUFReader``,
which loops over counts read from the file before checking them against its size and turns
a truncated file into an IndexError or a silently short array) and refuses, with a
``GGUFError`` naming the key or tensor:

    the container   bad magic or version, a header cut short, a string or array longer than
                    the bytes left, a duplicate key or tensor, an alignment that is not a
                    power of two, a split file
    the tensors     an unknown GGML type (its number), a zero or absurd dimension, a row not
                    a whole number of blocks, data misaligned, past the end of the file or
                    overlapping another tensor's
    the model       an architecture we do not serve (named), metadata that disagrees with
                    the tensors (embedding length, head counts, block count, vocabulary), a
                    tensor missing, unexpected or of another shape

Every count is checked against the bytes left before a loop runs over it, so a hostile
file costs at most a pass over its own bytes. The tensor data is never read here:
``GGUFModel.data(info)`` is a read-only view into the mapped file.

``GGUFModel.tensors`` names every tensor as the checkpoint our models load would
(``checkpoint_layout``): ``blk.3.attn_q.weight`` is ``model.layers.3.self_attn.q_proj.weight``,
with its logical HF shape ``(out, in)`` (GGUF lists dimensions innermost first), its GGML type
and byte range. Stacked experts (``blk.N.ffn_gate_exps.weight`` ``[E, I, H]``) appear one
per expert (``model.layers.N.mlp.experts.E.gate_proj.weight``), each its own byte range.
Two conversions of llama.cpp's ``convert_hf_to_gguf.py`` are recorded for the reader to undo:
the rows of ``attn_q`` / ``attn_k`` of RoPE-"normal" architectures (llama) are permuted per
head (``unpermute_heads``), and Gemma's norms are stored as ``1 + w`` (``norm_shift``).

``hf_config()`` is the config.json transformers would write for the family, and
``write_view(dir)`` a directory (config.json, tokenizer, generation_config.json) on which
``ModelConfig.from_hf`` and ``AutoTokenizer.from_pretrained`` work unchanged;
``view_dir_for(path)`` caches it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import mmap
import os
import re
import shutil
import struct
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

logger = logging.getLogger(__name__)

MAGIC = b"GGUF"
VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
MAX_DIMS = 4  # GGML_MAX_DIMS
MAX_NAME = 1024
MAX_ARRAY_DEPTH = 2

# value type -> (struct format, size); STRING 8 and ARRAY 9 are read apart
_SCALARS = {0: ("<B", 1), 1: ("<b", 1), 2: ("<H", 2), 3: ("<h", 2), 4: ("<I", 4), 5: ("<i", 4),
            6: ("<f", 4), 7: ("<?", 1), 10: ("<Q", 8), 11: ("<q", 8), 12: ("<d", 8)}
_NUMPY = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "<u1",
          10: "<u8", 11: "<i8", 12: "<f8"}
STRING, ARRAY = 8, 9


class GGUFError(ValueError):
    """A GGUF file radixlm refuses; the message names the file and the key or tensor."""


@dataclass(frozen=True)
class RawTensor:
    """A tensor as the file lists it: GGML dims (innermost first), type, absolute offset."""

    name: str
    dims: tuple[int, ...]
    ggml_type: int
    offset: int
    nbytes: int


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


# GGML types no weight of ours is read from (integer tensors, llama.cpp's activation
# types, types the gguf package has no dequantizer for): refused by name at open
NOT_WEIGHT_TYPES = frozenset(int(t) for t in (
    GGMLQuantizationType.Q8_1, GGMLQuantizationType.Q8_K, GGMLQuantizationType.I8,
    GGMLQuantizationType.I16, GGMLQuantizationType.I32, GGMLQuantizationType.I64,
    GGMLQuantizationType.F64, GGMLQuantizationType.Q1_0))


# ---------------------------------------------------------------- the container


class _Cursor:
    """Bounded little-endian reads from the mapped header; each read checks the bytes left."""

    def __init__(self, buf: mmap.mmap | bytes, where: str) -> None:
        self.buf, self.pos, self.size, self.where = buf, 0, len(buf), where

    def fail(self, what: str) -> GGUFError:
        return GGUFError(f"{self.where}: {what}")

    def need(self, n: int, what: str) -> None:
        if n < 0 or self.pos + n > self.size:
            raise self.fail(f"{what} at byte {self.pos} needs {n} bytes, the file has "
                            f"{max(self.size - self.pos, 0)} left (truncated or corrupt)")

    def scalar(self, vtype: int, what: str) -> Any:
        fmt, n = _SCALARS[vtype]
        self.need(n, what)
        (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += n
        # a float32 as its shortest decimal (1e-05, not 9.999999747378752e-06), as written
        return float(str(np.float32(value))) if vtype == 6 else value

    def u32(self, what: str) -> int:
        return self.scalar(4, what)

    def u64(self, what: str) -> int:
        return self.scalar(10, what)

    def string(self, what: str, limit: int | None = None) -> str:
        n = self.u64(f"{what}'s length")
        if limit is not None and n > limit:
            raise self.fail(f"{what} is {n} bytes long (at most {limit})")
        self.need(n, what)
        raw = bytes(self.buf[self.pos:self.pos + n])
        self.pos += n
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise self.fail(f"{what} is not UTF-8 ({e})") from None

    def value(self, vtype: int, what: str, depth: int = 0) -> Any:
        if vtype in _SCALARS:
            return self.scalar(vtype, what)
        if vtype == STRING:
            return self.string(what)
        if vtype == ARRAY:
            if depth >= MAX_ARRAY_DEPTH:
                raise self.fail(f"{what}: arrays nested deeper than {MAX_ARRAY_DEPTH}")
            return self.array(what, depth)
        raise self.fail(f"{what} has unknown value type {vtype}")

    def array(self, what: str, depth: int) -> list:
        etype = self.u32(f"{what}'s element type")
        count = self.u64(f"{what}'s element count")
        least = _SCALARS[etype][1] if etype in _SCALARS else 8 if etype == STRING else 12
        if etype not in _SCALARS and etype not in (STRING, ARRAY):
            raise self.fail(f"{what}: array of unknown value type {etype}")
        # every element takes at least `least` bytes: refuse before looping over the count
        self.need(count * least, f"{what} ({count} elements of type {etype})")
        if etype in _NUMPY:
            arr = np.frombuffer(self.buf, dtype=_NUMPY[etype], count=count, offset=self.pos)
            self.pos += count * least
            return (arr != 0).tolist() if etype == 7 else arr.tolist()
        return [self.value(etype, f"{what}[{i}]", depth + 1) for i in range(count)]


def _read_header(cur: _Cursor) -> tuple[int, dict[str, Any], list[tuple], int]:
    """(version, metadata, tensor infos as read, end of the tensor infos)."""
    cur.need(4, "magic")
    if bytes(cur.buf[0:4]) != MAGIC:
        raise cur.fail(f"not a GGUF file (magic {bytes(cur.buf[0:4])!r}, expected {MAGIC!r})")
    cur.pos = 4
    version = cur.u32("version")
    if version not in VERSIONS:
        endian = " (a big-endian file?)" if version & 0xFFFF == 0 else ""
        raise cur.fail(f"GGUF version {version}{endian} is not supported (versions {VERSIONS})")
    n_tensors, n_kv = cur.u64("tensor count"), cur.u64("metadata count")
    # each key/value takes at least 13 bytes, each tensor info at least 25
    cur.need(n_kv * 13 + n_tensors * 25, f"{n_kv} metadata entries and {n_tensors} tensors")
    meta: dict[str, Any] = {}
    for i in range(n_kv):
        key = cur.string(f"metadata key #{i}", MAX_NAME)
        vtype = cur.u32(f"metadata {key!r}'s type")
        if key in meta:
            raise cur.fail(f"metadata key {key!r} appears twice")
        meta[key] = cur.value(vtype, f"metadata {key!r}")
    infos = []
    for i in range(n_tensors):
        name = cur.string(f"tensor #{i}'s name", MAX_NAME)
        n_dims = cur.u32(f"tensor {name!r}'s dimension count")
        if not 1 <= n_dims <= MAX_DIMS:
            raise cur.fail(f"tensor {name!r} has {n_dims} dimensions (1 to {MAX_DIMS})")
        dims = tuple(cur.u64(f"tensor {name!r}'s dimension {d}") for d in range(n_dims))
        ggml_type = cur.u32(f"tensor {name!r}'s type")
        offset = cur.u64(f"tensor {name!r}'s offset")
        infos.append((name, dims, ggml_type, offset))
    return version, meta, infos, cur.pos


def _check_tensor(name: str, dims: tuple[int, ...], ggml_type: int, where: str,
                  file_size: int) -> int:
    """The tensor's byte size, after checking its type and dimensions."""
    try:
        block, size = GGML_QUANT_SIZES[GGMLQuantizationType(ggml_type)]
    except (ValueError, KeyError):
        raise GGUFError(f"{where}: tensor {name!r} has unknown GGML type {ggml_type}") from None
    if ggml_type in NOT_WEIGHT_TYPES:
        raise GGUFError(f"{where}: tensor {name!r} has GGML type "
                        f"{GGMLQuantizationType(ggml_type).name}, which radixlm reads no "
                        "weights from")
    if any(d == 0 for d in dims):
        raise GGUFError(f"{where}: tensor {name!r} has a zero dimension {list(dims)}")
    if dims[0] % block:
        raise GGUFError(f"{where}: tensor {name!r}'s rows of {dims[0]} are not whole "
                        f"{GGMLQuantizationType(ggml_type).name} blocks of {block}")
    elements = math.prod(dims)  # Python ints: no overflow to hide an absurd product
    if elements // block * size > file_size:
        raise GGUFError(f"{where}: tensor {name!r} of dimensions {list(dims)} needs more "
                        f"bytes than the whole file's {file_size}")
    return elements // block * size


def _alignment(meta: dict[str, Any], where: str) -> int:
    align = meta.get("general.alignment", DEFAULT_ALIGNMENT)
    if isinstance(align, bool) or not isinstance(align, int) or align <= 0 \
            or align & (align - 1) or align > 1 << 20:
        raise GGUFError(f"{where}: general.alignment {align!r} is not a power of two")
    return align


def _layout(infos: list[tuple], header_end: int, align: int, where: str,
            file_size: int) -> list[RawTensor]:
    """The tensors with absolute offsets, checked: aligned, inside the file, disjoint."""
    data_start = -(-header_end // align) * align
    tensors, seen = [], set()
    for name, dims, ggml_type, offset in infos:
        if name in seen:
            raise GGUFError(f"{where}: tensor {name!r} appears twice")
        seen.add(name)
        nbytes = _check_tensor(name, dims, ggml_type, where, file_size)
        if offset % align:
            raise GGUFError(f"{where}: tensor {name!r}'s offset {offset} is not a multiple "
                            f"of the alignment {align}")
        start = data_start + offset
        if start + nbytes > file_size:
            raise GGUFError(f"{where}: tensor {name!r} (bytes {start} to {start + nbytes}) "
                            f"runs past the end of the file ({file_size} bytes)")
        tensors.append(RawTensor(name, dims, ggml_type, start, nbytes))
    ordered = sorted(tensors, key=lambda t: t.offset)
    for a, b in zip(ordered, ordered[1:]):
        if a.offset + a.nbytes > b.offset:
            raise GGUFError(f"{where}: tensors {a.name!r} and {b.name!r} overlap")
    return tensors


def read_container(path: str | os.PathLike) -> tuple[dict[str, Any], list[RawTensor], int]:
    """(metadata, tensors, version) of the GGUF file at ``path``, every byte range checked."""
    path = Path(path)
    where = str(path)
    size = path.stat().st_size
    if size < 24:
        raise GGUFError(f"{where}: {size} bytes is too short for a GGUF header")
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        version, meta, infos, end = _read_header(_Cursor(buf, where))
    if int(meta.get("split.count", 1) or 1) > 1:
        raise GGUFError(f"{where}: a split GGUF file (split.count {meta['split.count']}); "
                        "merge the parts first (llama-gguf-split --merge)")
    return meta, _layout(infos, end, _alignment(meta, where), where, size), version


# ---------------------------------------------------------------- the families

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
_TOP = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
        "output.weight": "lm_head.weight"}
# read into the config (RoPE scaling), not loaded
_CONFIG_TENSORS = ("rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight")


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
}
# llama with experts is Mixtral; with a sliding window (our writer's), Mistral
MIXTRAL = Family("MixtralForCausalLM", "mixtral", {**_BLOCK, **_MIXTRAL}, _MIXTRAL_EXPERTS,
                 permuted=True)
MISTRAL = Family("MistralForCausalLM", "mistral", _BLOCK, {}, permuted=True)
REFUSED = {
    "gpt-oss": "llama.cpp's gpt-oss files hold the experts in MXFP4 blocks of its own layout, "
               "which radixlm does not read yet: serve the Hugging Face checkpoint",
}


def family_of(meta: dict[str, Any], tensors: list[RawTensor], where: str) -> tuple[str, Family]:
    arch = meta.get("general.architecture")
    if not isinstance(arch, str):
        raise GGUFError(f"{where}: general.architecture is missing or not a string")
    if arch in REFUSED:
        raise GGUFError(f"{where}: GGUF architecture {arch!r}: {REFUSED[arch]}")
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


class _Meta:
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


def _layer_types(m: _Meta, layers: int, default_pattern: int | None) -> list[str] | None:
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


def _rope_scaling(m: _Meta, extra: dict[str, np.ndarray], ctx: int | None,
                  head_dim: int, theta: float) -> dict[str, Any] | None:
    kind = m.raw("{arch}.rope.scaling.type")
    factor = m.float("{arch}.rope.scaling.factor")
    if kind == "linear" and factor and factor != 1.0:
        return {"rope_type": "linear", "factor": factor}
    if kind == "yarn" and factor:
        out = {"rope_type": "yarn", "factor": factor,
               "original_max_position_embeddings":
                   m.int("{arch}.rope.scaling.original_context_length", ctx)}
        for key, name in (("yarn_beta_fast", "beta_fast"), ("yarn_beta_slow", "beta_slow"),
                          ("yarn_attn_factor", "attention_factor")):
            if (value := m.float("{arch}.rope.scaling." + key)) is not None:
                out[name] = value
        return out
    if "rope_factors_long.weight" in extra:
        original = m.int("{arch}.rope.scaling.original_context_length", ctx)
        long = extra["rope_factors_long.weight"]
        out = {"rope_type": "longrope", "factor": (ctx or original) / original,
               "long_factor": _decimals(long),
               "short_factor": _decimals(extra.get("rope_factors_short.weight", long)),
               "original_max_position_embeddings": original}
        attn = m.float("{arch}.rope.scaling.attn_factor")
        scale = out["factor"]
        default = math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1 else 1.0
        if attn is not None and abs(attn - default) > 1e-5:  # else transformers' own
            out["attention_factor"] = attn
        return out
    if "rope_freqs.weight" in extra:
        return _llama3_rope(extra["rope_freqs.weight"], head_dim, theta, m.where)
    if kind not in (None, "none", "linear", "yarn"):
        raise GGUFError(f"{m.where}: {m.arch}.rope.scaling.type {kind!r} is not supported")
    return None


def _decimals(values: np.ndarray) -> list[float]:
    """float32 values as their shortest decimals (1.1, not 1.100000023841858)."""
    return [float(str(v)) for v in values.astype(np.float32)]


def llama3_factors(head_dim: int, theta: float, factor: float, low: float, high: float,
                   original: int) -> np.ndarray:
    """The per-frequency divisors of Llama 3's RoPE scaling, as llama.cpp's converter writes
    them into ``rope_freqs.weight``."""
    freqs = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    wavelen = 2 * math.pi / freqs
    smooth = (original / wavelen - low) / (high - low)
    mid = 1 / ((1 - smooth) / factor + smooth)
    return np.where(wavelen < original / high, 1.0,
                    np.where(wavelen > original / low, factor, mid))


def _llama3_rope(factors: np.ndarray, head_dim: int, theta: float, where: str
                 ) -> dict[str, Any] | None:
    """Llama 3's rope_scaling recovered from the divisors llama.cpp stores: ``factor`` is the
    largest; the smooth band between gives ``original / (high - low)`` and ``low / (high -
    low)``, and with Llama 3's ``low_freq_factor`` 1 the rest. Checked by recomputing."""
    f = factors.astype(np.float64)
    if f.shape != (head_dim // 2,):
        raise GGUFError(f"{where}: rope_freqs.weight has {f.size} values, expected "
                        f"{head_dim // 2} (half the head dimension)")
    if np.allclose(f, 1.0):
        return None
    factor = float(f.max())
    wavelen = 2 * math.pi * theta ** (np.arange(0, head_dim, 2) / head_dim)
    band = (f > 1 + 1e-6) & (f < factor * (1 - 1e-6))
    low, high, original = 1.0, 4.0, 8192  # Llama 3.1's, used when the band is too thin
    if band.sum() >= 2:
        s = (1 / f[band] - 1 / factor) / (1 - 1 / factor)  # s = a / wavelen - b
        a, nb = np.polyfit(1 / wavelen[band], s, 1)
        high = low - 1 / nb
        original = int(round(a * (high - low)))
        high = float(round(high, 4))
    expect = llama3_factors(head_dim, theta, factor, low, high, original)
    if not np.allclose(expect, f, rtol=1e-4, atol=1e-4):
        raise GGUFError(f"{where}: rope_freqs.weight is not a Llama 3 RoPE scaling radixlm "
                        "can express")
    return {"rope_type": "llama3", "factor": factor, "low_freq_factor": low,
            "high_freq_factor": high, "original_max_position_embeddings": original}


def _tokens(meta: dict[str, Any], where: str) -> list[str] | None:
    tokens = meta.get("tokenizer.ggml.tokens")
    if tokens is not None and not (isinstance(tokens, list)
                                   and all(isinstance(t, str) for t in tokens)):
        raise GGUFError(f"{where}: tokenizer.ggml.tokens must be an array of strings")
    return tokens


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


def _gemma_attn_scalar(m: _Meta, hidden: int, heads: int, head_dim: int,
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
    m = _Meta(meta, arch, where)
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
        "rope_scaling": _rope_scaling(m, extra, ctx, head_dim, theta),
        "tie_word_embeddings": "output.weight" not in tensors,
        "attention_bias": "blk.0.attn_q.bias" in tensors and family.model_type != "qwen2",
        "bos_token_id": ids.get("bos"), "eos_token_id": ids.get("eos"),
        "pad_token_id": ids.get("padding"), "torch_dtype": _float_dtype(list(tensors.values())),
    }
    window = m.int("{arch}.attention.sliding_window", None, low=0) or None
    _FAMILY_CONFIG[family.model_type](cfg, m, window, tensors)
    return cfg


def _sliding(cfg: dict, m: _Meta, window: int | None, pattern: int | None = None) -> None:
    cfg["sliding_window"] = window
    cfg["use_sliding_window"] = window is not None
    if window is not None:
        cfg["layer_types"] = _layer_types(m, cfg["num_hidden_layers"], pattern)


def _experts(cfg: dict, m: _Meta, tensors: dict[str, RawTensor]) -> tuple[int, int]:
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


def _qwen3_moe(cfg: dict, m: _Meta, window: int | None, tensors: dict[str, RawTensor]) -> None:
    n, inter = _experts(cfg, m, tensors)
    dense = [i for i in range(cfg["num_hidden_layers"])
             if f"blk.{i}.ffn_gate_exps.weight" not in tensors]
    # llama.cpp renormalizes the top-k weights of every Qwen3-MoE (norm_topk_prob)
    norm = m.raw("{arch}.expert_weights_norm")
    cfg.update(num_experts=n, moe_intermediate_size=inter, mlp_only_layers=dense,
               decoder_sparse_step=1, norm_topk_prob=True if norm is None else bool(norm))
    _sliding(cfg, m, window)


def _mixtral(cfg: dict, m: _Meta, window: int | None, tensors: dict[str, RawTensor]) -> None:
    n, inter = _experts(cfg, m, tensors)
    cfg.update(num_local_experts=n, intermediate_size=inter, sliding_window=window)


def _gemma(cfg: dict, m: _Meta, window: int | None, tensors: dict[str, RawTensor]) -> None:
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


def _phi3(cfg: dict, m: _Meta, window: int | None, tensors: dict[str, RawTensor]) -> None:
    rope_dims = m.int("{arch}.rope.dimension_count", cfg["head_dim"])
    cfg["partial_rotary_factor"] = rope_dims / cfg["head_dim"]
    cfg["original_max_position_embeddings"] = m.int(
        "{arch}.rope.scaling.original_context_length", cfg["max_position_embeddings"])
    cfg["sliding_window"] = window


def _plain(cfg: dict, m: _Meta, window: int | None, tensors: dict[str, RawTensor]) -> None:
    if cfg["model_type"] == "llama":
        cfg["mlp_bias"] = False
    elif cfg["model_type"] == "mistral":
        cfg["sliding_window"] = window
    else:  # qwen2, qwen3: llama.cpp keeps no window; our writer's files may
        _sliding(cfg, m, window)


_FAMILY_CONFIG = {"llama": _plain, "mistral": _plain, "qwen2": _plain, "qwen3": _plain,
                  "qwen3_moe": _qwen3_moe, "mixtral": _mixtral, "gemma": _gemma,
                  "gemma2": _gemma, "gemma3_text": _gemma, "phi3": _phi3}


# ---------------------------------------------------------------- tensors under HF names

_BLK = re.compile(r"blk\.(\d+)\.(.+)")


def _hf_names(raw: RawTensor, family: Family, layers: int, where: str
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


def _info(raw: RawTensor, name: str, expert: int | None, family: Family,
          cfg: dict[str, Any]) -> TensorInfo:
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


def expected_shapes(cfg: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """name -> shape of every tensor the config's model may load (biases and the LM head
    included: ``required_names`` says which must be present)."""
    h, v, hd = cfg["hidden_size"], cfg["vocab_size"], cfg["head_dim"]
    q, kv = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd
    inter = cfg["intermediate_size"]
    out = {"model.embed_tokens.weight": (v, h), "lm_head.weight": (v, h),
           "model.norm.weight": (h,)}
    experts = cfg.get("num_experts") or cfg.get("num_local_experts") or 0
    moe = cfg.get("moe_intermediate_size", inter)
    dense = set(cfg.get("mlp_only_layers") or ())
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        for name in ("input_layernorm", "post_attention_layernorm",
                     "pre_feedforward_layernorm", "post_feedforward_layernorm"):
            out[f"{p}{name}.weight"] = (h,)
        for name, rows in (("q", q), ("k", kv), ("v", kv)):
            out[f"{p}self_attn.{name}_proj.weight"] = (rows, h)
            out[f"{p}self_attn.{name}_proj.bias"] = (rows,)
        out[f"{p}self_attn.o_proj.weight"] = (h, q)
        out[f"{p}self_attn.o_proj.bias"] = (h,)
        out[f"{p}self_attn.q_norm.weight"] = out[f"{p}self_attn.k_norm.weight"] = (hd,)
        out[f"{p}self_attn.qkv_proj.weight"] = (q + 2 * kv, h)
        out[f"{p}mlp.gate_up_proj.weight"] = (2 * inter, h)
        out[f"{p}mlp.gate_proj.weight"] = out[f"{p}mlp.up_proj.weight"] = (inter, h)
        out[f"{p}mlp.down_proj.weight"] = (h, inter)
        if experts and i not in dense:
            mlp = "block_sparse_moe" if cfg["model_type"] == "mixtral" else "mlp"
            out[f"{p}{mlp}.gate.weight"] = (experts, h)
            for e in range(experts):
                ex = f"{p}{mlp}.experts.{e}."
                for a, b, c in (("gate_proj", "up_proj", "down_proj"), ("w1", "w3", "w2")):
                    out[f"{ex}{a}.weight"] = out[f"{ex}{b}.weight"] = (moe, h)
                    out[f"{ex}{c}.weight"] = (h, moe)
    return out


def _check_tensors(tensors: dict[str, TensorInfo], cfg: dict[str, Any], where: str) -> None:
    """Every tensor of the shape the metadata implies; each layer has its attention and MLP."""
    expected = expected_shapes(cfg)
    for info in tensors.values():
        want = expected.get(info.name)
        if want is None:
            raise GGUFError(f"{where}: unexpected tensor {info.gguf_name!r} ({info.name}) for "
                            f"{cfg['architectures'][0]} with this metadata")
        if info.shape != want:
            raise GGUFError(
                f"{where}: tensor {info.gguf_name!r} has shape {list(info.shape)} but the "
                f"metadata implies {list(want)} (embedding_length {cfg['hidden_size']}, "
                f"head_count {cfg['num_attention_heads']}, head_count_kv "
                f"{cfg['num_key_value_heads']}, key_length {cfg['head_dim']}, "
                f"feed_forward_length {cfg['intermediate_size']})")
    for name in ("model.embed_tokens.weight", "model.norm.weight"):
        if name not in tensors:
            raise GGUFError(f"{where}: no {name} tensor")


def required_per_layer(arch: str, moe_layer: bool) -> tuple[str, ...]:
    """The GGUF tensors (``blk.N.`` suffixes) every layer of ``arch`` must have, as
    llama.cpp's loader requires them."""
    attn = ("attn_qkv.weight",) if arch == "phi3" else (
        "attn_q.weight", "attn_k.weight", "attn_v.weight")
    mlp = ("ffn_gate_inp.weight", "ffn_gate_exps.weight", "ffn_up_exps.weight",
           "ffn_down_exps.weight") if moe_layer else (
        ("ffn_up.weight", "ffn_down.weight") if arch == "phi3"
        else ("ffn_gate.weight", "ffn_up.weight", "ffn_down.weight"))
    extra = {"qwen2": ("attn_q.bias", "attn_k.bias", "attn_v.bias"),
             "qwen3": ("attn_q_norm.weight", "attn_k_norm.weight"),
             "qwen3moe": ("attn_q_norm.weight", "attn_k_norm.weight"),
             "gemma2": ("post_attention_norm.weight", "post_ffw_norm.weight"),
             "gemma3": ("post_attention_norm.weight", "post_ffw_norm.weight",
                        "attn_q_norm.weight", "attn_k_norm.weight")}.get(arch, ())
    return ("attn_norm.weight", "ffn_norm.weight", "attn_output.weight", *attn, *mlp, *extra)


def _check_layers(raw: dict[str, RawTensor], arch: str, layers: int, where: str) -> None:
    for i in range(layers):
        moe = f"blk.{i}.ffn_gate_exps.weight" in raw
        for suffix in required_per_layer(arch, moe):
            if f"blk.{i}.{suffix}" not in raw:
                raise GGUFError(f"{where}: layer {i} has no blk.{i}.{suffix} tensor "
                                f"(block_count is {layers})")


# ---------------------------------------------------------------- the model


# tokens llama.cpp's vocabulary treats as the end of generation, by spelling
END_OF_GENERATION = frozenset((
    "<|eot_id|>", "<|eom_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>",
    "<|end_of_text|>", "<|return|>", "<|call|>", "<EOT>", "[EOT]", "<end_of_utterance>",
    "<\uff5cend\u2581of\u2581sentence\uff5c>"))


class GGUFModel:
    """A checked GGUF file (``open_gguf``): its metadata, tensors under our checkpoint names
    and the config.json of the family; the file stays mapped until ``close``."""

    def __init__(self, path: Path, meta: dict[str, Any], raw: list[RawTensor],
                 version: int) -> None:
        self.path, self.metadata, self.version = path, meta, version
        self.where = str(path)
        self.gguf_arch, self.family = family_of(meta, raw, self.where)
        self.raw = {t.name: t for t in raw}
        self._file = open(path, "rb")  # noqa: SIM115 - closed by close()
        self._map = mmap.mmap(self._file.fileno(), 0, access=mmap.ACCESS_READ)
        extra = {name: self._floats(self.raw[name]) for name in _CONFIG_TENSORS
                 if name in self.raw}
        self._config = build_hf_config(meta, self.gguf_arch, self.family, self.raw, extra,
                                       self.where)
        tokens = _tokens(meta, self.where)
        if tokens is not None and len(tokens) != self._config["vocab_size"]:
            raise GGUFError(f"{self.where}: tokenizer.ggml.tokens has {len(tokens)} tokens but "
                            f"token_embd.weight has {self._config['vocab_size']} rows")
        self.tensors: dict[str, TensorInfo] = {}
        for t in raw:
            if t.name in _CONFIG_TENSORS:
                continue
            for name, expert in _hf_names(t, self.family, self._config["num_hidden_layers"],
                                          self.where):
                self.tensors[name] = _info(t, name, expert, self.family, self._config)
        _check_layers(self.raw, self.gguf_arch, self._config["num_hidden_layers"], self.where)
        _check_tensors(self.tensors, self._config, self.where)

    @property
    def architecture(self) -> str:
        """The HF ``architectures`` name we serve the file as (e.g. LlamaForCausalLM)."""
        return self.family.hf_arch

    def hf_config(self) -> dict[str, Any]:
        """config.json as transformers would write it for the family (a copy)."""
        return json.loads(json.dumps(self._config))

    def stop_ids(self) -> list[int]:
        """The tokens that end generation, as llama.cpp's vocabulary collects them: EOS,
        the end-of-turn / end-of-message ids, and the tokens spelled as one (old files
        name no EOT id)."""
        ids = [i for i in (self._config["eos_token_id"],) if i is not None]
        for name in ("eot", "eom"):
            value = self.metadata.get(f"tokenizer.ggml.{name}_token_id")
            if isinstance(value, int) and 0 <= value < self._config["vocab_size"]:
                ids.append(value)
        tokens = self.metadata.get("tokenizer.ggml.tokens") or []
        ids += [i for i, t in enumerate(tokens) if t in END_OF_GENERATION]
        return list(dict.fromkeys(ids))

    def data(self, info: TensorInfo) -> np.ndarray:
        """The tensor's raw blocks: a read-only uint8 view into the mapped file."""
        return np.frombuffer(self._map, dtype=np.uint8, count=info.nbytes, offset=info.offset)

    def _floats(self, raw: RawTensor) -> np.ndarray:
        if raw.ggml_type != GGMLQuantizationType.F32 or len(raw.dims) != 1:
            raise GGUFError(f"{self.where}: tensor {raw.name!r} must be a 1-D F32 tensor")
        return np.frombuffer(self._map, dtype="<f4", count=raw.dims[0], offset=raw.offset).copy()

    def close(self) -> None:
        """Close the file; the mapping goes with the last view ``data`` handed out."""
        try:
            self._map.close()
        except BufferError:  # views still alive: unmapped when they are collected
            pass
        self._file.close()

    def __enter__(self) -> GGUFModel:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def write_view(self, out: str | os.PathLike) -> Path:
        """config.json (with ``quantization_config`` naming this file), the tokenizer built
        from the file's metadata and generation_config.json, in ``out`` (created)."""
        out = Path(out)
        out.mkdir(parents=True, exist_ok=True)
        cfg = self.hf_config()
        cfg["quantization_config"] = {"quant_method": "gguf",
                                      "gguf_file": str(self.path.resolve())}
        _write_json(out / "config.json", cfg)
        _write_json(out / "generation_config.json",
                    {"bos_token_id": cfg["bos_token_id"], "eos_token_id": self.stop_ids(),
                     "pad_token_id": cfg["pad_token_id"]})
        write_tokenizer(self, out)
        return out


def _write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def write_tokenizer(model: GGUFModel, out: Path) -> None:
    """tokenizer.json and tokenizer_config.json (chat template, BOS / EOS) from the file's
    ``tokenizer.*`` metadata, built by transformers' GGUF tokenizer converter from the
    vocabulary's own type (``tokenizer.ggml.model``, ``.pre``), whatever the architecture."""
    if "tokenizer.ggml.tokens" not in model.metadata:
        raise GGUFError(f"{model.where}: no tokenizer in the file (tokenizer.ggml.tokens)")
    # seconds to import: only when a view is built
    from transformers import PreTrainedTokenizerFast
    from transformers.integrations.gguf import convert_gguf_tokenizer, get_gguf_tokenizer

    try:
        arch, vocab, settings = get_gguf_tokenizer(str(model.path))
        backend, extra = convert_gguf_tokenizer(arch, vocab)
        tok = PreTrainedTokenizerFast(tokenizer_object=backend, **{**settings, **extra})
    except Exception as e:  # noqa: BLE001 - whatever the file's vocabulary breaks, by name
        raise GGUFError(f"{model.where}: its tokenizer (tokenizer.ggml.model "
                        f"{model.metadata.get('tokenizer.ggml.model')!r}) cannot be built: "
                        f"{e}") from None
    tok.save_pretrained(str(out))
    # one place for the template and the limits: tokenizer_config.json, as hub models have it
    (out / "chat_template.jinja").unlink(missing_ok=True)
    path = out / "tokenizer_config.json"
    cfg = json.loads(path.read_text(encoding="utf-8"))
    for key in ("is_local", "local_files_only"):
        cfg.pop(key, None)
    template = model.metadata.get("tokenizer.chat_template")
    if isinstance(template, str):
        cfg["chat_template"] = template
    cfg["model_max_length"] = model.hf_config()["max_position_embeddings"]
    _write_json(path, cfg)


def open_gguf(path: str | os.PathLike) -> GGUFModel:
    """The GGUF file at ``path``, checked whole (see the module docstring); GGUFError naming
    the key or tensor otherwise."""
    path = Path(path)
    if not path.is_file():
        raise GGUFError(f"{path}: no such GGUF file")
    meta, raw, version = read_container(path)
    return GGUFModel(path, meta, raw, version)


VIEW_VERSION = 2  # bump whenever write_view writes something else: old views are not reused


def view_dir_for(path: str | os.PathLike) -> Path:
    """The cached view directory of the GGUF file at ``path`` (``write_view``), under
    $RADIXLM_CACHE_DIR or ~/.cache/radixlm: ``gguf/<digest of VIEW_VERSION, the path, size
    and mtime>``,
    private (0700), written in a temporary directory renamed into place, reused after."""
    path = Path(path).resolve()
    st = path.stat()
    key = hashlib.sha256(f"{VIEW_VERSION}\0{path}\0{st.st_size}\0{st.st_mtime_ns}".encode()
                         ).hexdigest()[:16]
    root = Path(os.environ.get("RADIXLM_CACHE_DIR") or Path.home() / ".cache" / "radixlm")
    view = root / "gguf" / key
    if (view / "config.json").is_file():
        return view
    view.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    tmp = Path(tempfile.mkdtemp(prefix=f".{key}-", dir=view.parent))  # 0700
    try:
        with open_gguf(path) as model:
            model.write_view(tmp)
        os.rename(tmp, view)
    except OSError:
        if not (view / "config.json").is_file():
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return view
