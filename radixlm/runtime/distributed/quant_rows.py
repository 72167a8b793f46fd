"""A layer's quantized weight, as blocks of its output rows.

A fused projection (q/k/v, gate/up) is several checkpoint tensors stacked by rows, and a
quantized checkpoint may keep them in different formats: a GGUF ``Q4_K_M`` file holds q and
k in Q4_K and v in Q6_K. ``QuantRows`` stacks neighbouring blocks that share a layout into
one ``QuantWeight`` (one matmul, as for a dense weight: q and k there), keeps the others
apart and concatenates their outputs. Each block is packed once for the CPU kernel
(``kernels/quant_linear.py``) when the kernel takes it; otherwise the dispatcher runs the
Triton kernel (CUDA) or dequantizes.

    y = cat([x @ block.W.T for block in blocks], dim=-1) + bias     [..., n]
"""

from __future__ import annotations

import torch

from radixlm.kernels import quant_linear
from radixlm.kernels.qweight import QuantWeight, stack_rows


class QuantRows:
    """The row blocks of one layer's weight, top to bottom. Where the CPU kernel packs a
    block, only its packing is kept (the kernel reads nothing else; the ``QuantWeight``
    would double the memory)."""

    def __init__(self, blocks: list[QuantWeight]) -> None:
        assert blocks, "a quantized weight needs at least one block of rows"
        blocks = _stacked_runs(blocks)
        self.kinds = [b.kind for b in blocks]
        self.packed = [quant_linear.pack(b) if quant_linear.supports(b) else None
                       for b in blocks]
        self.blocks: list[QuantWeight | None] = [None if p is not None else b
                                                 for b, p in zip(blocks, self.packed)]

    def nbytes(self) -> int:
        """Memory held: the kernel's packings and the blocks it does not take."""
        return sum(p.nbytes() if p is not None else b.nbytes()
                   for b, p in zip(self.blocks, self.packed))

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """``x [..., k] @ W.T + bias`` -> ``[..., n]`` in x's dtype."""
        if len(self.packed) == 1:
            return quant_linear.matmul(x, self.blocks[0], self.packed[0], bias)
        y = torch.cat([quant_linear.matmul(x, b, p) for b, p in zip(self.blocks, self.packed)],
                      dim=-1)
        return y if bias is None else y + bias


def _stacked_runs(blocks: list[QuantWeight]) -> list[QuantWeight]:
    """Each run of neighbouring blocks of one layout stacked into one."""
    runs = [blocks[0]]
    for block in blocks[1:]:
        stacked = stack_rows([runs[-1], block])
        if stacked is None:
            runs.append(block)
        else:
            runs[-1] = stacked
    return runs
