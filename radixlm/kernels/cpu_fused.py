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
for a polynomial ``exp`` in SiLU (~2e-7 relative) and, in bfloat16, the order of the sum of
squares (16 lanes; float32 rows of 8 or more elements sum in torch's own order, so a
float32 RMSNorm gives the reference's bits: ``exact_float32_norm``).
"""

from __future__ import annotations

import logging
from functools import cache

import torch

from radixlm.kernels import cpu_paged, reference
from radixlm.kernels.reference import check_store_layout

logger = logging.getLogger(__name__)

DTYPES = (torch.float32, torch.bfloat16)


def supports(*tensors: torch.Tensor) -> bool:
    """Whether the kernels take these tensors: CPU, float32 or bfloat16, library built."""
    return (all(t.device.type == "cpu" and t.dtype in DTYPES for t in tensors)
            and cpu_paged.available())


def _rows(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


# float32 rows narrower than this go through torch's scalar sum, whose order the kernel
# does not follow (its sum of squares follows torch's 8-lane vector sum)
EXACT_MIN_WIDTH = 8


@cache
def _float32_norm_matches() -> bool:
    """Whether the kernel's float32 RMSNorm gives ``reference.rms_norm``'s bits on this
    torch build (with and without the residual, rows of several widths, at the threads the
    process runs with when first asked). Checked once; False sends float32 back to the
    reference. Calls the op through ``_norm``, not ``rms_norm``, so a patched ``rms_norm``
    cannot poison the cached answer."""
    gen = torch.Generator().manual_seed(0)
    for n, h in ((1, 64), (3, 768), (40, 1000), (64, 4096)):
        x, res = (torch.randn(n, h, generator=gen) * 3 for _ in range(2))
        w = torch.randn(h, generator=gen)
        for eps in (1e-5, 1e-6):
            ours = (_norm(x, w, eps), *_norm(x, w, eps, res))
            ref = (reference.rms_norm(x, w, eps), *reference.rms_norm(x, w, eps, res))
            if not all(torch.equal(a, b) for a, b in zip(ours, ref)):
                logger.info("the fused float32 RMSNorm differs from torch's bits on this "
                            "build: float32 models keep the torch reference")
                return False
    return True


def exact_float32_norm(width: int) -> bool:
    """Whether a float32 row of ``width`` elements takes the fused RMSNorm (bit-for-bit
    the reference's: see ``_float32_norm_matches``)."""
    return width >= EXACT_MIN_WIDTH and cpu_paged.available() and _float32_norm_matches()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None
             ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """``reference.rms_norm`` for 2-D ``x`` (new tensors; nothing is written in place)."""
    return _norm(x, weight, eps, residual)


def _norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
          residual: torch.Tensor | None = None):
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
