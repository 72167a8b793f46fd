"""float32 linears on FMAs (``csrc/fma_linear.cpp``): the float32 counterpart of
``amx_linear.py``.

    pack(w [N, K] f32) -> the weight in panels of panel_columns() columns (N rounded up)
    linear(x [..., K] f32, packed, N, bias [N] | None) -> y [..., N] f32

The kernel keeps a block of y in registers (AVX-512: 8 rows x 48 columns; AVX2: 6 x 16),
streams each thread's panels forward with the next 4 KiB prefetched, and adds the bias in
the same pass. On AVX-512 it is for decode steps: oneDNN's prepacked float32 linear runs
a few rows at a fraction of the FMA units' rate there, and past ``MAX_ROWS_AVX512`` rows
oneDNN's blocking is as fast (``benchmarks/cpu_linear.py --fma``). On AVX2 it beats
oneDNN at every row count measured (1-2048 rows, 1.06-1.4x with two threads on AMD Zen 3)
and torch's own matmul over the dense weight at 64-512 rows (level at 1024-2048 =
``MAX_ROWS_AVX2``, 0.82-0.85x at 8192): so it takes those products, torch's matmul the
larger ones, and oneDNN's copy of the weight is not made (``replaces_onednn``).
"""

from __future__ import annotations

from functools import cache

import torch

from radixlm.kernels import cpu_paged

# most rows of x taking this path on AVX-512 (docs/benchmarks.md "float32 decode linears")
# and on AVX2 ("The Zen 3 host, an eleventh session")
MAX_ROWS_AVX512 = 32
MAX_ROWS_AVX2 = 2048


@cache
def panel_columns() -> int:
    """Columns per panel of this build: 48 (AVX-512), 16 (AVX2 with FMA), 0 (no kernel)."""
    return int(torch.ops.radixlm_cpu.fma_linear_panel()) if cpu_paged.available() else 0


def _ready() -> bool:
    return panel_columns() > 0


def max_rows() -> int:
    """Most rows of x a product sends here."""
    return MAX_ROWS_AVX512 if panel_columns() == 48 else MAX_ROWS_AVX2


def replaces_onednn() -> bool:
    """Whether the panels stand in for oneDNN's prepacked copy (the AVX2 build): larger
    products then take torch's matmul over the dense weight."""
    return panel_columns() == 16


def supports(weight: torch.Tensor) -> bool:
    """Whether ``weight`` can be packed for this kernel: a 2-D float32 CPU tensor, the
    library built for a CPU with AVX-512, or AVX2 and FMA."""
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
    """Whether a product with ``x`` goes through this kernel (float32, at most max_rows()
    rows)."""
    return x.dtype == torch.float32 and x.numel() <= max_rows() * x.shape[-1]
