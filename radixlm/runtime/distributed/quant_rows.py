"""A layer's quantized weight, as blocks of its output rows.

A fused projection (q/k/v, gate/up) is several checkpoint tensors stacked by rows, and a
quantized checkpoint may keep them in different formats: a GGUF ``Q4_K_M`` file holds q and
k in Q4_K and v in Q6_K. ``QuantRows`` stacks the blocks into one ``QuantWeight`` when
they share a layout (one matmul, as for a dense weight), else keeps them apart and
concatenates their outputs. Each block is packed once for the CPU kernel
(``kernels/quant_linear.py``) when the kernel takes it; otherwise (and on a GPU) the
dispatcher runs the Triton kernel or dequantizes.

    y = cat([x @ block.W.T for block in blocks], dim=-1) + bias     [..., n]
"""

from __future__ import annotations

import importlib

import torch

from radixlm.kernels.qweight import QuantWeight, stack_rows

# TEMPORARY until kernels/quant_linear.py lands (another engineer writes it now)
quant_linear = None


def _kernels():
    global quant_linear
    if quant_linear is None:
        quant_linear = importlib.import_module("radixlm.kernels.quant_linear")
    return quant_linear


class QuantRows:
    """The row blocks of one layer's weight, top to bottom."""

    def __init__(self, blocks: list[QuantWeight]) -> None:
        assert blocks, "a quantized weight needs at least one block of rows"
        stacked = stack_rows(blocks)
        self.blocks = [stacked] if stacked is not None else list(blocks)
        _kernels()
        self.packed = [quant_linear.pack(b) if quant_linear.supports(b) else None
                       for b in self.blocks]
        self.n = sum(b.n for b in self.blocks)
        self.k = self.blocks[0].k

    def kinds(self) -> list[str]:
        return [b.kind for b in self.blocks]

    def nbytes(self) -> int:
        """Memory held: the blocks and the kernel's packed copies."""
        return sum(b.nbytes() + (p.nbytes() if p is not None else 0)
                   for b, p in zip(self.blocks, self.packed))

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """``x [..., k] @ W.T + bias`` -> ``[..., n]`` in x's dtype."""
        if len(self.blocks) == 1:
            return quant_linear.matmul(x, self.blocks[0], self.packed[0], bias)
        y = torch.cat([quant_linear.matmul(x, b, p) for b, p in zip(self.blocks, self.packed)],
                      dim=-1)
        return y if bias is None else y + bias

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        """The dense ``[n, k]`` weight (tests; layers that must hold a dense copy)."""
        return torch.cat([b.dequantize(dtype) for b in self.blocks])
