"""Fused CPU layer kernels (``csrc/fused_layers.cpp``): RMSNorm with the residual add,
neox rotary on q and k, and SiLU-and-mul, each one pass over its rows instead of torch's
4-8 elementwise passes (and, in bfloat16, their dtype conversions); and the KV pool's write
(``csrc/kv_store.cpp``): K and V rows copied into their slots in one call, where torch's
``k_buf[loc] = k`` runs an element-wise ``index_put`` per buffer.

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
from radixlm.kernels.reference import check_store_layout

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


def stores(k_buf: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether ``store_kv`` takes these: K/V in the pool's dtype, or float32 into bfloat16,
    and each token's [Hkv, D] block contiguous (rows may be strided)."""
    same = k.dtype == v.dtype and (k.dtype == k_buf.dtype or (
        k.dtype == torch.float32 and k_buf.dtype == torch.bfloat16))
    return same and all(t.dim() == 3 and t.stride(2) == 1 and t.stride(1) == t.shape[2]
                        for t in (k_buf, k, v))


def store_kv(k_buf: torch.Tensor, v_buf: torch.Tensor, loc: torch.Tensor, k: torch.Tensor,
             v: torch.Tensor) -> None:
    """``reference.store_kv``: row ``i`` of ``k``/``v`` into slot ``loc[i]`` of the pool (the
    same ``ValueError`` for a bad layout; a slot outside the pool is a RuntimeError before
    anything is written)."""
    check_store_layout(k_buf, v_buf, loc, k, v)
    torch.ops.radixlm_cpu.store_kv(k_buf, v_buf, loc.long().contiguous(), k, v)
