"""Sizing of the SWA pool (``--enable-hybrid-swa-memory``): which layers go to it and
how many slots each pool gets.

Full-attention layers need every token of a sequence; sliding layers only its last
``window``. With ``r = --swa-full-tokens-ratio``, a pool of ``F`` full slots comes with
``S = r * F`` sliding slots, so one full slot costs ``full_bytes + r * swa_bytes`` (per
token: K and V of the full layers, and of the sliding layers), against
``full_bytes + swa_bytes`` with one pool. A request holds at most ``window + 3 pages`` of
its own sliding slots besides the tokens of its current forward
(``CacheManager.trim_windows``) and, until its window has passed its cached prefix, the
sliding lock on that prefix's last window (``radix_cache/swa_tree.py``), so ``S`` must
leave room for both and a page (``min_swa_pool``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from radixlm.radix_cache.kv_pool import KVPool


def sliding_layers(model: nn.Module) -> dict[int, int]:
    """Layer id -> sliding window, for the model's sliding layers."""
    return {i: layer.self_attn.attn.sliding_window for i, layer in enumerate(model.model.layers)
            if layer.self_attn.attn.sliding_window is not None}


@dataclass(frozen=True)
class SWALayout:
    """How a model's layers split between the pools (``swa_layers``: ids) and the widest
    window of its sliding layers (what a request must keep)."""

    num_layers: int
    swa_layers: tuple[int, ...]
    window: int

    @classmethod
    def of(cls, model: nn.Module) -> SWALayout | None:
        """None for a model without sliding layers (one pool serves it)."""
        windows = sliding_layers(model)
        if not windows:
            return None
        return cls(len(model.model.layers), tuple(sorted(windows)), max(windows.values()))

    def bytes_per_token(self, num_kv_heads: int, head_dim: int, dtype: torch.dtype
                        ) -> tuple[int, int]:
        """(full layers', sliding layers') K and V bytes of one token."""
        n_swa = len(self.swa_layers)
        return (KVPool.bytes_per_token(self.num_layers - n_swa, num_kv_heads, head_dim, dtype),
                KVPool.bytes_per_token(n_swa, num_kv_heads, head_dim, dtype))


def min_swa_pool(window: int, page_size: int) -> int:
    """The smallest sliding pool one request can run in: its own window + 3 pages, the
    tree's window it locks until its own passes it (``swa_tree.py``), a page to grow."""
    return 2 * (-(-window // page_size) * page_size) + 5 * page_size


def swa_pool_size(full_size: int, ratio: float, window: int, page_size: int) -> int:
    """Sliding slots for ``full_size`` full slots (page-aligned); ValueError naming
    --swa-full-tokens-ratio when that leaves less than ``min_swa_pool``."""
    size = int(full_size * ratio)
    size -= size % page_size
    need = min_swa_pool(window, page_size)
    if size < need:
        raise ValueError(
            f"--swa-full-tokens-ratio {ratio} gives the sliding-window pool {size} slots for "
            f"{full_size} full slots; it needs at least {need} (two windows of {window} and 5 "
            f"pages of {page_size}): raise the ratio or the pool size")
    return size
