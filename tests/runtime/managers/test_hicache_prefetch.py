"""HiCache's prefetch policies without a model: a backend whose fourth page blocks until the
test lets it go shows when a queued request is ``ready`` under each policy and what
``take`` hands back (never waiting); a page that never comes is a miss past the tier's
page deadline, and the loads behind it go on in a new thread."""

from __future__ import annotations

import math
import threading
import time

import pytest
import torch

from radixlm.radix_cache.storage import prefetch_policy
from radixlm.radix_cache.storage.base import StorageBackend
from radixlm.radix_cache.storage.page_format import encode_page
from radixlm.radix_cache.storage.prefetch_policy import timeout_s, wait_s
from radixlm.radix_cache.storage.tier import StorageTier
from radixlm.runtime.config_checks import HICACHE_PREFETCH_POLICIES
from radixlm.runtime.managers.scheduler.hicache import HiCache

BLOCK, SHAPE = 64, (2, 64, 1, 2)  # one layer, one KV head, head_dim 2
TOKENS = list(range(5, 5 + 5 * BLOCK))  # five pages
OTHER = list(range(500, 500 + 3 * BLOCK))  # three pages, none gated


class GatedBackend(StorageBackend):
    """Pages in a dict; reading ``gated_key`` waits for ``release``."""

    name = "gated"

    def __init__(self) -> None:
        self.pages: dict[str, bytes] = {}
        self.gated_key = ""
        self.gate_reached, self.release = threading.Event(), threading.Event()

    def get(self, key, size):
        if key == self.gated_key:
            self.gate_reached.set()
            self.release.wait(120)
        data = self.pages.get(key)
        return data if data is not None and len(data) == size else None

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


def _store(cache: HiCache, backend: GatedBackend, tokens: list[int]) -> list[str]:
    keys = cache.keys(tokens, None)
    for i, key in enumerate(keys):
        kv = torch.full(SHAPE, float(i))
        backend.pages[key] = encode_page(key, tokens[i * BLOCK:(i + 1) * BLOCK], kv)
    return keys


@pytest.fixture
def tiered():
    made = []

    def make(policy: str, page_deadline: float = 3600.0) -> tuple[HiCache, GatedBackend]:
        backend = GatedBackend()
        tier = StorageTier(backend, torch.float32, SHAPE)
        tier.page_deadline = page_deadline  # no read outlives it unless the test says so
        cache = HiCache(tier, BLOCK, {"device": "cpu"}, "write_through", policy,
                        read_kv=lambda slots: [], write_kv=lambda slots, frames: None)
        cache.identity = "test-model"
        backend.gated_key = _store(cache, backend, TOKENS)[3]
        _store(cache, backend, OTHER)
        made.append((cache, backend))
        return cache, backend

    yield make
    for cache, backend in made:
        backend.release.set()
        cache.close()


def _until(predicate, what: str) -> None:
    """A guard against a hang, not a timing assertion: the condition holds long before."""
    limit = time.monotonic() + 60
    while not predicate():
        assert time.monotonic() < limit, f"{what} never happened"
        time.sleep(0.005)


def _firsts(got) -> list[float]:
    start, kv = got
    assert start == BLOCK
    return kv[0, ::BLOCK, 0, 0].tolist()


@pytest.mark.parametrize("policy, waits, pages", [
    ("best_effort", False, [1.0, 2.0]),  # pages 1 and 2 arrived; 3 was in flight: dropped
    ("wait_complete", True, [1.0, 2.0, 3.0, 4.0]),
    ("timeout", True, [1.0, 2.0, 3.0, 4.0]),
    ("auto", True, [1.0, 2.0, 3.0, 4.0]),  # computing measured slower than loading
])
def test_ready_and_take_per_policy(tiered, monkeypatch, policy, waits, pages):
    """Page 0 is in the pool; pages 1 and 2 arrive and page 3 is in flight when the
    scheduler asks whether the request may run."""
    monkeypatch.setattr(prefetch_policy, "TIMEOUT_BASE_S", 3600.0)  # no deadline in reach
    cache, backend = tiered(policy)
    cache.observe_prefill(100, 100.0)  # a second per token: loading is faster
    cache.prefetch("r", TOKENS, None, cached_len=BLOCK)
    assert backend.gate_reached.wait(60)
    assert cache.ready("r") is not waits
    assert cache.loading()
    if waits:
        backend.release.set()
        _until(lambda: cache.ready("r"), "the load ending")
    assert _firsts(cache.take("r", TOKENS, None, BLOCK)) == pages
    backend.release.set()
    _until(lambda: cache.tier._prefetched_bytes == 0, "the budget coming back")


def test_auto_does_not_wait_when_loading_is_measured_slower(tiered):
    cache, backend = tiered("auto")
    cache.observe_prefill(1000, 0.001)  # a microsecond per token
    cache.tier.page_seconds = 1.0  # a second per page
    cache.prefetch("r", TOKENS, None, cached_len=BLOCK)
    assert backend.gate_reached.wait(60)
    assert cache.ready("r")


def test_a_page_past_its_deadline_is_a_miss_and_the_loads_behind_it_go_on(tiered):
    """wait_complete too: the gated page never comes (an injected stall); past the page
    deadline the request runs with the pages before it, the stuck thread is replaced and
    the next request's load completes."""
    cache, backend = tiered("wait_complete", page_deadline=0.2)
    cache.prefetch("r", TOKENS, None, cached_len=BLOCK)
    cache.prefetch("s", OTHER, None, cached_len=0)  # queued behind the stuck read
    assert backend.gate_reached.wait(60)
    _until(lambda: cache.ready("r"), "the page deadline")
    assert _firsts(cache.take("r", TOKENS, None, BLOCK)) == [1.0, 2.0]
    assert cache.tier.stats["reads_timed_out"] == 1
    cache.tier.page_deadline = 3600.0  # the next reads, however slow today, are not stalls
    _until(lambda: cache.ready("s"), "the next load")
    start, kv = cache.take("s", OTHER, None, 0)
    assert start == 0 and kv.shape[1] == 3 * BLOCK


def test_reads_stop_after_too_many_stuck_threads(tiered, monkeypatch):
    from radixlm.radix_cache.storage import tier as tier_module

    monkeypatch.setattr(tier_module, "MAX_STUCK_READERS", 1)
    cache, backend = tiered("wait_complete", page_deadline=0.2)
    cache.prefetch("r", TOKENS, None, cached_len=BLOCK)
    _until(lambda: cache.ready("r"), "the page deadline")
    assert cache.tier.reads_stopped
    cache.prefetch("s", OTHER, None, cached_len=0)
    assert cache.ready("s") and cache.take("s", OTHER, None, 0) is None


def test_the_wait_each_policy_allows():
    assert set(prefetch_policy.PREFETCH_POLICIES) == set(HICACHE_PREFETCH_POLICIES)
    assert wait_s("best_effort", 4, 256, 1.0, 0.001) == 0.0
    assert wait_s("wait_complete", 4, 256, None, None) == math.inf
    assert wait_s("timeout", 4, 2048, 1.0, 0.001) == timeout_s(2048) == 2.2
    assert timeout_s(10 ** 7) == 30.0  # SGLang's cap
    assert wait_s("auto", 4, 256, 0.01, 0.1) == pytest.approx(2.56)  # 0.4 s < 2.56 s
    assert wait_s("auto", 4, 256, 0.001, 0.1) == 0.0  # 0.4 s > 0.256 s: compute it
    assert wait_s("auto", 4, 256, 0.01, None) == pytest.approx(2.56)  # no load measured
    assert wait_s("auto", 4, 256, None, None) == timeout_s(256)  # nothing computed yet
    assert wait_s("auto", 0, 0, 0.01, 0.1) == 0.0


def test_requests_past_the_kept_loads_go_on_without_storage(tiered, monkeypatch):
    """More queued requests than loads kept: the ones whose loads were dropped are ready at
    once (no storage), and asking never restarts a load at another request's expense (it
    did: each pass dropped the next request's load, and under wait_complete none ended)."""
    from radixlm.runtime.managers.scheduler import hicache as hicache_module

    monkeypatch.setattr(hicache_module, "MAX_LOADS", 1)
    cache, backend = tiered("wait_complete")
    cache.prefetch("r", TOKENS, None, cached_len=BLOCK)  # its page 3 is gated
    cache.prefetch("s", OTHER, None, cached_len=0)  # drops r's load
    kept = dict(cache.loads)
    for _ in range(3):  # scheduling passes over the queue
        assert cache.ready("r")
        cache.ready("s")
    assert dict(cache.loads) == kept and set(kept) == {"s"}
    _until(lambda: cache.ready("s"), "s's load")
    start, kv = cache.take("s", OTHER, None, 0)
    assert start == 0 and kv.shape[1] == 3 * BLOCK
    backend.release.set()
