"""Quantized Hugging Face checkpoints written from a float one, in the layouts the real
tools write: AutoAWQ (GEMM), GPTQModel / AutoGPTQ (v1 and v2 zero points, act-order),
compressed-tensors (``pack-quantized`` W4A16, ``int-quantized`` W8A8, ``float-quantized``
FP8 per tensor / per channel) and Hugging Face's fine-grained FP8 (128x128 blocks).

Round-to-nearest with each tool's scale and zero-point rules, not the tools' calibration
(GPTQ's Hessian, AWQ's activation search): the files are what matters here, and they are
byte-for-byte what the tools pack for the same codes (the tests check pack-quantized against
compressed-tensors' own compressor and AWQ against AutoAWQ's unpacker where installed).

``quantize_linear(fmt, w, **options)`` returns one linear's tensors (by suffix) and the
weight they stand for, dequantized in float32 (the readers' oracle);
``write_quantized(src, out, fmt, **options)`` converts a model directory (every 2-D
``.weight`` under ``model.layers.`` but MoE routers; lm_head and embeddings stay float)
and returns those dequantized weights by tensor name.

This packing is written apart from the reader (``runtime/executor/quant/hf_layouts.py`` and
``hf_packing.py``) on purpose: a test that reads what the same code wrote could not catch
a shared mistake.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # AutoAWQ: word nibble i <- output column AWQ_ORDER[i]
FP8_MAX = 448.0
FORMATS = ("awq", "gptq", "w4a16", "w8a8-int8", "fp8-block", "fp8-tensor", "fp8-channel")


@dataclass
class QuantizedLinear:
    """One linear's checkpoint tensors (by suffix) and the weight they encode."""

    tensors: dict[str, torch.Tensor]
    dequantized: torch.Tensor  # float32 [n, k]


def pack_rows_int32(values: torch.Tensor, bits: int, order: tuple[int, ...] | None = None
                    ) -> torch.Tensor:
    """``[r, c]`` small unsigned ints -> int32 ``[r, ceil(c*bits/32)]``: word w holds
    columns ``w*f .. w*f+f-1`` (f = 32 // bits), column ``w*f + order[i]`` at bits
    ``i*bits`` (AutoGPTQ's / compressed-tensors' sequential order by default)."""
    f = 32 // bits
    order = order or tuple(range(f))
    r, c = values.shape
    v = torch.zeros(r, -(-c // f) * f, dtype=torch.int32)
    v[:, :c] = values.to(torch.int32)
    v = v.view(r, -1, f)
    out = torch.zeros(r, v.shape[1], dtype=torch.int32)
    for i in range(f):  # int32 shifts wrap into the sign bit, as the tools' do
        out |= v[:, :, order[i]] << (bits * i)
    return out


def _groups(k: int, group: int) -> torch.Tensor:
    """The group of each input; ``group`` -1 (the tools' spelling) or 0: one per row."""
    return torch.arange(k) // (group if group > 0 else k)


def _act_order(w: torch.Tensor, group: int, desc_act: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(g_idx [k] int32, group of each input in input order; perm). Act-order quantizes
    the inputs by decreasing importance (column norm standing in for GPTQ's Hessian
    diagonal), so a group gathers inputs from all over the row."""
    k = w.shape[1]
    perm = torch.argsort(w.norm(dim=0), descending=True, stable=True) if desc_act \
        else torch.arange(k)
    g_idx = torch.empty(k, dtype=torch.int32)
    g_idx[perm] = _groups(k, group).to(torch.int32)
    return g_idx, perm


def _group_minmax(w: torch.Tensor, g_idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row and group: (min, max) over the inputs ``g_idx`` puts in it, [n, G]."""
    groups = int(g_idx.max()) + 1
    idx = g_idx.long().expand_as(w)
    lo = torch.full((w.shape[0], groups), float("inf")).scatter_reduce(1, idx, w, "amin")
    hi = torch.full((w.shape[0], groups), float("-inf")).scatter_reduce(1, idx, w, "amax")
    return lo, hi


def _asym_params(lo: torch.Tensor, hi: torch.Tensor, maxq: int, scale_dtype: torch.dtype
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """GPTQ / AWQ min-max: range including 0, zero = round(-min / scale)."""
    lo, hi = lo.clamp(max=0), hi.clamp(min=0)
    scale = ((hi - lo) / maxq).clamp(min=1e-5).to(scale_dtype).float()
    zero = torch.round(-lo / scale).clamp(0, maxq)
    return scale, zero


def _quantize(w: torch.Tensor, g_idx: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor,
              lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes ``clamp(round(w / s) + z)`` in input order, and ``(q - z) * s`` in float32."""
    s, z = scale[:, g_idx.long()], zero[:, g_idx.long()]
    q = torch.clamp(torch.round(w / s) + z, lo, hi)
    return q.to(torch.int32), (q - z) * s


def awq(w: torch.Tensor, group: int = 128) -> QuantizedLinear:
    """AutoAWQ GEMM (``WQLinear_GEMM.from_linear``): asymmetric 4-bit, fp16 scales."""
    n, k = w.shape
    g_idx = _groups(k, group)
    scale, zero = _asym_params(*_group_minmax(w, g_idx), 15, torch.float16)
    q, deq = _quantize(w, g_idx, scale, zero, 0, 15)
    return QuantizedLinear({
        ".qweight": pack_rows_int32(q.T, 4, AWQ_ORDER),  # [k, n/8]
        ".qzeros": pack_rows_int32(zero.T, 4, AWQ_ORDER),  # [k/g, n/8]
        ".scales": scale.T.to(torch.float16).contiguous(),  # [k/g, n]
    }, deq)


def gptq(w: torch.Tensor, group: int = 128, bits: int = 4, sym: bool = True,
         desc_act: bool = False, checkpoint_format: str = "gptq") -> QuantizedLinear:
    """AutoGPTQ / GPTQModel ``QuantLinear.pack``: codes packed along K, zero points along
    N; ``checkpoint_format`` "gptq" (v1): the qzeros words minus 0x11111111 (0x01010101 at
    8 bits), word-wise as GPTQModel's v2 -> v1 conversion does (a zero of 0 borrows)."""
    maxq = (1 << bits) - 1
    g_idx, _ = _act_order(w, group, desc_act)
    lo, hi = _group_minmax(w, g_idx)
    if sym:
        amax = torch.maximum(-lo.clamp(max=0), hi.clamp(min=0))
        scale = (2 * amax / maxq).clamp(min=1e-5).to(torch.float16).float()
        zero = torch.full_like(scale, (maxq + 1) // 2)
    else:
        scale, zero = _asym_params(lo, hi, maxq, torch.float16)
    q, deq = _quantize(w, g_idx, scale, zero, 0, maxq)
    qzeros = pack_rows_int32(zero.T, bits)  # [G, n*bits/32]
    if checkpoint_format == "gptq":
        ones = sum(1 << i for i in range(0, 32, bits))
        qzeros = (qzeros.to(torch.int64) - ones).to(torch.int32)  # wraps like the int32 op
    return QuantizedLinear({
        ".qweight": pack_rows_int32(q, bits).T.contiguous(),  # [k*bits/32, n]
        ".qzeros": qzeros,
        ".scales": scale.T.to(torch.float16).contiguous(),  # [G, n]
        ".g_idx": g_idx,
    }, deq)


def w4a16(w: torch.Tensor, group: int = 128, bits: int = 4, sym: bool = True,
          actorder: bool = False, scale_dtype: torch.dtype = torch.bfloat16
          ) -> QuantizedLinear:
    """compressed-tensors ``pack-quantized``: signed codes (minmax observer: symmetric
    scale = absmax / ((qmax - qmin) / 2)), plus 2^(bits-1), packed along K."""
    n, k = w.shape
    qmin, qmax = -(1 << (bits - 1)), (1 << (bits - 1)) - 1
    g_idx, _ = _act_order(w, group, actorder)
    lo, hi = _group_minmax(w, g_idx)
    lo, hi = lo.clamp(max=0), hi.clamp(min=0)
    if sym:
        scale = (torch.maximum(-lo, hi) / ((qmax - qmin) / 2)).clamp(min=1e-5)
        scale = scale.to(scale_dtype).float()
        zero = torch.zeros_like(scale)
    else:
        scale = ((hi - lo) / (qmax - qmin)).clamp(min=1e-5).to(scale_dtype).float()
        zero = torch.round(qmin - lo / scale).clamp(qmin, qmax)
    q, deq = _quantize(w, g_idx, scale, zero, qmin, qmax)
    tensors = {
        ".weight_packed": pack_rows_int32(q - qmin, bits),  # [n, ceil(k*bits/32)]
        ".weight_scale": scale.to(scale_dtype),  # [n, G]
        ".weight_shape": torch.tensor([n, k], dtype=torch.int64),
    }
    if not sym:  # packed along the outputs (packed_dim=0): [ceil(n*bits/32), G]
        tensors[".weight_zero_point"] = pack_rows_int32((zero - qmin).T, bits).T.contiguous()
    if actorder:
        tensors[".weight_g_idx"] = g_idx
    return QuantizedLinear(tensors, deq)


def w8a8_int8(w: torch.Tensor, scale_dtype: torch.dtype = torch.bfloat16) -> QuantizedLinear:
    """compressed-tensors ``int-quantized`` W8A8: symmetric per-channel int8."""
    scale = (w.abs().amax(dim=1, keepdim=True) / 127.5).clamp(min=1e-5).to(scale_dtype)
    q = torch.clamp(torch.round(w / scale.float()), -128, 127)
    return QuantizedLinear({".weight": q.to(torch.int8), ".weight_scale": scale},
                           q * scale.float())


def _fp8(w: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    q = (w / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q, q.float() * scale


def fp8_block(w: torch.Tensor, block: tuple[int, int] = (128, 128)) -> QuantizedLinear:
    """Hugging Face fine-grained FP8 (DeepSeek-V3, Qwen3-FP8): one float32 scale per
    ``block`` tile, stored as ``weight_scale_inv`` (it multiplies)."""
    n, k = w.shape
    bn, bk = block
    rows, cols = torch.arange(n) // bn, torch.arange(k) // bk
    tiles = torch.zeros(-(-n // bn), -(-k // bk))
    idx = (rows[:, None] * tiles.shape[1] + cols[None, :]).reshape(-1)
    tiles = tiles.reshape(-1).scatter_reduce(0, idx, w.abs().reshape(-1), "amax")
    scale = (tiles.reshape(-(-n // bn), -1) / FP8_MAX).clamp(min=1e-12)
    q, deq = _fp8(w, scale[rows][:, cols])
    return QuantizedLinear({".weight": q, ".weight_scale_inv": scale}, deq)


def fp8_scaled(w: torch.Tensor, per_channel: bool,
               scale_dtype: torch.dtype = torch.float32) -> QuantizedLinear:
    """compressed-tensors ``float-quantized``: per tensor (the FP8 preset: a static
    ``input_scale`` too) or per channel (FP8_DYNAMIC)."""
    amax = w.abs().amax(dim=1, keepdim=True) if per_channel else w.abs().amax().reshape(1)
    scale = (amax / FP8_MAX).clamp(min=1e-12).to(scale_dtype)
    q, deq = _fp8(w, scale.float())
    tensors = {".weight": q, ".weight_scale": scale}
    if not per_channel:
        tensors[".input_scale"] = torch.ones(1, dtype=scale_dtype)
    return QuantizedLinear(tensors, deq)


QUANTIZERS: dict[str, Callable[..., QuantizedLinear]] = {
    "awq": awq, "gptq": gptq, "w4a16": w4a16, "w8a8-int8": w8a8_int8, "fp8-block": fp8_block,
    "fp8-tensor": lambda w: fp8_scaled(w, per_channel=False),
    "fp8-channel": lambda w: fp8_scaled(w, per_channel=True),
}


def quantize_linear(fmt: str, w: torch.Tensor, **options: object) -> QuantizedLinear:
    """One float weight ``[n, k]`` in format ``fmt`` (see FORMATS; options as each
    function's keywords)."""
    if fmt not in QUANTIZERS:
        raise ValueError(f"fmt must be one of {FORMATS}, got {fmt!r}")
    return QUANTIZERS[fmt](w.to(torch.float32), **options)


def _ct_config(fmt: str, weights: dict, acts: dict | None) -> dict:
    """compressed-tensors' QuantizationConfig as ``model_dump`` writes it (0.20)."""
    args = {"num_bits": 8, "type": "int", "symmetric": True, "group_size": None,
            "strategy": "channel", "block_structure": None, "dynamic": False,
            "actorder": None, "observer": "minmax", "observer_kwargs": {}}
    return {
        "config_groups": {"group_0": {
            "targets": ["Linear"], "weights": {**args, **weights},
            "input_activations": None if acts is None else {**args, "observer": None,
                                                            **acts},
            "output_activations": None, "format": None}},  # mixed-precision sets it
        "format": fmt, "global_compression_ratio": None, "ignore": ["lm_head"],
        "kv_cache_scheme": None, "quant_method": "compressed-tensors",
        "quantization_status": "compressed", "sparsity_config": {}, "transform_config": {},
    }


def quantization_config(fmt: str, **options: object) -> dict:
    """The ``quantization_config`` the real tool writes into config.json for ``fmt``."""
    group = options.get("group", 128)
    if fmt == "awq":
        return {"bits": 4, "group_size": group, "modules_to_not_convert": None,
                "quant_method": "awq", "version": "gemm", "zero_point": True}
    if fmt == "gptq":  # GPTQModel's to_dict (AutoGPTQ's lacks pack_dtype and meta)
        return {"bits": options.get("bits", 4), "group_size": group,
                "desc_act": options.get("desc_act", False), "sym": options.get("sym", True),
                "lm_head": False, "quant_method": "gptq", "pack_dtype": "int32",
                "checkpoint_format": options.get("checkpoint_format", "gptq"),
                "meta": {"quantizer": ["radixlm.tiny_quant"], "damp_percent": 0.05,
                         "static_groups": False, "true_sequential": True}}
    if fmt == "w4a16":
        return _ct_config("pack-quantized", {  # group -1: per channel
            "num_bits": options.get("bits", 4), "group_size": group if group > 0 else None,
            "strategy": "group" if group > 0 else "channel",
            "symmetric": options.get("sym", True),
            "actorder": "group" if options.get("actorder") else None}, None)
    if fmt == "w8a8-int8":
        return _ct_config("int-quantized", {}, {"strategy": "token", "dynamic": True})
    if fmt == "fp8-block":
        return {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                "weight_block_size": list(options.get("block", (128, 128)))}
    fp8 = {"type": "float", "strategy": "tensor" if fmt == "fp8-tensor" else "channel"}
    acts = ({"type": "float", "strategy": "tensor", "dynamic": False}
            if fmt == "fp8-tensor" else {"type": "float", "strategy": "token", "dynamic": True})
    return _ct_config("float-quantized", fp8, acts)


def quantizes(name: str, tensor: torch.Tensor) -> bool:
    """Whether the writers quantize this checkpoint tensor: a 2-D linear weight inside
    the decoder layers, but not an MoE router (``mlp.gate``, ``block_sparse_moe.gate``)."""
    return (name.startswith("model.layers.") and name.endswith(".weight")
            and tensor.dim() == 2 and not name.endswith(".gate.weight"))


def write_quantized(src: str | Path, out: str | Path, fmt: str, **options: object
                    ) -> dict[str, torch.Tensor]:
    """Write ``src`` (a float HF model directory) to ``out`` in format ``fmt``: config.json
    with its quantization_config, model.safetensors with the tool's tensor names, dtypes
    and layouts, the tokenizer files copied. Returns each quantized weight's float32
    dequantization by its float tensor name."""
    from safetensors.torch import load_file, save_file

    src, out = Path(src), Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tensors: dict[str, torch.Tensor] = {}
    for shard in sorted(src.glob("*.safetensors")):
        tensors.update(load_file(str(shard)))
    written: dict[str, torch.Tensor] = {}
    dequantized: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        if not quantizes(name, t):
            written[name] = t
            continue
        prefix = name[: -len(".weight")]
        q = quantize_linear(fmt, t, **options)
        written.update({prefix + suffix: v.contiguous() for suffix, v in q.tensors.items()})
        dequantized[name] = q.dequantized
    save_file(written, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = quant = quantization_config(fmt, **options)
    routers = sorted({n.split(".")[-3] for n in tensors if n.endswith(".gate.weight")})
    if "ignore" in quant:  # llm-compressor's MoE recipes leave the routers out
        quant["ignore"] += [f"re:.*{parent}.gate$" for parent in routers]
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    for f in src.iterdir():
        if f.is_file() and f.name != "config.json" and "safetensors" not in f.name:
            shutil.copy2(f, out / f.name)
    return dequantized
