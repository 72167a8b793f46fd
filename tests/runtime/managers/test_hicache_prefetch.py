"""HiCache's prefetch policies without a model: a backend whose third page blocks until the
test lets it go shows what ``take`` hands back under ``best_effort`` (the pages read when
the request is scheduled, and the one in flight) and ``wait_complete`` (all of them)."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from radixlm.radix_cache.storage.base import StorageBackend
from radixlm.radix_cache.storage.page_format import encode_page
from radixlm.radix_cache.storage.tier import StorageTier
from radixlm.runtime.managers.scheduler.hicache import HiCache

BLOCK, SHAPE = 64, (2, 64, 1, 2)  # one layer, one KV head, head_dim 2
TOKENS = list(range(5, 5 + 5 * BLOCK))  # five pages


class GatedBackend(StorageBackend):
    """Pages in a dict; reading ``gated_key`` waits for ``release``."""

    name = "gated"

    def __init__(self) -> None:
        self.pages: dict[str, bytes] = {}
        self.gated_key = ""
        self.gate_reached, self.release = threading.Event(), threading.Event()

    def get(self, key):
        if key == self.gated_key:
            self.gate_reached.set()
            assert self.release.wait(60), "the test never released the gate"
        return self.pages.get(key)

    def put(self, key, data):
        self.pages[key] = data
        return True

    def exists(self, key):
        return key in self.pages

    def size(self, key):
        return len(self.pages[key]) if key in self.pages else None

    def delete(self, key):
        self.pages.pop(key, None)

    def info(self):
        return {"backend": self.name}


def _hicache(policy: str) -> tuple[HiCache, GatedBackend]:
    backend = GatedBackend()
    tier = StorageTier(backend, torch.float32, SHAPE)
    cache = HiCache(tier, BLOCK, {"device": "cpu"}, "write_through", policy,
                    read_kv=lambda slots: [], write_kv=lambda slots, frames: None)
    cache.identity = "test-model"
    for i, key in enumerate(cache.keys(TOKENS, None)):
        kv = torch.full(SHAPE, float(i))
        backend.pages[key] = encode_page(key, TOKENS[i * BLOCK:(i + 1) * BLOCK], kv)
    backend.gated_key = cache.keys(TOKENS, None)[3]
    return cache, backend


@pytest.mark.parametrize("policy, pages", [("best_effort", 3), ("wait_complete", 4)])
def test_take_per_prefetch_policy(policy, pages):
    """The request holds page 0 in the pool; pages 1 and 2 arrive, page 3 is in flight when
    it is scheduled: best_effort stops after it; wait_complete waits for page 4 too (there
    is none past the fifth)."""
    cache, backend = _hicache(policy)
    try:
        cache.prefetch("r", TOKENS, None, cached_len=BLOCK)
        assert backend.gate_reached.wait(30)
        load = cache.loads["r"]
        got: list = []
        taker = threading.Thread(target=lambda: got.append(cache.take("r", TOKENS, None,
                                                                       BLOCK)))
        taker.start()
        deadline = time.monotonic() + 30
        while policy == "best_effort" and not load.cancelled:  # take has decided
            assert time.monotonic() < deadline
            time.sleep(0.001)
        backend.release.set()
        taker.join(30)
        start, kv = got[0]
        assert start == BLOCK and kv.shape == (2, pages * BLOCK, 1, 2)
        firsts = kv[0, ::BLOCK, 0, 0].tolist()
        assert firsts == [float(i) for i in range(1, 1 + pages)]
        assert cache.tier._prefetched_bytes == 0  # the budget is back
    finally:
        backend.release.set()
        cache.close()

