"""The KV pool's buffers: zeroed, independent per layer and side, and on a Linux CPU placed
in memory advised into transparent huge pages (decode attention reads scattered rows)."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
import torch

from radixlm.radix_cache import kv_pool
from radixlm.radix_cache.kv_pool import KVPool

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def _anon_huge_kb(ptr: int) -> int:
    """AnonHugePages of the mapping holding address ``ptr`` (/proc/self/smaps)."""
    span = None
    for line in Path("/proc/self/smaps").read_text().splitlines():
        m = re.match(r"([0-9a-f]+)-([0-9a-f]+) ", line)
        if m:
            span = (int(m[1], 16), int(m[2], 16))
        elif line.startswith("AnonHugePages:") and span and span[0] <= ptr < span[1]:
            return int(line.split()[1])
    raise AssertionError(f"no mapping holds {ptr:#x}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e5m2])
def test_buffers_are_zeroed_shaped_and_independent(dtype):
    pool = KVPool(size=1000, num_layers=3, num_kv_heads=2, head_dim=24, dtype=dtype)
    bufs = pool.k_buffers + pool.v_buffers
    assert len(bufs) == 6
    for b in bufs:
        assert b.shape == (1000, 2, 24) and b.dtype == dtype and b.is_contiguous()
        assert b.float().abs().sum() == 0
    for i, b in enumerate(bufs):  # a write lands in one buffer only
        b[999, 1, 23] = i + 1
        b[0, 0, 0] = -(i + 1)
    for i, b in enumerate(bufs):
        assert b.float().count_nonzero() == 2
        assert b[999, 1, 23].item() == i + 1 and b[0, 0, 0].item() == -(i + 1)
    assert pool.get_kv_buffer(2) == (pool.k_buffers[2], pool.v_buffers[2])


def test_buffers_do_not_share_bytes():
    pool = KVPool(size=4096, num_layers=2, num_kv_heads=4, head_dim=64, dtype=torch.bfloat16)
    spans = sorted((b.data_ptr(), b.data_ptr() + b.numel() * b.element_size())
                   for b in pool.k_buffers + pool.v_buffers)
    assert all(end <= nxt for (_, end), (nxt, _) in zip(spans, spans[1:]))


@pytest.mark.skipif(not sys.platform.startswith("linux") or not THP.exists()
                    or "[never]" in THP.read_text(),
                    reason="needs Linux with transparent huge pages enabled")
def test_cpu_pool_is_backed_by_huge_pages():
    # 12 layers x 4 heads x 64 x bf16 x 8192 slots: 48 MB, mostly whole 2 MB pages
    pool = KVPool(size=8192, num_layers=12, num_kv_heads=4, head_dim=64, dtype=torch.bfloat16)
    first = pool.k_buffers[0]
    assert first.data_ptr() % (2 << 20) == 0  # the slab starts on a huge-page boundary
    assert _anon_huge_kb(first.data_ptr()) >= 16 * 1024


def test_pool_without_huge_page_advice_still_works(monkeypatch):
    monkeypatch.setattr(kv_pool, "_advise_huge_pages", lambda t: False)
    pool = KVPool(size=64, num_layers=1, num_kv_heads=1, head_dim=8, dtype=torch.float32)
    assert pool.k_buffers[0].abs().sum() == 0 and pool.v_buffers[0].shape == (64, 1, 8)
