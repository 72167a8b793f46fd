"""MXFP4 weights (OCP Microscaling: FP4 E2M1 elements sharing one E8M0 scale per block of
32), as gpt-oss checkpoints hold their experts, dequantized at load.

A tensor ``W`` of logical shape ``[..., K]`` is stored as two:

    W_blocks  uint8 [..., K / 32, 16]   two E2M1 codes a byte, element 2i in the low nibble
    W_scales  uint8 [..., K / 32]       the block's power of two, biased by 127

    W[..., 32 g + j] = E2M1[code j of block g] * 2 ** (scale[g] - 127)

E2M1 codes: bit 3 the sign, bits 0-2 index ``0, 0.5, 1, 1.5, 2, 3, 4, 6``. The loader
(``weights.py``) sees the pair as one tensor ``W_blocks`` of the logical shape and reads a
tensor-parallel rank's slice of both (along K: whole blocks only). ``quantize`` is the
float64 reference packer the tests (and nothing else) use.

Twice an E2M1 value is an integer (0, +-1, +-2, +-3, +-4, +-6, +-8, +-12), so a block is
exactly a ``QuantWeight`` of kind w8 (``kernels/qweight.py``): those integers as int8 codes,
group 32, scale ``2 ** (scale - 128)`` (``quant_weights``; ggml's ``kvalues_mxfp4`` and
``e8m0_to_fp32_half``). The CPU kernels pack codes in -12..12 as w6, 0.8 bytes a weight
(``kernels/quant_linear.py``): what gpt-oss's experts keep on a CPU
(``executor/quant/mxfp4_source.py``) instead of 2 (bf16) or 4 (float32) dequantized.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from radixlm.kernels.qweight import QuantWeight

BLOCK = 32  # elements per scale
BLOCKS, SCALES = "_blocks", "_scales"
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
_VALUES = torch.tensor(E2M1 + tuple(-v for v in E2M1), dtype=torch.float64)  # by code
_TWICE = (2 * _VALUES).to(torch.int8)  # by code: 0, 1, 2, 3, 4, 6, 8, 12, 0, -1, ...


def logical_shapes(shapes: dict[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
    """Checkpoint shapes with each ``X_blocks`` / ``X_scales`` pair as ``X_blocks`` of the
    dequantized shape; ValueError naming a lone or misshapen half."""
    out = {}
    for name, shape in shapes.items():
        if name.endswith(SCALES) and name.removesuffix(SCALES) + BLOCKS in shapes:
            continue
        if name.endswith(BLOCKS):
            scales = shapes.get(name.removesuffix(BLOCKS) + SCALES)
            if scales is None or len(shape) < 2 or shape[-1] != BLOCK // 2 \
                    or tuple(shape[:-1]) != tuple(scales):
                raise ValueError(f"MXFP4 tensor {name} {shape} needs scales of shape "
                                 f"{tuple(shape[:-1])} and 16 bytes a block, got {scales}")
            shape = (*shape[:-2], shape[-2] * BLOCK)
        out[name] = tuple(shape)
    return out


def dequantize(blocks: torch.Tensor, scales: torch.Tensor,
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``[..., G, 16]`` uint8 codes and ``[..., G]`` uint8 scales -> ``[..., G * 32]``."""
    assert blocks.shape[:-1] == scales.shape and blocks.shape[-1] == BLOCK // 2, (
        f"blocks {tuple(blocks.shape)} vs scales {tuple(scales.shape)}")
    values = _VALUES.to(torch.float32)
    codes = torch.stack((blocks & 0x0F, blocks >> 4), dim=-1).long()  # [..., G, 16, 2]
    w = values[codes].flatten(-2)  # [..., G, 32], element 2i from the low nibble
    w = torch.ldexp(w, scales.to(torch.int32)[..., None] - 127)
    return w.flatten(-2).to(dtype)


def quant_weights(blocks: torch.Tensor, scales: torch.Tensor) -> list[QuantWeight]:
    """Stacked ``[E, N, G, 16]`` codes and ``[E, N, G]`` scales -> E ``QuantWeight`` s of
    ``[N, G * 32]`` (w8, group 32), each equal to ``dequantize`` exactly: codes twice the
    E2M1 values, scales ``2 ** (scale - 128)`` (every product exact in float32)."""
    assert blocks.dim() == 4 and blocks.shape[:-1] == scales.shape \
        and blocks.shape[-1] == BLOCK // 2, f"blocks {tuple(blocks.shape)} vs scales " \
        f"{tuple(scales.shape)}"
    experts, n, groups, _ = blocks.shape
    halves = torch.pow(2.0, scales.double() - 128).float()  # 2^-128 is a float32 subnormal
    out = []
    for e in range(experts):  # one expert's int64 indices at a time (8 bytes a weight)
        nibbles = torch.stack((blocks[e] & 0x0F, blocks[e] >> 4), dim=-1).long()
        codes = _TWICE[nibbles].reshape(n, groups * BLOCK)  # element 2i: the low nibble
        out.append(QuantWeight("w8", n, groups * BLOCK, BLOCK, codes, halves[e].clone()))
    return out


def read(blocks_file: Any, scales_file: Any, name: str, index: tuple) -> torch.Tensor:
    """The slice ``index`` (a tuple of slices over the logical dims) of the MXFP4 tensor
    ``name`` (``X_blocks``) from open safetensors files, dequantized to float32."""
    scales_name = name.removesuffix(BLOCKS) + SCALES
    ndim = len(blocks_file.get_slice(name).get_shape()) - 1
    index = tuple(index) + (slice(None),) * (ndim - len(index))
    last = index[-1]
    if last != slice(None):  # along K: whole blocks of 32
        if last.start % BLOCK or last.stop % BLOCK:
            raise ValueError(f"{name}: a tensor-parallel slice [{last.start}, {last.stop}) of "
                             f"an MXFP4 dim must cover whole blocks of {BLOCK}")
        index = (*index[:-1], slice(last.start // BLOCK, last.stop // BLOCK))
    blocks = blocks_file.get_slice(name)[index]
    scales = scales_file.get_slice(scales_name)[index]
    return dequantize(blocks, scales)


def quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference packer, in float64: each block of 32 takes the scale
    ``2 ** (floor(log2(amax)) - 2)`` (E2M1's largest power of two is 2^2), each element the
    nearest E2M1 value of ``w / scale`` (ties to the smaller magnitude; beyond 6: 6);
    ``(blocks, scales)`` as ``dequantize`` reads them. Tests only."""
    assert w.shape[-1] % BLOCK == 0, f"last dim {w.shape[-1]} not a multiple of {BLOCK}"
    x = w.double().reshape(*w.shape[:-1], -1, BLOCK)  # [..., G, 32]
    amax = x.abs().amax(-1)
    exp = torch.tensor([math.floor(math.log2(a)) - 2 if a > 0 else -127
                        for a in amax.flatten().tolist()], dtype=torch.float64)
    exp = exp.reshape(amax.shape).clamp(-127, 127)
    scaled = x / torch.pow(2.0, exp)[..., None]
    magnitudes = _VALUES[:8]
    dist = (scaled.abs()[..., None] - magnitudes).abs()
    code = dist.argmin(-1)  # argmin takes the first of equals
    code = code + 8 * (scaled < 0).long()
    code = code.to(torch.uint8).reshape(*x.shape[:-1], BLOCK // 2, 2)
    blocks = code[..., 0] | (code[..., 1] << 4)
    return blocks, (exp + 127).to(torch.uint8)
