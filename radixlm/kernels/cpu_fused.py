"""Fused CPU layer kernels (``csrc/fused_layers.cpp``): RMSNorm with the residual add,
neox rotary on q and k, and SiLU-and-mul, each one pass over its rows instead of torch's
4-8 elementwise passes (and, in bfloat16, their dtype conversions).

Built into the same library as the paged-attention kernel (``cpu_paged``: compiled and
cached once per machine; ``cpu_paged.available()`` says whether it loaded, and
``RADIXLM_CPU_KERNEL=0`` turns both off). ``radixlm.kernels`` dispatches here for CPU
tensors with ``backend=None`` when ``supports`` holds; ``backend="torch"`` keeps the torch
reference, which these kernels match in formula and order of operations (float32
arithmetic, the residual sum rounded to the input dtype before it is normalised), except
for the order of the sum of squares and a polynomial ``exp`` in SiLU (~2e-7 relative).
"""

from __future__ import annotations

import torch

from radixlm.kernels import cpu_paged

DTYPES = (torch.float32, torch.bfloat16)


def supports(*tensors: torch.Tensor) -> bool:
    """Whether the kernels take these tensors: CPU, float32 or bfloat16, library built."""
    return (all(t.device.type == "cpu" and t.dtype in DTYPES for t in tensors)
            and cpu_paged.available())


def _rows(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None
             ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """``reference.rms_norm`` for 2-D ``x`` (new tensors; nothing is written in place)."""
    w = weight if weight.dtype in (x.dtype, torch.float32) else weight.float()
    if residual is None:
        return torch.ops.radixlm_cpu.rms_norm(_rows(x), w.contiguous(), float(eps))
    return tuple(torch.ops.radixlm_cpu.fused_add_rms_norm(
        _rows(x), _rows(residual), w.contiguous(), float(eps)))


def apply_rotary(q: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor,
                 positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``reference.apply_rotary``: q and k rotated into new contiguous tensors (q and k may
    be strided views, e.g. slices of the fused qkv projection)."""
    return tuple(torch.ops.radixlm_cpu.rotary_neox(
        q, k, cos_sin_cache.float().contiguous(), positions.long().contiguous()))


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``reference.silu_and_mul``: ``silu(x[:, :I]) * x[:, I:]`` for ``x`` [N, 2I]."""
    return torch.ops.radixlm_cpu.silu_and_mul(_rows(x))
