"""How Hugging Face quantized safetensors checkpoints (AWQ, GPTQ, compressed-tensors, FP8,
W8A8) store a linear: one ``QuantScheme`` a layout, read into ``QuantWeight``
(``radixlm/kernels/qweight.py``), exactly.

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

``scheme_for`` (``hf_formats.py``) builds the scheme from the quantization_config;
a loader then takes ``quantized_modules(shapes)`` from the safetensors headers, checks each
with ``logical_shape`` and reads it with ``read``; ``dense_tensors(shapes)`` stay float.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

from radixlm.kernels.qweight import QuantWeight
from radixlm.runtime.executor.quant.hf_packing import (
    AWQ_REVERSE_ORDER,
    act_order_perm,
    along_k,
    awq_bytes,
    unpack_int32,
    w4_weight,
    w8_weight,
    word_bytes,
)

TensorInfo = tuple[str, tuple[int, ...]]  # a safetensors header entry: (dtype, shape)
Getter = Callable[[str], torch.Tensor]
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
        return w4_weight(awq_bytes(get(prefix + ".qweight")), k, zeros.reshape(-1, n).T,
                         scales.T, self.group or k, None)


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
            return w4_weight(data, k, zeros, scales, group, perm)
        return w8_weight(data, k, zeros, scales, group, perm)


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
            return w4_weight(data, k, zeros, scales, group, perm)
        return w8_weight(data, k, zeros, scales, group, perm)


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
        return w8_weight(codes, k, zeros, scales, group, None)


