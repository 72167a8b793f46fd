"""Small linear layers of every kind that holds a prepacked copy (a column-parallel one of
two stacked parts with a bias, a row-parallel one, an LM head), random N(0, 0.2) weights,
for the tests of the packed paths (oneDNN's, the AMX tiles', the AVX-512 panels')."""

from __future__ import annotations

import torch

from radixlm.runtime.distributed.layers import (
    ColumnParallelLinear,
    ParallelLMHead,
    RowParallelLinear,
    Shard,
)


def small_layers(width: int, dtype: torch.dtype = torch.float32,
                 row_bias: bool = False) -> list[torch.nn.Module]:
    """[column-parallel (width -> 2/3 + 1/3 of width, bias), row-parallel (width -> 5/6 of
    width), LM head (300 x width)] in ``dtype``."""
    torch.manual_seed(0)
    q, k = 2 * width // 3, width // 3
    col = ColumnParallelLinear(width, {"q": Shard(0, 0, q, q), "k": Shard(0, 0, k, k)}, True)
    row = RowParallelLinear(width, 5 * width // 6, bias=row_bias)
    head = ParallelLMHead(300, width)
    for mod in (col, row, head):
        with torch.no_grad():
            for p in mod.parameters():
                p.normal_(0, 0.2)
    return [mod.to(dtype) for mod in (col, row, head)]
