"""SWAAllocator and the cache manager's two pools: full and sliding slots allocated page to
page, sliding slots trimmed behind each request's window, and random admit / extend /
finish / retract / evict sequences that keep both pools' accounting and the mapping
sound (``CacheManager.check_accounting``)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from radixlm.radix_cache.swa_allocator import SWAAllocator, SWASpec
from radixlm.runtime.executor.sampling_params import SamplingParams
from radixlm.runtime.managers.scheduler.cache_manager import CacheManager
from radixlm.runtime.managers.scheduler.schedule_batch import Req


def _allocator(size: int, swa_size: int, page: int) -> SWAAllocator:
    return SWAAllocator(size, swa_size, torch.full((size + 1,), swa_size), page)


@pytest.mark.parametrize("page", [1, 4])
def test_pages_map_to_whole_sliding_pages(page: int) -> None:
    a = _allocator(16 * page, 4 * page, page)
    slots = a.alloc(3 * page)
    assert slots is not None
    swa = a.full_to_swa[slots].view(-1, page)
    assert bool((swa == swa[:, :1] + torch.arange(page)).all())
    assert a.available_size() == 13 * page and a.swa_available_size() == page
    assert a.alloc(2 * page) is None  # the sliding pool is short: nothing changes
    assert a.available_size() == 13 * page and a.swa_available_size() == page
    a.free_swa(slots[:page])  # only the sliding page goes back
    assert a.available_size() == 13 * page and a.swa_available_size() == 2 * page
    assert not bool(a.has_swa(slots[:page]).any()) and bool(a.has_swa(slots[page:]).all())
    with pytest.raises(AssertionError, match="without an SWA slot"):
        a.free_swa(slots[:page])
    a.check_mapping()
    a.free(slots)  # full pages, and the sliding pages they still have
    assert a.available_size() == 16 * page and a.swa_available_size() == 4 * page
    assert bool((a.full_to_swa == 4 * page).all())
    a.check_mapping()


WINDOW = 8


class SWACacheMachine(RuleBasedStateMachine):
    """The scheduler's use of the cache manager, with a forward that only moves ``kv_len``."""

    page = 1
    radix = False

    def __init__(self) -> None:
        super().__init__()
        size, swa_size = 96 * self.page, 8 * self.page + WINDOW + 4 * self.page
        spec = SWASpec(swa_size, WINDOW, torch.full((size + 1,), swa_size))
        self.cache = CacheManager(size, self.page, 6, 200, not self.radix,
                                  torch.device("cpu"), swa=spec)
        self.next_rid = 0

    def _running(self, data) -> Req:
        return data.draw(st.sampled_from(sorted(self.cache.running.values(),
                                                key=lambda r: r.rid)))

    def _extend(self, req: Req, n: int) -> bool:
        """alloc, forward (kv_len moves), then what the output processor does."""
        n = min(n, self.cache.max_extend)
        if not self.cache.alloc(req, n):
            return False
        req.kv_len += n
        if req.is_prefilling:
            self.cache.cache_unfinished(req)
        return True

    @rule(data=st.data(), length=st.integers(2, 50), share=st.booleans())
    def admit(self, data, length: int, share: bool) -> None:
        ids = [7] * 30 + [data.draw(st.integers(0, 3)) for _ in range(length)]
        if not share:
            ids = [data.draw(st.integers(0, 9)) for _ in range(length)]
        req = Req(f"r{self.next_rid}", ids, SamplingParams(max_new_tokens=8))
        self.next_rid += 1
        if not self.cache.admit(req):
            return
        # a prefill chunk of the prompt past its cached prefix (never past the prompt: a
        # scheduler does not extend a prefill beyond it; drawing up to `length` from the
        # prefix on did, and the cached tail then held one slot too many)
        room = req.seq_len - req.kv_len
        if room < 1 or not self._extend(req, min(data.draw(st.integers(1, length)), room)):
            self.cache.release(req, cache=False)

    @precondition(lambda self: self.cache.running)
    @rule(data=st.data(), n=st.integers(1, 20))
    def step(self, data, n: int) -> None:
        req = self._running(data)
        if req.is_prefilling:
            self._extend(req, min(n, req.seq_len - req.kv_len))
        else:
            req.output_ids.append(data.draw(st.integers(0, 9)))
            self._extend(req, 1)

    @precondition(lambda self: self.cache.running)
    @rule(data=st.data(), cache=st.booleans())
    def finish(self, data, cache: bool) -> None:
        self.cache.release(self._running(data), cache=cache)

    @rule(n=st.integers(0, 64))
    def make_room(self, n: int) -> None:
        self.cache.ensure_free(n - n % self.page)

    @invariant()
    def accounting(self) -> None:
        self.cache.check_accounting(deep=True)

    @invariant()
    def windows_kept(self) -> None:
        """Every running request still has the sliding K/V its next query reads."""
        table = self.cache.req_to_token_pool.req_to_token
        for r in self.cache.running.values():
            lo = max(r.kv_len - WINDOW, 0)
            assert bool(self.cache.allocator.has_swa(table[r.req_pool_idx, lo:r.kv_len]).all())


SWACacheMachine.TestCase.settings = settings(max_examples=40, stateful_step_count=40,
                                              deadline=None)
TestSWACache = SWACacheMachine.TestCase


class SWACacheMachinePaged(SWACacheMachine):
    page = 4


SWACacheMachinePaged.TestCase.settings = SWACacheMachine.TestCase.settings
TestSWACachePaged = SWACacheMachinePaged.TestCase


class SWACacheMachineRadix(SWACacheMachine):
    """With the radix cache: tombstones, sliding locks, revived nodes, sliding eviction."""

    radix = True

    @rule(n=st.integers(1, 32))
    def evict_swa(self, n: int) -> None:
        self.cache.tree.evict_swa(n)


class SWACacheMachineRadixPaged(SWACacheMachineRadix):
    page = 4


for _m in (SWACacheMachineRadix, SWACacheMachineRadixPaged):
    _m.TestCase.settings = SWACacheMachine.TestCase.settings
TestSWACacheRadix = SWACacheMachineRadix.TestCase
TestSWACacheRadixPaged = SWACacheMachineRadixPaged.TestCase
