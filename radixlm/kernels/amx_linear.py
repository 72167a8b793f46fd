"""bfloat16 linears of few rows on AMX-BF16 tiles, or AVX512-BF16 dot products on a CPU
without AMX (``csrc/amx_linear.cpp``).

    pack(w [N, K] bf16) -> the weight in tile order (as many bytes as w, padded to 32 x 32)
    linear(x [..., K] bf16, packed, N, bias [N] | None) -> y [..., N] bf16

A decode step multiplies a few rows (one per running sequence) by every weight once, so its
linears take the weights' bytes over the memory bandwidth they reach. oneDNN's bf16 kernels
(the prepacked path of the other linears) reach about half of it: on the small preset's
shapes, one thread, weights from memory, 2.9-4.5 GB/s at 16-32 rows against a plain read's
7.8 GB/s. This kernel streams each thread's columns forward with the next 8 KiB prefetched
and reaches 5.0-7.1 GB/s at 1-32 rows (1.40-1.87x oneDNN; two threads 1.33-1.88x;
``benchmarks/cpu_linear.py --tiles``). Past ``MAX_ROWS`` its tile products, not the
memory, bound it (0.81-1.16x at 48 rows, 0.6x at 1,024), so those products stay on oneDNN.
Sums in float32, the bias added in float32, y rounded to nearest even.

Without AMX (AVX512-BF16 alone: AMD Zen 4, Intel Cooper Lake) the same packing is read one
tile row (16 columns x a pair of K) at a time by VDPBF16PS, 12 rows of x x 32 columns in
registers, each pair of 16-column blocks packed as one forward stream (their rows side by
side): 1.2-1.9x oneDNN at 1-8 rows, 1.0-1.4x at 16-32 but for K = 2,048 (0.7x), which
stays on oneDNN past ``DOT_FEW_ROWS`` (two threads, AMD EPYC Zen 4; docs/benchmarks.md,
"bf16 without AMX").
"""

from __future__ import annotations

from functools import cache

import torch

from radixlm.kernels import cpu_paged

# most rows of x taking this path (docs/benchmarks.md "Decode linears on AMX tiles")
MAX_ROWS = 32


@cache
def _ready() -> bool:
    """The library runs this kernel here (AMX tiles, or AVX512-BF16 dot products) and
    ``RADIXLM_CPU_AMX=0`` has not turned it off with the attention's bf16 path."""
    return cpu_paged.bf16_kernels_on() and bool(torch.ops.radixlm_cpu.amx_linear_ready())


@cache
def _dot_only() -> bool:
    """The kernel runs on AVX512-BF16 dot products: no AMX tiles granted."""
    return _ready() and not torch.ops.radixlm_cpu.amx_ready()


def supports(weight: torch.Tensor) -> bool:
    """Whether ``weight`` can be packed for this kernel: a 2-D bfloat16 CPU tensor, the
    library built for a CPU with AMX-BF16 or AVX512-BF16 (``_ready``)."""
    return (weight.dim() == 2 and weight.dtype == torch.bfloat16
            and weight.device.type == "cpu" and _ready())


def pack(weight: torch.Tensor) -> torch.Tensor:
    return torch.ops.radixlm_cpu.amx_pack_linear(weight.detach())


def linear(x: torch.Tensor, packed: torch.Tensor, n: int,
           bias: torch.Tensor | None = None) -> torch.Tensor:
    rows = x.reshape(-1, x.shape[-1])
    y = torch.ops.radixlm_cpu.amx_linear(rows, packed, n, bias)
    return y.reshape(*x.shape[:-1], n)


# without AMX: a K past this with more than DOT_FEW_ROWS rows stays on oneDNN (down_proj,
# K = 2,048: 0.66-0.70x oneDNN at 16-32 rows; every K up to 1,024 1.0-1.9x)
DOT_MAX_K = 1024
DOT_FEW_ROWS = 4


def takes(x: torch.Tensor) -> bool:
    """Whether a product with ``x`` goes through this kernel (bf16, at most MAX_ROWS rows;
    without AMX, a long K only at a few rows)."""
    k = x.shape[-1]
    rows = x.numel() // max(k, 1)
    return (x.dtype == torch.bfloat16 and rows <= MAX_ROWS
            and (k <= DOT_MAX_K or rows <= DOT_FEW_ROWS or not _dot_only()))
