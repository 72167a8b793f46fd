"""KV storage: per-layer K and V buffers, and the request-to-token table."""

from __future__ import annotations

import torch


class KVPool:
    """Per-layer K and V buffers of ``size`` slots each: ``k_buffers[layer][slot]``.

    A slot holds one token's K (or V) for every KV head: ``[size, num_kv_heads, head_dim]``.
    Which slot belongs to whom is the allocator's and the radix tree's business.
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
