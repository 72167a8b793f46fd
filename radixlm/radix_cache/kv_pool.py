"""KV storage: per-layer K and V buffers, and the request-to-token table."""

from __future__ import annotations

import torch

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
        self.k_buffers = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v_buffers = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]

    @staticmethod
    def bytes_per_token(
        num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
    ) -> int:
        itemsize = torch.empty((), dtype=dtype).element_size()
        return 2 * num_layers * num_kv_heads * head_dim * itemsize

    def get_kv_buffer(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k_buffers[layer_id], self.v_buffers[layer_id]


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
