"""float32 linears on FMAs (``csrc/fma_linear.cpp``): the float32 counterpart of
``amx_linear.py``; on AVX2 also a bfloat16 model's.

    pack(w [N, K] f32 or bf16) -> the weight in panels of panel_columns() columns (N
                                  rounded up), in w's dtype
    linear(x [..., K] f32 or bf16, packed, N, bias [N] | None) -> y [..., N] in x's dtype

The kernel keeps a block of y in registers (AVX-512: 8 rows x 48 columns; AVX2: 6 x 16),
streams each thread's panels forward with the next 4 KiB prefetched, and adds the bias in
the same pass. On AVX-512 it is for decode steps: oneDNN's prepacked float32 linear runs
a few rows at a fraction of the FMA units' rate there, and past ``MAX_ROWS_AVX512`` rows
oneDNN's blocking is as fast (``benchmarks/cpu_linear.py --fma``). On AVX2 it beats
oneDNN at every row count measured (1-2048 rows, 1.06-1.4x with two threads on AMD Zen 3)
and torch's own matmul over the dense weight at 64-512 rows (level at 1024-2048 =
``MAX_ROWS_AVX2``, 0.82-0.85x at 8192): so it takes those products, torch's matmul the
larger ones, and oneDNN's copy of the weight is not made (``replaces_onednn``).

A bfloat16 weight on AVX2 (no bf16 instructions there: torch's bf16 matmul converts
element by element, 7-9x slower than these panels at 32-2,048 rows) is packed as it is and
widened as loaded (exact), x widened once, the products summed in float32 and y rounded to
bfloat16 (to nearest even): what oneDNN's bf16 kernels compute on CPUs that have them. Such
products take the panels at every row count.
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
    library built for a CPU with AVX-512, or AVX2 and FMA; a bfloat16 one on AVX2."""
    dtypes = (torch.float32, torch.bfloat16) if replaces_onednn() else (torch.float32,)
    return (weight.dim() == 2 and weight.dtype in dtypes and weight.device.type == "cpu"
            and _ready())


def pack(weight: torch.Tensor) -> torch.Tensor:
    return torch.ops.radixlm_cpu.fma_pack_linear(weight.detach())


def linear(x: torch.Tensor, packed: torch.Tensor, n: int,
           bias: torch.Tensor | None = None) -> torch.Tensor:
    rows = x.reshape(-1, x.shape[-1])
    y = torch.ops.radixlm_cpu.fma_linear(rows, packed, n, bias)
    return y.reshape(*x.shape[:-1], n)


def takes(x: torch.Tensor) -> bool:
    """Whether a product with ``x`` goes through this kernel (float32, at most max_rows()
    rows; bfloat16 on AVX2, any rows)."""
    if x.dtype == torch.bfloat16:
        return replaces_onednn()
    return x.dtype == torch.float32 and x.numel() <= max_rows() * x.shape[-1]
