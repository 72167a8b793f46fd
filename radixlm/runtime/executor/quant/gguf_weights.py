"""GGUF tensors as our checkpoint's tensors: float types as float tensors, the block types
our kernels multiply as ``QuantWeight`` (``kernels/qweight.py``), converted exactly:

    GGUF type  block                                      QuantWeight
    F32 / F16 / BF16                                      a float tensor of that dtype
    Q8_0       32: d, 32 int8                             w8, group 32, scale d
    Q4_0       32: d, 16 bytes of nibbles                 w4, group 32, scale d, min -8d
    Q4_1       32: d, m, nibbles                          w4, group 32, scale d, min m
    Q5_0       32: d, 32 high bits, nibbles               w8 (-16..15), group 32, scale d
    Q5_1       32: d, m, high bits, nibbles               w8 (0..31), group 32, scale d, min m
    Q4_K       256: d, dmin, 8 x 6-bit (sc, m), nibbles   w4, group 32, scale d*sc, min -dmin*m
    Q5_K       256: as Q4_K plus 32 bytes of high bits    w8 (0..31), group 32, as Q4_K
    Q6_K       256: 4+2 bit codes, 16 int8 sc, d          w8 (-32..31), group 16, scale d*sc
    MXFP4      32: E8M0 e, 16 bytes of E2M1 nibbles       w8 (2 x E2M1: -12..12), group 32,
                                                          scale 2^(e - 128)

Every product (an fp16 ``d`` times a code or a 6/8-bit scale) is exact in float32 and the
offset is added once, in the order the ``gguf`` package's dequantizer adds it, so
``QuantWeight.dequantize()`` equals ``gguf.quants.dequantize`` bit for bit (the tests check
every type on random blocks). Rows llama.cpp permuted (``TensorInfo.unpermute_heads``) are put
back in HF order: rows are independent in every block format, so this is exact too. A
stacked ``[E, N, K]`` tensor (gpt-oss's experts) reads as a list of E ``[N, K]`` weights.

Any other type (Q2_K, Q3_K, IQ*, TQ*, ...) is dequantized to a float32 tensor with the
``gguf`` package, with a warning for a matrix: a Q3_K_M file still serves, correctly, from
dense weights (bigger and slower) rather than not at all.
"""

from __future__ import annotations

import dataclasses
import logging

import numpy as np
import torch
from gguf import quants
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

from radixlm.kernels.qweight import QuantWeight
from radixlm.runtime.gguf_container import GGUFError
from radixlm.runtime.gguf_families import TensorInfo
from radixlm.runtime.gguf_file import GGUFModel

logger = logging.getLogger(__name__)

Q = GGMLQuantizationType
_FLOATS = {Q.F32: (np.float32, torch.float32), Q.F16: (np.float16, torch.float16),
           Q.BF16: (np.int16, torch.bfloat16)}


def _f16(blocks: np.ndarray, start: int) -> np.ndarray:
    """The float16 at byte ``start`` of each block, as float32 [nblocks]."""
    return np.ascontiguousarray(blocks[:, start:start + 2]).view(np.float16)[:, 0] \
        .astype(np.float32)


def _split_nibbles(qs: np.ndarray, chunk: int) -> np.ndarray:
    """[nb, c] bytes -> [nb, 2c] codes: each ``chunk`` bytes give ``chunk`` low nibbles then
    ``chunk`` high ones (GGML's order)."""
    q = qs.reshape(qs.shape[0], -1, 1, chunk)
    return np.concatenate([q & 15, q >> 4], axis=2).reshape(qs.shape[0], -1)


def _high_bits(qh: np.ndarray, count: int) -> np.ndarray:
    """[nb, count / 8] bytes -> [nb, count] bits, little-endian (Q5_0 / Q5_1's uint32)."""
    return np.unpackbits(qh, axis=1, bitorder="little")[:, :count]


def _k_scales(sc: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K / Q5_K's 12 bytes -> eight 6-bit scales and mins each [nb, 8]."""
    d, m, md = sc[:, 0:4], sc[:, 4:8], sc[:, 8:12]
    scales = np.concatenate([d & 63, (md & 15) | ((d >> 2) & 48)], axis=1)
    mins = np.concatenate([m & 63, (md >> 4) | ((m >> 2) & 48)], axis=1)
    return scales.astype(np.float32), mins.astype(np.float32)


def _q8_0(b: np.ndarray) -> tuple:
    return "w8", 32, b[:, 2:].view(np.int8), _f16(b, 0)[:, None], None


def _q4_0(b: np.ndarray) -> tuple:
    d = _f16(b, 0)[:, None]
    return "w4", 32, _split_nibbles(b[:, 2:], 16), d, -8 * d


def _q4_1(b: np.ndarray) -> tuple:
    return "w4", 32, _split_nibbles(b[:, 4:], 16), _f16(b, 0)[:, None], _f16(b, 2)[:, None]


def _q5(b: np.ndarray, start: int) -> np.ndarray:
    return _split_nibbles(b[:, start + 4:], 16) | (_high_bits(b[:, start:start + 4], 32) << 4)


def _q5_0(b: np.ndarray) -> tuple:
    return "w8", 32, (_q5(b, 2).astype(np.int8) - 16), _f16(b, 0)[:, None], None


def _q5_1(b: np.ndarray) -> tuple:
    return "w8", 32, _q5(b, 4).astype(np.int8), _f16(b, 0)[:, None], _f16(b, 2)[:, None]


def _q4_k(b: np.ndarray) -> tuple:
    sc, m = _k_scales(b[:, 4:16])
    scales, mins = _f16(b, 0)[:, None] * sc, -(_f16(b, 2)[:, None] * m)
    return "w4", 32, _split_nibbles(b[:, 16:], 32), scales, mins


def _q5_k(b: np.ndarray) -> tuple:
    sc, m = _k_scales(b[:, 4:16])
    scales, mins = _f16(b, 0)[:, None] * sc, -(_f16(b, 2)[:, None] * m)
    # bit s of qh[l] is bit 4 of sub-block s's element l
    high = np.unpackbits(b[:, 16:48], axis=1, bitorder="little").reshape(-1, 32, 8)
    codes = _split_nibbles(b[:, 48:], 32) | (high.transpose(0, 2, 1).reshape(-1, 256) << 4)
    return "w8", 32, codes.astype(np.int8), scales, mins


def _q6_k(b: np.ndarray) -> tuple:
    nb = b.shape[0]
    ql = b[:, :128].reshape(nb, 2, 1, 64)
    low = np.concatenate([ql & 15, ql >> 4], axis=2).reshape(nb, 2, 128)
    qh = b[:, 128:192].reshape(nb, 2, 1, 32)
    high = ((qh >> (2 * np.arange(4, dtype=np.uint8))[None, None, :, None]) & 3) \
        .reshape(nb, 2, 128)
    codes = ((low | (high << 4)).astype(np.int8) - 32).reshape(nb, 256)
    scales = _f16(b, 208)[:, None] * b[:, 192:208].view(np.int8).astype(np.float32)
    return "w8", 16, codes, scales, None


def _mxfp4(b: np.ndarray) -> tuple:
    """E2M1 codes as twice their values (ggml's ``kvalues_mxfp4``), scale half of E8M0's."""
    codes = np.array(quants.MXFP4.kvalues, dtype=np.int8)[_split_nibbles(b[:, 1:], 16)]
    return "w8", 32, codes, quants.MXFP4.e8m0_to_fp32_half(b[:, 0])[:, None], None


_CONVERT = {Q.Q8_0: _q8_0, Q.Q4_0: _q4_0, Q.Q4_1: _q4_1, Q.Q5_0: _q5_0, Q.Q5_1: _q5_1,
            Q.Q4_K: _q4_k, Q.Q5_K: _q5_k, Q.Q6_K: _q6_k, Q.MXFP4: _mxfp4}
QUANT_TYPES = tuple(t.name for t in _CONVERT)  # kept in blocks (QuantWeight)


def _perm(n: int, heads: int) -> torch.Tensor:
    """HF row r is GGUF row perm[r]: llama.cpp interleaved each head's two halves."""
    return torch.arange(n).reshape(heads, n // heads // 2, 2).transpose(1, 2).reshape(-1)


def _quant_weight(raw: np.ndarray, info: TensorInfo) -> QuantWeight:
    n, k = info.shape
    size = GGML_QUANT_SIZES[Q(info.ggml_type)][1]
    blocks = raw.reshape(-1, size)
    kind, group, codes, scales, mins = _CONVERT[Q(info.ggml_type)](blocks)
    codes = codes.reshape(n, k)
    if kind == "w4":  # column 2j in the low nibble, 2j+1 in the high one
        codes = (codes[:, 0::2] | (codes[:, 1::2] << 4)).astype(np.uint8)
    qw = QuantWeight(kind, n, k, group, torch.from_numpy(np.ascontiguousarray(codes)),
                     torch.from_numpy(np.ascontiguousarray(scales.reshape(n, -1))),
                     None if mins is None else torch.from_numpy(
                         np.ascontiguousarray(mins.reshape(n, -1))))
    if info.unpermute_heads:
        p = _perm(n, info.unpermute_heads)
        qw = QuantWeight(kind, n, k, group, qw.data[p], qw.scales[p],
                         None if qw.mins is None else qw.mins[p])
    return qw


def _expert_weights(raw: np.ndarray, info: TensorInfo) -> list[QuantWeight]:
    """A stacked ``[E, N, K]`` tensor as E ``[N, K]`` weights, converted one expert at a
    time (a conversion's temporaries are several bytes a weight)."""
    experts, n, k = info.shape
    one = dataclasses.replace(info, shape=(n, k))
    return [_quant_weight(part, one) for part in raw.reshape(experts, -1)]


def _float(raw: np.ndarray, info: TensorInfo) -> torch.Tensor:
    t = Q(info.ggml_type)
    if t in _FLOATS:
        np_type, dtype = _FLOATS[t]
        out = torch.from_numpy(raw.view(np_type).copy()).view(dtype).reshape(info.shape)
    else:
        if len(info.shape) == 2:
            logger.warning("%s (%s): GGML type %s is dequantized to float32 (its blocks are "
                           "not multiplied directly)", info.gguf_name, info.name, t.name)
        out = torch.from_numpy(quants.dequantize(raw, t).reshape(info.shape).copy())
    if info.norm_shift:
        out = out.to(torch.float32) + info.norm_shift
    if info.unpermute_heads:
        out = out[_perm(info.shape[0], info.unpermute_heads)]
    return out


def read_tensor(model: GGUFModel, name: str) -> torch.Tensor | QuantWeight | list[QuantWeight]:
    """The tensor ``name`` (our checkpoint name) of ``model``: a ``QuantWeight`` for a
    matrix in one of ``QUANT_TYPES`` (one per expert for stacked experts), else a float
    tensor (see the module docstring)."""
    info = model.tensors.get(name)
    if info is None:
        raise GGUFError(f"{model.where}: no tensor {name!r}")
    raw = model.data(info)
    if info.ggml_type in _CONVERT and not info.norm_shift:
        if len(info.shape) == 2:
            return _quant_weight(raw, info)
        if len(info.shape) == 3:
            return _expert_weights(raw, info)
    return _float(raw, info)


def reference_dequantize(model: GGUFModel, name: str) -> np.ndarray:
    """float32 ``name`` as the ``gguf`` package dequantizes it, in the file's row order and
    values (no un-permuting, no norm shift): the tests' oracle."""
    info = model.tensors[name]
    return np.array(quants.dequantize(model.data(info), Q(info.ggml_type))
                    .reshape(info.shape), dtype=np.float32)  # a copy: F32 comes back as a view


class GGUFSource:
    """A GGUF file as the loader's ``WeightSource``: shapes from the header, tensors read
    on demand (``read_tensor``)."""

    def __init__(self, model: GGUFModel) -> None:
        self.model = model
        self.where = model.where

    def shapes(self) -> dict[str, tuple[int, ...]]:
        return {name: info.shape for name, info in self.model.tensors.items()}

    def read(self, name: str) -> torch.Tensor | QuantWeight | list[QuantWeight]:
        return read_tensor(self.model, name)

    def close(self) -> None:
        """Unmap the file once the load is done: its pages would otherwise stay resident
        beside the weights read from them (every tensor read is a copy). A view still held
        somewhere keeps the mapping (logged), never a crash."""
        try:
            self.model.close()
        except BufferError:
            logger.warning("%s stays mapped: a tensor still views its bytes", self.where)
