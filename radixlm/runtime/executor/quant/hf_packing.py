"""The packed codes of Hugging Face quantized checkpoints undone into ``QuantWeight``
(``radixlm/kernels/qweight.py``) bytes, exactly: the bit work the layouts
(``hf_layouts.py``) share.

    unpack_int32    int32 words -> their 4- or 8-bit fields, spread along either dimension
    word_bytes      int32 words -> their bytes: 4-bit fields i, i + 1 share byte i // 2,
                    as QuantWeight w4 columns do
    along_k         GPTQ's words packed along the inputs -> each output's bytes
    awq_bytes       AutoAWQ's words (AWQ_ORDER within a word) -> QuantWeight w4 bytes
    act_order_perm  GPTQ's ``g_idx`` -> QuantWeight ``perm``
    w4_weight,      codes, zero points and scales -> QuantWeight, zero points as
      w8_weight     ``mins = -zero * scale`` (exact: a 4- or 8-bit code times an f16 / bf16
                    scale fits a float32)

The writer's packing (``tiny_quant/hf_writer.py``) is kept apart on purpose: the tests read
what it writes, and a shared mistake could not be caught by reading what the same code wrote.
"""

from __future__ import annotations

import sys

import torch

from radixlm.kernels.qweight import QuantWeight

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i of a word holds output column AWQ_ORDER[i]
AWQ_REVERSE_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)  # column j sits in nibble AWQ_REVERSE_ORDER[j]


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


def w4_weight(data: torch.Tensor, k: int, zeros: torch.Tensor, scales: torch.Tensor,
              group: int, perm: torch.Tensor | None) -> QuantWeight:
    """w4 bytes ``data [n, >= ceil(k/2)]`` of unsigned codes in input order, ``zeros`` /
    ``scales [n, G]``: W = (q - z) * s; act-order ``perm`` puts the columns in its order."""
    data = data[:, : -(-k // 2)]
    if perm is not None:  # rows of [k, n] gather fast; the columns of [n, k] do not
        rows = nibbles(data)[:, :k].T.contiguous().index_select(0, perm)
        data = input_pairs(rows)
    s = scales.to(torch.float32)
    return QuantWeight("w4", data.shape[0], k, group, data.contiguous(), s.contiguous(),
                       (-zeros.to(torch.float32) * s).contiguous(), perm)


def w8_weight(codes: torch.Tensor, k: int, zeros: torch.Tensor | None,
              scales: torch.Tensor, group: int, perm: torch.Tensor | None) -> QuantWeight:
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

