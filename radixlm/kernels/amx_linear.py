"""bfloat16 linears of few rows on AMX-BF16 tiles (``csrc/amx_linear.cpp``).

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
"""

from __future__ import annotations

import torch

from radixlm.kernels import cpu_paged

# most rows of x taking this path (docs/benchmarks.md "Decode linears on AMX tiles")
MAX_ROWS = 32


def supports(weight: torch.Tensor) -> bool:
    """Whether ``weight`` can be packed for this kernel: a 2-D bfloat16 CPU tensor, the
    library built for an AMX-BF16 CPU whose tiles the OS grants (``cpu_paged.amx``:
    ``RADIXLM_CPU_AMX=0`` turns this path off with the attention's)."""
    return (weight.dim() == 2 and weight.dtype == torch.bfloat16
            and weight.device.type == "cpu" and cpu_paged.amx())


def pack(weight: torch.Tensor) -> torch.Tensor:
    return torch.ops.radixlm_cpu.amx_pack_linear(weight.detach())


def linear(x: torch.Tensor, packed: torch.Tensor, n: int,
           bias: torch.Tensor | None = None) -> torch.Tensor:
    rows = x.reshape(-1, x.shape[-1])
    y = torch.ops.radixlm_cpu.amx_linear(rows, packed, n, bias)
    return y.reshape(*x.shape[:-1], n)


def takes(x: torch.Tensor) -> bool:
    """Whether a product with ``x`` goes through this kernel (bf16, at most MAX_ROWS rows)."""
    return x.dtype == torch.bfloat16 and x.numel() <= MAX_ROWS * x.shape[-1]
