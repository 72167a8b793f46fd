"""Hugging Face quantized safetensors checkpoints (AWQ, GPTQ, compressed-tensors, FP8, W8A8)
read into ``QuantWeight`` (``radixlm/kernels/qweight.py``), exactly.

A linear ``prefix`` (``model.layers.0.self_attn.q_proj``, an MoE expert's
``model.layers.0.mlp.experts.3.up_proj`` alike) of logical weight ``W [n, k]`` is stored as:

    quant_method (tool)            tensors                                         -> kind
    awq (AutoAWQ GEMM)             qweight i32 [k, n/8]: 8 outputs a word, nibble  w4 + mins
                                   i holding column AWQ_ORDER[i]; qzeros i32
                                   [k/g, n/8] the same way; scales f16 [k/g, n]
    gptq (AutoGPTQ, GPTQModel)     qweight i32 [k*b/32, n]: packed along K, field  w4 / w8
                                   i = input row 32/b*r + i; qzeros i32 [G, n*b/32] + mins
                                   (v2; v1 "gptq": the words minus 0x11111111);
                                   scales [G, n]; g_idx i32 [k] (act-order)
    compressed-tensors             weight_packed i32 [n, ceil(k*b/32)] (q + 2^(b-1)  w4 / w8
      pack-quantized (W4A16)       along K); weight_shape [2]; weight_scale [n, G];  + mins
                                   weight_zero_point i32 [ceil(n*b/32), G] (asym);
                                   weight_g_idx i32 [k] (actorder group)
      int-quantized (W8A8)         weight i8 [n, k]; weight_scale [n, 1] | [1] |    w8
                                   [n, G]; input_scale (static, ignored)
      float-quantized (FP8)        weight f8e4m3 [n, k]; weight_scale [1] | [n, 1] | fp8
                                   [n/bn, k/bk] blocks | [n, G]
    fp8 (HF fine-grained: Qwen3-   weight f8e4m3 [n, k]; weight_scale_inv f32       fp8
      FP8, DeepSeek-V3)            [ceil(n/128), ceil(k/128)] (it multiplies); or
                                   per tensor weight_scale f32 []
    w8a8_int8 / w8a8_fp8 (SGLang)  weight i8 / f8e4m3 [n, k]; weight_scale [n, 1]   w8 / fp8

(G = ceil(k / g) groups.) Zero points become QuantWeight ``mins = -zero * scale`` (exact:
a 4- or 8-bit code times an f16 / bf16 scale fits a float32). Act-order ``g_idx`` becomes
``perm``: input features sorted by group, the stored columns in that order. Activation
quantization is the kernels' business: static input scales are ignored (computing with
unquantized or dynamically quantized activations is the more exact choice), asymmetric
activations are refused.

``scheme_for(hf_config, requested)`` detects the scheme (SGLang's ``--quantization`` names);
a loader then takes ``quantized_modules(shapes)`` from the safetensors headers, checks each
with ``logical_shape`` and reads it with ``read``; ``dense_tensors(shapes)`` stay float.
"""

from __future__ import annotations

import logging
import re
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

from radixlm.kernels.qweight import QuantWeight

logger = logging.getLogger(__name__)

TensorInfo = tuple[str, tuple[int, ...]]  # a safetensors header entry: (dtype, shape)
Getter = Callable[[str], torch.Tensor]

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
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i of a word holds output column AWQ_ORDER[i]
AWQ_REVERSE_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)  # column j sits in nibble AWQ_REVERSE_ORDER[j]
FLOATS = ("F16", "BF16", "F32")
CODE_DTYPES = {"w8": "I8", "fp8": "F8_E4M3"}


def _fail(name: str, got: TensorInfo | None, dtypes: tuple[str, ...],
          shape: tuple[int, ...]) -> ValueError:
    what = "missing" if got is None else f"{got[0]} {tuple(got[1])}"
    return ValueError(f"{name}: {what}, expected {'/'.join(dtypes)} {shape}")


def _expect(shapes: Mapping[str, TensorInfo], name: str, dtypes: tuple[str, ...],
            shape: tuple[int, ...]) -> None:
    """ValueError naming ``name`` unless the header holds it with that dtype and shape."""
    got = shapes.get(name)
    if got is None or got[0] not in dtypes or tuple(got[1]) != shape:
        raise _fail(name, got, dtypes, shape)


def _matrix(shapes: Mapping[str, TensorInfo], name: str, dtypes: tuple[str, ...]
            ) -> tuple[int, int]:
    got = shapes.get(name)
    if got is None or got[0] not in dtypes or len(got[1]) != 2 or min(got[1]) < 1:
        raise _fail(name, got, dtypes, ("rows", "cols"))  # type: ignore[arg-type]
    return int(got[1][0]), int(got[1][1])


def unpack_int32(packed: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """int32 words -> their ``32 // bits`` fields (field i at bits ``i*bits``, first),
    spread along ``dim``: ``[r, c]`` -> ``[r*f, c]`` (dim 0) or ``[r, c*f]`` (dim 1)."""
    f = 32 // bits
    shifts = torch.arange(0, 32, bits, dtype=torch.int32)
    p = packed.to(torch.int32)
    if dim == 0:
        v = (p.unsqueeze(1) >> shifts.view(1, f, 1)) & ((1 << bits) - 1)  # [r, f, c]
        return v.reshape(p.shape[0] * f, p.shape[1])
    v = (p.unsqueeze(2) >> shifts.view(1, 1, f)) & ((1 << bits) - 1)  # [r, c, f]
    return v.reshape(p.shape[0], p.shape[1] * f)


def input_pairs(rows: torch.Tensor) -> torch.Tensor:
    """Codes by input ``[k, n]`` -> QuantWeight w4 bytes ``[n, ceil(k/2)]`` (inputs 2j
    and 2j + 1 share a byte)."""
    if rows.shape[0] % 2:
        rows = torch.cat([rows, torch.zeros_like(rows[:1])])
    return (rows[0::2] | (rows[1::2] << 4)).T.contiguous()


def nibbles(data: torch.Tensor) -> torch.Tensor:
    """uint8 ``[r, c]`` -> its 4-bit fields ``[r, 2c]``, low nibble first."""
    return torch.stack((data & 15, data >> 4), dim=-1).reshape(data.shape[0], -1)


def word_bytes(words: torch.Tensor) -> torch.Tensor:
    """int32 ``[r, c]`` -> uint8 ``[r, 4c]``: a word's bytes least significant first, so
    field i of 4-bit fields sits in byte i // 2 (low nibble for even i), exactly the
    QuantWeight w4 byte of columns i and i + 1."""
    assert sys.byteorder == "little", "the packed words are read as little-endian bytes"
    w = words.to(torch.int32).contiguous()
    return w.view(torch.uint8).reshape(w.shape[0], -1)


def along_k(qweight: torch.Tensor) -> torch.Tensor:
    """GPTQ's ``qweight [k*b/32, n]`` (word r holds inputs ``32/b*r ..`` of output c) ->
    uint8 ``[n, k*b/8]``: each output's bytes in input order (a transpose of bytes)."""
    rows, n = qweight.shape
    return word_bytes(qweight).reshape(rows, n, 4).transpose(0, 1).reshape(n, rows * 4)


def act_order_perm(g_idx: torch.Tensor, k: int, group: int, name: str) -> torch.Tensor | None:
    """GPTQ's ``g_idx`` (the group of each input feature) as QuantWeight ``perm``: the input
    features sorted by group (stable), None when already in order. ValueError naming the
    tensor unless every group but the last holds exactly ``group`` features."""
    g = g_idx.to(torch.int64).reshape(-1)
    groups = -(-k // group)
    if g.numel() != k or int(g.min()) < 0 or int(g.max()) >= groups:
        raise ValueError(f"{name}: group indices must lie in 0..{groups - 1} for {k} inputs")
    perm = torch.argsort(g, stable=True)
    if not torch.equal(g[perm], torch.arange(k) // group):
        counts = torch.bincount(g, minlength=groups).tolist()
        raise ValueError(f"{name}: not an assignment of {k} inputs to groups of {group} "
                         f"(features per group: {counts})")
    return None if torch.equal(perm, torch.arange(k)) else perm


def _w4(data: torch.Tensor, k: int, zeros: torch.Tensor, scales: torch.Tensor, group: int,
        perm: torch.Tensor | None) -> QuantWeight:
    """w4 bytes ``data [n, >= ceil(k/2)]`` of unsigned codes in input order, ``zeros`` /
    ``scales [n, G]``: W = (q - z) * s; act-order ``perm`` puts the columns in its order."""
    data = data[:, : -(-k // 2)]
    if perm is not None:  # rows of [k, n] gather fast; the columns of [n, k] do not
        rows = nibbles(data)[:, :k].T.contiguous().index_select(0, perm)
        data = input_pairs(rows)
    s = scales.to(torch.float32)
    return QuantWeight("w4", data.shape[0], k, group, data.contiguous(), s.contiguous(),
                       (-zeros.to(torch.float32) * s).contiguous(), perm)


def _w8(codes: torch.Tensor, k: int, zeros: torch.Tensor | None, scales: torch.Tensor,
        group: int, perm: torch.Tensor | None) -> QuantWeight:
    """8-bit ``codes [n, >= k]`` in input order, int8 or uint8 stored plus 128 (then
    ``zeros`` are too): W = (q - z) * s."""
    codes = codes[:, :k]
    if codes.dtype == torch.uint8:  # q + 128 -> q: flip the top bit, reinterpret
        codes = (codes ^ 0x80).view(torch.int8)
        zeros = None if zeros is None else zeros.to(torch.int32) - 128
    if perm is not None:
        codes = codes[:, perm]
    s = scales.to(torch.float32).contiguous()
    mins = None
    if zeros is not None and bool((zeros != 0).any()):
        mins = (-zeros.to(torch.float32) * s).contiguous()
    return QuantWeight("w8", codes.shape[0], k, group, codes.contiguous(), s, mins, perm)


# ---------------------------------------------------------------- which modules are quantized


def _ct_match(prefix: str, pattern: str) -> bool:
    """compressed-tensors' target / ignore matching: ``re:`` a regex from the start, a
    class name (``Linear``) any linear, else the module's exact name."""
    if pattern.startswith("re:"):
        return re.match(pattern[3:], prefix) is not None
    return pattern == prefix or (pattern[:1].isupper() and "." not in pattern)


@dataclass(frozen=True)
class QuantScheme:
    """How one checkpoint stores its quantized linears (subclasses: one per layout).

    ``skip``: module names not converted; ``skip_mode`` how they match (``names``: AWQ's
    and FP8's ``modules_to_not_convert``, a run of whole dotted components of the module's
    name (``visual``, ``mlp.gate``, ``lm_head``), ``ct``: compressed-tensors' ``ignore`` with
    ``re:`` patterns, ``regex``: GPTQModel's ``dynamic`` ``-:`` keys); ``targets``:
    compressed-tensors' targets; ``lm_head``: whether the lm_head is quantized."""

    method: str
    kind: str
    group: int  # columns per scale group; 0 = the whole row
    skip: tuple[str, ...] = ()
    skip_mode: str = "names"
    targets: tuple[str, ...] = ()
    lm_head: bool = False

    def quantized(self, module_prefix: str) -> bool:
        """Whether the config quantizes the linear ``module_prefix`` (embeddings and norms
        never are; the lm_head only when the config says so)."""
        if module_prefix.rsplit(".", 1)[-1] == "lm_head" and not self.lm_head:
            return False
        if self.targets and not any(_ct_match(module_prefix, t) for t in self.targets):
            return False
        if self.skip_mode == "ct":
            return not any(_ct_match(module_prefix, p) for p in self.skip)
        if self.skip_mode == "regex":
            return not any(re.match(p, module_prefix) for p in self.skip)
        # whole dotted components: "mlp.gate" skips a router, not "mlp.gate_proj"
        return not any(re.search(rf"(^|\.){re.escape(p)}($|\.)", module_prefix)
                       for p in self.skip)

    # layout: the subclasses
    def tensor_suffixes(self) -> tuple[str, ...]:
        """The tensors of one quantized linear, its packed weight first."""
        raise NotImplementedError

    def optional_suffixes(self) -> tuple[str, ...]:
        """Suffixes in ``tensor_suffixes`` a checkpoint may leave out."""
        return ()

    def ignored_suffixes(self) -> tuple[str, ...]:
        """Tensors a quantized linear may carry that are dropped (static input scales)."""
        return ()

    def primary_dtypes(self) -> tuple[str, ...]:
        raise NotImplementedError

    def logical_shape(self, shapes: Mapping[str, TensorInfo], prefix: str,
                      get: Getter | None = None) -> tuple[int, int]:
        """``(n, k)`` of ``prefix`` from the safetensors headers (``shapes``: name ->
        (dtype, shape)), every tensor's dtype and shape checked: ValueError naming the
        tensor and what was expected. Only pack-quantized needs ``get`` (its 2-element
        ``weight_shape`` is the one place ``k`` is written)."""
        raise NotImplementedError

    def read(self, get: Getter, prefix: str, n: int, k: int) -> QuantWeight:
        """The linear ``prefix`` (checked by ``logical_shape``) as a QuantWeight."""
        raise NotImplementedError

    # the whole checkpoint
    def quantized_modules(self, shapes: Mapping[str, TensorInfo]) -> list[str]:
        """The prefixes whose packed weight is in the headers with a quantized dtype.
        ValueError when the config says such a module is not quantized."""
        primary = self.tensor_suffixes()[0]
        out = []
        for name, (dtype, _) in shapes.items():
            if name.endswith(primary) and dtype in self.primary_dtypes():
                prefix = name[: -len(primary)]
                if not self.quantized(prefix):
                    raise ValueError(f"{name}: stored quantized ({dtype}) but the "
                                     f"quantization_config leaves {prefix} unquantized")
                out.append(prefix)
        return sorted(out)

    def dense_tensors(self, shapes: Mapping[str, TensorInfo]) -> list[str]:
        """What stays float: every tensor not part of a quantized linear (embeddings,
        norms, biases, unquantized modules), the ignored activation scales left out.
        ValueError for a quantization tensor whose linear has no packed weight."""
        taken = set()
        for prefix in self.quantized_modules(shapes):
            taken.update(prefix + s for s in self.tensor_suffixes() + self.ignored_suffixes())
        primary, *parts = self.tensor_suffixes()
        dense = []
        for name in sorted(shapes):
            if name in taken or any(name.endswith(s) for s in self.ignored_suffixes()):
                continue
            orphan = next((s for s in parts if name.endswith(s)), None)
            if orphan:
                raise ValueError(f"{name}: no quantized {name[: -len(orphan)] + primary} "
                                 "in the checkpoint for it to belong to")
            dense.append(name)
        return dense


# ---------------------------------------------------------------- AWQ (AutoAWQ GEMM)


@dataclass(frozen=True)
class AwqScheme(QuantScheme):
    """AutoAWQ's GEMM layout (see the module docstring); no group tails (the format
    keeps ``k // g`` groups)."""

    def tensor_suffixes(self) -> tuple[str, ...]:
        return (".qweight", ".qzeros", ".scales")

    def primary_dtypes(self) -> tuple[str, ...]:
        return ("I32",)

    def logical_shape(self, shapes: Mapping[str, TensorInfo], prefix: str,
                      get: Getter | None = None) -> tuple[int, int]:
        k, words = _matrix(shapes, prefix + ".qweight", ("I32",))
        n, group = words * 8, self.group or k
        if k % group:
            raise ValueError(f"{prefix}.qweight: {k} input features are not a multiple of "
                             f"group_size {group}")
        _expect(shapes, prefix + ".qzeros", ("I32",), (k // group, words))
        _expect(shapes, prefix + ".scales", FLOATS, (k // group, n))
        return n, k

    def read(self, get: Getter, prefix: str, n: int, k: int) -> QuantWeight:
        order = torch.tensor(AWQ_REVERSE_ORDER)
        zeros = unpack_int32(get(prefix + ".qzeros"), 4, 1).view(-1, n // 8, 8)[:, :, order]
        scales = get(prefix + ".scales")  # [G, n]
        return _w4(awq_bytes(get(prefix + ".qweight")), k, zeros.reshape(-1, n).T, scales.T,
                   self.group or k, None)


def awq_bytes(qweight: torch.Tensor) -> torch.Tensor:
    """AWQ's ``qweight [k, n/8]`` -> QuantWeight w4 bytes ``[n, ceil(k/2)]``, on bytes:
    byte b of a word holds fields 2b and 2b+1, i.e. columns ``(0,4,1,5)[b]`` (low
    nibble) and ``(2,6,3,7)[b]`` (high); the low nibbles of input rows 2j and 2j+1 make
    one output byte, and so do the high ones."""
    if qweight.shape[0] % 2:  # an odd k (group_size -1): a zero input row pads the pair
        qweight = torch.cat([qweight, torch.zeros_like(qweight[:1])])
    k, words = qweight.shape
    b = word_bytes(qweight).view(k // 2, 2, words, 4)
    even, odd = b[:, 0], b[:, 1]  # input rows 2j, 2j+1: [k/2, words, 4]
    low = (even & 15) | (odd << 4)  # the columns of the low nibbles, by byte
    high = (even >> 4) | (odd & 0xF0)
    out = torch.empty(k // 2, words, 2, 4, dtype=torch.uint8)  # column 4h + q at [h, q]
    out[..., 0:2] = low.view(k // 2, words, 2, 2).transpose(-1, -2)  # byte b = 2q + h
    out[..., 2:4] = high.view(k // 2, words, 2, 2).transpose(-1, -2)
    return out.view(k // 2, words * 8).T.contiguous()


# ---------------------------------------------------------------- GPTQ (AutoGPTQ, GPTQModel)


@dataclass(frozen=True)
class GptqScheme(QuantScheme):
    """GPTQ's layout (see the module docstring): ``bits`` 4 or 8, ``desc_act``: act-order,
    ``g_idx`` then required. ``v1``: ``checkpoint_format: gptq``, whose qzeros words are
    the true ones minus 0x11111111 (0x01010101 at 8 bits), subtracted word-wise as
    GPTQModel converts: a zero point of 0 borrows from the next field, so the words are
    restored by adding it back (adding 1 to each field, as old kernels do, is wrong
    there)."""

    bits: int = 4
    v1: bool = True
    desc_act: bool = False

    def tensor_suffixes(self) -> tuple[str, ...]:
        return (".qweight", ".qzeros", ".scales", ".g_idx")

    def optional_suffixes(self) -> tuple[str, ...]:
        return () if self.desc_act else (".g_idx",)

    def primary_dtypes(self) -> tuple[str, ...]:
        return ("I32",)

    def logical_shape(self, shapes: Mapping[str, TensorInfo], prefix: str,
                      get: Getter | None = None) -> tuple[int, int]:
        per_word = 32 // self.bits
        rows, n = _matrix(shapes, prefix + ".qweight", ("I32",))
        k = rows * per_word
        if n % per_word:
            raise ValueError(f"{prefix}.qweight: {n} outputs are not a multiple of "
                             f"{per_word} (qzeros packs them {per_word} a word)")
        groups = -(-k // (self.group or k))
        _expect(shapes, prefix + ".qzeros", ("I32",), (groups, n // per_word))
        _expect(shapes, prefix + ".scales", FLOATS, (groups, n))
        if self.desc_act or prefix + ".g_idx" in shapes:
            _expect(shapes, prefix + ".g_idx", ("I32", "I64"), (k,))
        return n, k

    def read(self, get: Getter, prefix: str, n: int, k: int) -> QuantWeight:
        group = self.group or k
        data = along_k(get(prefix + ".qweight"))  # [n, k*bits/8]
        qzeros = get(prefix + ".qzeros")
        if self.v1:  # undo v2 -> v1's word-wise subtraction, carries included
            words = qzeros.to(torch.int64) + sum(1 << i for i in range(0, 32, self.bits))
            qzeros = (words & 0xFFFFFFFF) - ((words & 0x80000000) << 1)  # back in int32
        zeros = unpack_int32(qzeros, self.bits, 1).T  # [n, G]
        scales = get(prefix + ".scales").T
        perm = None  # without desc_act, g_idx is i // group (vLLM ignores it too)
        if self.desc_act:
            perm = act_order_perm(get(prefix + ".g_idx"), k, group, prefix + ".g_idx")
        if self.bits == 4:
            return _w4(data, k, zeros, scales, group, perm)
        return _w8(data, k, zeros, scales, group, perm)


# ---------------------------------------------------------------- compressed-tensors packed


@dataclass(frozen=True)
class PackedScheme(QuantScheme):
    """compressed-tensors ``pack-quantized`` (W4A16, W8A16): signed codes stored plus
    ``2^(bits-1)``, packed densely along K; ``strategy`` group or channel."""

    bits: int = 4
    symmetric: bool = True
    g_idx: bool = False  # actorder "group": weight_g_idx stored

    def tensor_suffixes(self) -> tuple[str, ...]:
        return ((".weight_packed", ".weight_scale", ".weight_shape")
                + (() if self.symmetric else (".weight_zero_point",))
                + ((".weight_g_idx",) if self.g_idx else ()))

    def primary_dtypes(self) -> tuple[str, ...]:
        return ("I32",)

    def logical_shape(self, shapes: Mapping[str, TensorInfo], prefix: str,
                      get: Getter | None = None) -> tuple[int, int]:
        n, words = _matrix(shapes, prefix + ".weight_packed", ("I32",))
        _expect(shapes, prefix + ".weight_shape", ("I64", "I32"), (2,))
        assert get is not None, "pack-quantized: logical_shape reads weight_shape (get)"
        rows, k = (int(v) for v in get(prefix + ".weight_shape").tolist())
        if rows != n or k < 1 or words != -(-k * self.bits // 32):
            raise ValueError(f"{prefix}.weight_shape: {[rows, k]} does not match "
                             f"{prefix}.weight_packed {(n, words)}")
        groups = -(-k // (self.group or k))
        _expect(shapes, prefix + ".weight_scale", FLOATS, (n, groups))
        if not self.symmetric:
            _expect(shapes, prefix + ".weight_zero_point", ("I32",),
                    (-(-n * self.bits // 32), groups))
        if self.g_idx:
            _expect(shapes, prefix + ".weight_g_idx", ("I32", "I64"), (k,))
        return n, k

    def read(self, get: Getter, prefix: str, n: int, k: int) -> QuantWeight:
        group, offset = self.group or k, 1 << (self.bits - 1)
        data = word_bytes(get(prefix + ".weight_packed"))  # codes + offset along K
        scales = get(prefix + ".weight_scale")
        if self.symmetric:
            zeros = torch.full(scales.shape, offset, dtype=torch.int32)
        else:  # packed along the outputs, stored plus offset like the codes
            zeros = unpack_int32(get(prefix + ".weight_zero_point"), self.bits, 0)[:n]
        perm = None
        if self.g_idx:
            perm = act_order_perm(get(prefix + ".weight_g_idx"), k, group,
                                  prefix + ".weight_g_idx")
        if self.bits == 4:
            return _w4(data, k, zeros, scales, group, perm)
        return _w8(data, k, zeros, scales, group, perm)


# ---------------------------------------------------------------- one byte a weight


@dataclass(frozen=True)
class UnpackedScheme(QuantScheme):
    """int8 or FP8 codes ``weight [n, k]`` with a float scale per ``strategy``: tensor,
    channel, group (``group``) or block (``block`` rows x ``group`` columns, the scale
    ``scale_suffix``: FP8's ``weight_scale_inv``); int8 may carry a zero point."""

    strategy: str = "channel"
    block: int = 0
    scale_suffix: str = ".weight_scale"
    zero_point: bool = False
    static_input: bool = False

    def tensor_suffixes(self) -> tuple[str, ...]:
        return (".weight", self.scale_suffix) + ((".weight_zero_point",)
                                                 if self.zero_point else ())

    def ignored_suffixes(self) -> tuple[str, ...]:
        return (".input_scale",) if self.static_input else ()

    def primary_dtypes(self) -> tuple[str, ...]:
        return (CODE_DTYPES[self.kind],)

    def scale_shape(self, n: int, k: int) -> tuple[int, ...]:
        if self.strategy == "channel":
            return (n, 1)
        if self.strategy == "group":
            return (n, -(-k // self.group))
        if self.strategy == "block":
            return (-(-n // self.block), -(-k // self.group))
        return (1,)

    def logical_shape(self, shapes: Mapping[str, TensorInfo], prefix: str,
                      get: Getter | None = None) -> tuple[int, int]:
        n, k = _matrix(shapes, prefix + ".weight", self.primary_dtypes())
        want = self.scale_shape(n, k)
        for suffix, dtypes in ((self.scale_suffix, FLOATS), (".weight_zero_point", ("I8",))):
            if suffix == ".weight_zero_point" and not self.zero_point:
                continue
            got = shapes.get(prefix + suffix)
            # a per-tensor scale is written as [] or [1]; a channel one as [n] too
            alike = {(1,): ((), (1,)), (n, 1): ((n, 1), (n,))}.get(want, (want,))
            if got is None or got[0] not in dtypes or tuple(got[1]) not in alike:
                raise _fail(prefix + suffix, got, dtypes, want)
        return n, k

    def read(self, get: Getter, prefix: str, n: int, k: int) -> QuantWeight:
        codes = get(prefix + ".weight")
        group = self.group if self.strategy in ("group", "block") else k
        groups = -(-k // group)

        def rows(t: torch.Tensor) -> torch.Tensor:  # the scale layout -> [n, groups]
            t = t.to(torch.float32)
            if self.strategy == "block":
                return t.repeat_interleave(self.block, dim=0)[:n]
            return t.reshape(-1, groups).expand(n, groups)

        scales = rows(get(prefix + self.scale_suffix))
        if self.kind == "fp8":
            return QuantWeight("fp8", n, k, group, codes.contiguous(), scales.contiguous())
        zeros = rows(get(prefix + ".weight_zero_point")) if self.zero_point else None
        return _w8(codes, k, zeros, scales, group, None)


# ---------------------------------------------------------------- quantization_config


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
