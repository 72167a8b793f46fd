"""One in-memory form for every quantized checkpoint's linear weights.

GGUF blocks, AWQ / GPTQ / compressed-tensors int4, W8A8 int8 and FP8 all load into a
``QuantWeight``: the logical weight ``W [n, k]`` of ``y = x @ W.T`` kept as small integers
(or FP8 codes) with a float32 scale, and for unsigned codes a float32 offset, per group of
``group`` consecutive columns of a row:

    W[r, c] = q[r, c] * scales[r, c // group] + (mins[r, c // group] if mins else 0)

    kind  data                                  q                       formats
    w4    uint8 [n, ceil(k/2)]: column 2j in    0..15                   GGUF Q4_0 / Q4_1 / Q4_K,
          the low nibble, 2j+1 in the high                              AWQ, GPTQ, pack-quantized
    w8    int8 [n, k]                           -128..127               GGUF Q8_0 / Q5_K / Q6_K,
                                                                        W8A8 int8
    fp8   float8_e4m3fn [n, k]                  the code's value        FP8 (per tensor, per
                                                                        channel, 128x128 blocks)

The last group of a row is shorter when ``group`` does not divide ``k``. ``perm`` (GPTQ's
act-order, ``desc_act``): the checkpoint's groups run over the input features in another
order; column ``j`` of ``data`` / ``scales`` multiplies input feature ``perm[j]``, so
``y = x[..., perm] @ W_stored.T`` and ``dequantize`` returns ``W`` in input-feature order.

Conversions into this form are exact (every GGUF block's ``d * sc`` fits a float32): the
tests compare ``dequantize`` with the ``gguf`` package's own dequantizer bit for bit. The
CPU and Triton kernels (``quant_linear``) pack it further in their own layouts.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

KINDS = ("w4", "w8", "fp8")
BITS = {"w4": 4, "w8": 8, "fp8": 8}


@dataclass
class QuantWeight:
    """A quantized ``[n, k]`` linear weight (see the module docstring for the layout)."""

    kind: str
    n: int
    k: int
    group: int
    data: torch.Tensor
    scales: torch.Tensor  # float32 [n, ceil(k / group)]
    mins: torch.Tensor | None = None  # float32 [n, ceil(k / group)]
    perm: torch.Tensor | None = None  # int64 [k]

    def __post_init__(self) -> None:
        self.check()

    @property
    def groups(self) -> int:
        return -(-self.k // self.group)

    @property
    def shape(self) -> tuple[int, int]:
        return (self.n, self.k)

    def check(self) -> None:
        """AssertionError naming the field when the tensors do not match the layout."""
        assert self.kind in KINDS, f"kind {self.kind!r} is not one of {KINDS}"
        assert self.n > 0 and self.k > 0 and self.group > 0, (self.n, self.k, self.group)
        cols = -(-self.k // 2) if self.kind == "w4" else self.k
        dtype = {"w4": torch.uint8, "w8": torch.int8, "fp8": torch.float8_e4m3fn}[self.kind]
        assert self.data.dtype == dtype and tuple(self.data.shape) == (self.n, cols), \
            f"{self.kind} data {self.data.dtype} {tuple(self.data.shape)}, expected " \
            f"{dtype} {(self.n, cols)}"
        for name in ("scales", "mins"):
            t = getattr(self, name)
            if t is None:
                continue
            assert t.dtype == torch.float32 and tuple(t.shape) == (self.n, self.groups), \
                f"{name} {t.dtype} {tuple(t.shape)}, expected float32 {(self.n, self.groups)}"
        if self.perm is not None:
            assert self.perm.dtype == torch.int64 and tuple(self.perm.shape) == (self.k,), \
                f"perm {self.perm.dtype} {tuple(self.perm.shape)}, expected int64 ({self.k},)"

    def nbytes(self) -> int:
        """Memory of the data, scales, offsets and permutation."""
        return sum(t.nbytes for t in (self.data, self.scales, self.mins, self.perm)
                   if t is not None)

    def codes(self) -> torch.Tensor:
        """``q`` as float32 ``[n, k]``, in stored column order."""
        if self.kind == "w4":
            low = (self.data & 0x0F).to(torch.float32)
            high = (self.data >> 4).to(torch.float32)
            return torch.stack((low, high), dim=-1).reshape(self.n, -1)[:, : self.k]
        return self.data.to(torch.float32)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """``W [n, k]`` in input-feature order, computed in float32 then cast to ``dtype``."""
        cols = torch.arange(self.k, device=self.data.device) // self.group
        w = self.codes() * self.scales[:, cols]
        if self.mins is not None:
            w = w + self.mins[:, cols]
        if self.perm is not None:
            w = torch.empty_like(w).index_copy_(1, self.perm, w)
        return w.to(dtype)

    def rows(self, start: int, stop: int) -> QuantWeight:
        """Rows ``[start, stop)`` (views, no copy)."""
        assert 0 <= start < stop <= self.n, (start, stop, self.n)
        return QuantWeight(self.kind, stop - start, self.k, self.group, self.data[start:stop],
                           self.scales[start:stop],
                           None if self.mins is None else self.mins[start:stop], self.perm)


def stack_rows(parts: list[QuantWeight]) -> QuantWeight | None:
    """The parts' rows one after another in one weight (q, k and v of a fused projection),
    or None when they differ in kind, group, offsets or permutation (then they multiply
    apart)."""
    first = parts[0]
    same = all(p.kind == first.kind and p.k == first.k and p.group == first.group
               and (p.mins is None) == (first.mins is None)
               and (p.perm is None and first.perm is None
                    or p.perm is not None and first.perm is not None
                    and torch.equal(p.perm, first.perm))
               for p in parts)
    if not same:
        return None
    if len(parts) == 1:
        return first
    return QuantWeight(first.kind, sum(p.n for p in parts), first.k, first.group,
                       torch.cat([p.data for p in parts]), torch.cat([p.scales for p in parts]),
                       None if first.mins is None else torch.cat([p.mins for p in parts]),
                       first.perm)


def reference_linear(x: torch.Tensor, weight: QuantWeight,
                     bias: torch.Tensor | None = None) -> torch.Tensor:
    """float64 ``x @ dequantize(W).T + bias`` (the tests' oracle)."""
    w = weight.dequantize(torch.float32).double()
    return F.linear(x.double(), w, None if bias is None else bias.double())
