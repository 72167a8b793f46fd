"""KV storage: per-layer K and V buffers, and the request-to-token table."""

from __future__ import annotations

import ctypes
import math
import sys
from functools import cache

import torch

_HUGE_PAGE = 2 << 20  # x86-64 and arm64 (4 KB base pages)
_MADV_HUGEPAGE = 14

# --kv-cache-dtype spellings (SGLang's, plus float16 / float32) -> the pool's torch dtype;
# None: the model's dtype. fp8 rows are plain casts, with no scale (SGLang's default scale
# is 1.0 without --quantization-param-path); torch saturates e4m3 at +-448.
KV_CACHE_DTYPES: dict[str, torch.dtype | None] = {
    "auto": None,
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp16": torch.float16,
    "float16": torch.float16,
    "float32": torch.float32,
    "fp8_e5m2": torch.float8_e5m2,
    "fp8_e4m3": torch.float8_e4m3fn,
}


def kv_cache_torch_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The pool's dtype for ``--kv-cache-dtype`` (``auto``: ``model_dtype``)."""
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"--kv-cache-dtype must be one of {sorted(KV_CACHE_DTYPES)}, "
                         f"got {kv_cache_dtype!r}")
    return KV_CACHE_DTYPES[kv_cache_dtype] or model_dtype


def kv_cache_dtype_name(dtype: torch.dtype) -> str:
    """``dtype`` as ``--kv-cache-dtype`` spells it (the last of its spellings above)."""
    names = {d: n for n, d in KV_CACHE_DTYPES.items() if d is not None}
    return names.get(dtype, str(dtype).removeprefix("torch."))


@cache
def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def _advise_huge_pages(t: torch.Tensor) -> bool:
    """Ask Linux to back ``t``'s memory with transparent huge pages (``MADV_HUGEPAGE``;
    honoured when THP is ``always`` or ``madvise``). Only pages not yet touched get them."""
    try:
        res = _libc().madvise(ctypes.c_void_p(t.data_ptr()),
                              ctypes.c_size_t(t.numel() * t.element_size()), _MADV_HUGEPAGE)
    except (AttributeError, OSError):
        return False
    return res == 0


def pool_buffers(count: int, shape: tuple[int, ...], dtype: torch.dtype,
                 device: torch.device) -> list[torch.Tensor]:
    """``count`` zeroed buffers of ``shape``. On a Linux CPU they are views of one slab that
    starts on a 2 MB boundary and is advised into transparent huge pages before it is
    first written: decode attention reads K/V rows at scattered slots, and with 4 KB pages
    nearly every row costs a TLB miss (`benchmarks/decode_step.py --preset small --paths
    paged [--no-huge-pages]`: a bf16 pool's decode attention 7.3 -> 6.7 ms per step, a
    float32 pool's unchanged). Elsewhere, plain tensors."""
    if device.type != "cpu" or not sys.platform.startswith("linux"):
        return [torch.zeros(shape, dtype=dtype, device=device) for _ in range(count)]
    itemsize = torch.empty((), dtype=dtype).element_size()
    each = math.prod(shape) * itemsize
    raw = torch.empty(count * each + _HUGE_PAGE, dtype=torch.uint8)
    start = -raw.data_ptr() % _HUGE_PAGE
    slab = raw[start:start + count * each]
    _advise_huge_pages(slab)
    slab.zero_()
    return [slab[i * each:(i + 1) * each].view(dtype).view(shape) for i in range(count)]


class KVPool:
    """Per-layer K and V buffers of ``size`` slots each: ``k_buffers[layer][slot]``.

    A slot holds one token's K (or V) for every KV head: ``[size, num_kv_heads, head_dim]``,
    in ``dtype`` (``--kv-cache-dtype``; writers cast to it, attention converts what it
    reads to the compute dtype). Which slot belongs to whom is the allocator's and the
    radix tree's business.
    """

    def __init__(
        self,
        size: int,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
    ) -> None:
        self.size = size
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.device = torch.device(device)
        shape = (size, num_kv_heads, head_dim)
        buffers = pool_buffers(2 * num_layers, shape, dtype, self.device)
        self.k_buffers, self.v_buffers = buffers[:num_layers], buffers[num_layers:]

    @staticmethod
    def bytes_per_token(
        num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
    ) -> int:
        itemsize = torch.empty((), dtype=dtype).element_size()
        return 2 * num_layers * num_kv_heads * head_dim * itemsize

    def get_kv_buffer(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k_buffers[layer_id], self.v_buffers[layer_id]


class SWAKVPool:
    """The KV pool of a model with sliding layers under ``--enable-hybrid-swa-memory``:
    full-attention layers keep ``size`` slots each (``full``), sliding layers ``swa_size``
    slots each (``swa``), and ``full_to_swa[full slot]`` names a token's row in the
    sliding layers (``radix_cache/swa_allocator.py`` writes it). The last slot of each
    buffer set is padding: the full pool's is mapped to the SWA pool's, which no token
    owns, so a translated index always reads a finite row.

    ``get_kv_buffer(layer)`` returns that layer's buffers from the pool it lives in.
    """

    def __init__(self, size: int, swa_size: int, swa_layers: list[int], num_layers: int,
                 num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device | str = "cpu") -> None:
        self.size, self.swa_size = size, swa_size
        self.num_layers, self.num_kv_heads, self.head_dim = num_layers, num_kv_heads, head_dim
        self.dtype = dtype
        self.device = torch.device(device)
        self.swa_layers = frozenset(swa_layers)
        full_layers = [i for i in range(num_layers) if i not in self.swa_layers]
        # layer id -> (pool, index of the layer in it)
        self._where = {i: (self.swa_layers.__contains__(i),
                           (sorted(self.swa_layers) if i in self.swa_layers else full_layers
                            ).index(i)) for i in range(num_layers)}
        self.full = KVPool(size + 1, len(full_layers), num_kv_heads, head_dim, dtype, device)
        self.swa = KVPool(swa_size + 1, len(self.swa_layers), num_kv_heads, head_dim, dtype,
                          device)
        self.full_to_swa = torch.full((size + 1,), swa_size, dtype=torch.int64,
                                      device=self.device)

    def is_swa_layer(self, layer_id: int) -> bool:
        return layer_id in self.swa_layers

    def get_kv_buffer(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        in_swa, i = self._where[layer_id]
        return (self.swa if in_swa else self.full).get_kv_buffer(i)


class ReqToTokenPool:
    """``req_to_token[req_pool_idx, pos]`` = KV slot of token ``pos`` of that request.

    Rows are handed out to running requests (``alloc``) and returned when they finish or
    are retracted (``free``). Plain bookkeeping: no model, no tree.
    """

    def __init__(self, max_reqs: int, max_context_len: int, device: torch.device | str = "cpu"):
        self.max_reqs = max_reqs
        self.max_context_len = max_context_len
        self.req_to_token = torch.zeros(
            (max_reqs, max_context_len), dtype=torch.int64, device=device
        )
        self._free_rows: list[int] = list(range(max_reqs - 1, -1, -1))

    def available_size(self) -> int:
        return len(self._free_rows)

    def alloc(self) -> int | None:
        return self._free_rows.pop() if self._free_rows else None

    def free(self, idx: int) -> None:
        assert 0 <= idx < self.max_reqs and idx not in self._free_rows, f"bad free of row {idx}"
        self._free_rows.append(idx)
