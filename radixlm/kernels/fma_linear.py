"""float32 linears of few rows on AVX-512 FMAs (``csrc/fma_linear.cpp``): the float32
counterpart of ``amx_linear.py``.

    pack(w [N, K] f32) -> the weight in panels of 48 columns (N rounded up to 48)
    linear(x [..., K] f32, packed, N, bias [N] | None) -> y [..., N] f32

A decode step multiplies a few rows by every weight once. oneDNN's prepacked float32 linear
(the path of the other products) runs those at a fraction of the FMA units' rate here; this
kernel keeps an 8 x 48 block of y in registers, streams each thread's panels forward with
the next 4 KiB prefetched, and adds the bias in the same pass. Past ``MAX_ROWS`` oneDNN's
blocking is as fast (``benchmarks/cpu_linear.py --fma``), so those products stay there.
"""

from __future__ import annotations

from functools import cache

import torch

from radixlm.kernels import cpu_paged

# most rows of x taking this path (docs/benchmarks.md "float32 decode linears")
MAX_ROWS = 32


@cache
def _ready() -> bool:
    return cpu_paged.available() and bool(torch.ops.radixlm_cpu.fma_linear_ready())


def supports(weight: torch.Tensor) -> bool:
    """Whether ``weight`` can be packed for this kernel: a 2-D float32 CPU tensor, the
    library built for a CPU with AVX-512."""
    return (weight.dim() == 2 and weight.dtype == torch.float32
            and weight.device.type == "cpu" and _ready())


def pack(weight: torch.Tensor) -> torch.Tensor:
    return torch.ops.radixlm_cpu.fma_pack_linear(weight.detach())


def linear(x: torch.Tensor, packed: torch.Tensor, n: int,
           bias: torch.Tensor | None = None) -> torch.Tensor:
    rows = x.reshape(-1, x.shape[-1])
    y = torch.ops.radixlm_cpu.fma_linear(rows, packed, n, bias)
    return y.reshape(*x.shape[:-1], n)


def takes(x: torch.Tensor) -> bool:
    """Whether a product with ``x`` goes through this kernel (float32, at most MAX_ROWS
    rows)."""
    return x.dtype == torch.float32 and x.numel() <= MAX_ROWS * x.shape[-1]
