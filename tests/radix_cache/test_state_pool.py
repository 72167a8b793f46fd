"""The state pool of hybrid models: the scheduler's slots (one per running request, taken at
admission, given back when it finishes or is retracted, counted by ``check_accounting``) and
the executor's tensors (fresh sequences read zeros, not a freed slot's leftovers)."""

from __future__ import annotations

import pytest
import torch

from radixlm.radix_cache.state_pool import StatePool, StateSlots, StateSpec
from radixlm.runtime.executor.sampling_params import SamplingParams
from radixlm.runtime.managers.scheduler.cache_manager import CacheManager
from radixlm.runtime.managers.scheduler.schedule_batch import Req, ScheduleBatch


def test_slots_alloc_free_and_integrity():
    slots = StateSlots(3)
    got = [slots.alloc() for _ in range(3)]
    assert sorted(got) == [0, 1, 2] and slots.alloc() is None
    slots.check_integrity(got)
    slots.free(got[1])
    assert slots.available_size() == 1 and slots.alloc() == got[1]  # the last freed first
    with pytest.raises(AssertionError, match="bad free"):
        slots.free(7)
    slots.free(got[0])
    with pytest.raises(AssertionError, match="bad free"):
        slots.free(got[0])
    with pytest.raises(AssertionError, match="owned twice"):
        slots.check_integrity([got[1], got[1]])
    with pytest.raises(AssertionError, match="free or unknown"):
        slots.check_integrity([got[0], got[1], got[2]])  # got[0] is free
    with pytest.raises(AssertionError, match="state accounting broken"):
        slots.check_integrity([got[1]])  # got[2] leaked: owned by no request
    with pytest.raises(ValueError):
        StateSlots(0)


def test_pool_reads_zeros_for_fresh_sequences():
    specs = {1: StateSpec(6, 3, (2, 4, 5)), 3: StateSpec(6, 3, (2, 4, 5))}
    pool = StatePool(4, specs, torch.float32)
    assert pool.nbytes == 4 * 2 * (6 * 3 + 2 * 4 * 5) * 4
    slots = torch.tensor([2, 0])
    conv, ssm = torch.randn(2, 6, 3), torch.randn(2, 2, 4, 5)
    pool.write(3, slots, conv, ssm)
    c, s = pool.read(3, slots, None)
    torch.testing.assert_close((c, s), (conv, ssm), rtol=0, atol=0)
    assert not bool(pool.ssm[1].any()), "another layer's state was written"
    c, s = pool.read(3, torch.tensor([0, 2]), torch.tensor([True, False]))
    assert not bool(c[0].any()) and not bool(s[0].any())  # fresh: zeros, not slot 0's
    torch.testing.assert_close(s[1], ssm[0], rtol=0, atol=0)
    torch.testing.assert_close(pool.ssm[3][0], ssm[1], rtol=0, atol=0)  # the slot untouched


def _req(rid: str, n: int = 10) -> Req:
    return Req(rid, list(range(1, n + 1)), SamplingParams(max_new_tokens=4))


def _cache(state_slots: int, max_reqs: int = 6) -> CacheManager:
    return CacheManager(128, 1, max_reqs, 64, True, torch.device("cpu"),
                        state_slots=state_slots)


def test_admission_waits_for_a_state_slot():
    cache = _cache(state_slots=2)
    a, b, c = _req("a"), _req("b"), _req("c")
    assert cache.admit(a) and cache.admit(b)
    rows = cache.req_to_token_pool.available_size()
    assert not cache.admit(c), "admitted without a state slot"
    assert c.state_slot is None and c.req_pool_idx is None
    assert cache.req_to_token_pool.available_size() == rows, "the row was kept"
    assert {a.state_slot, b.state_slot} == {0, 1}
    cache.check_accounting()
    assert cache.alloc(a, 10)
    a.kv_len = 10
    batch = ScheduleBatch([a, b], [1, 10])
    assert batch.worker_batch().state_slots == [a.state_slot, b.state_slot]
    slot = a.state_slot
    cache.release(a, cache=True)  # finished
    assert a.state_slot is None
    assert cache.admit(c) and c.state_slot == slot
    cache.check_accounting()


def test_retraction_frees_the_slot_and_accounting_sees_leaks():
    cache = _cache(state_slots=3)
    reqs = [_req(str(i)) for i in range(3)]
    for r in reqs:
        assert cache.admit(r) and cache.alloc(r, 10)
        r.kv_len = 10
    cache.release(reqs[0], cache=False)  # retracted: it recomputes from kv_len 0
    reqs[0].on_retracted()
    assert cache.states.available_size() == 1
    cache.check_accounting()
    assert cache.admit(reqs[0]) and reqs[0].kv_len == 0
    cache.check_accounting()
    reqs[1].state_slot = reqs[2].state_slot  # two requests on one slot
    with pytest.raises(AssertionError, match="owned twice"):
        cache.check_accounting()
    reqs[1].state_slot = None
    with pytest.raises(AssertionError, match="without a state slot"):
        cache.check_accounting()


def test_no_state_pool_for_attention_models():
    cache = _cache(state_slots=0)
    r = _req("a")
    assert cache.admit(r) and r.state_slot is None and cache.states is None
    assert ScheduleBatch([r], [10]).worker_batch().state_slots is None
    cache.check_accounting()
