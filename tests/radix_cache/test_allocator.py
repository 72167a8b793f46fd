"""PagedAllocator: whole-page alloc / free round trips and the double-free guard."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from radixlm.radix_cache.allocator import PagedAllocator


def assert_whole_pages(slots: torch.Tensor, page_size: int) -> None:
    pages = slots.view(-1, page_size)  # [num_pages, page_size]
    assert bool((pages[:, 0] % page_size == 0).all())
    assert bool((pages == pages[:, :1] + torch.arange(page_size)).all())


@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_alloc_free_round_trip(page_size: int) -> None:
    alloc = PagedAllocator(64 * page_size, page_size)
    assert alloc.available_size() == alloc.size
    a = alloc.alloc(3 * page_size)
    b = alloc.alloc(5 * page_size)
    assert a is not None and b is not None
    assert a.dtype == torch.int64 and a.numel() == 3 * page_size
    assert_whole_pages(a, page_size)
    assert_whole_pages(b, page_size)
    assert not set(a.tolist()) & set(b.tolist())
    assert alloc.available_size() == alloc.size - 8 * page_size
    alloc.free(a)
    alloc.free(b)
    assert alloc.available_size() == alloc.size
    assert alloc.free_slots().tolist() == list(range(alloc.size))


@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_exhaustion_returns_none_without_side_effects(page_size: int) -> None:
    alloc = PagedAllocator(4 * page_size, page_size)
    held = alloc.alloc(3 * page_size)
    assert held is not None
    before = (alloc.free_pages.clone(), alloc.is_free.clone())
    assert not alloc.can_alloc(2 * page_size)
    assert alloc.alloc(2 * page_size) is None
    assert torch.equal(alloc.free_pages, before[0]) and torch.equal(alloc.is_free, before[1])
    assert alloc.can_alloc(page_size)
    last = alloc.alloc(page_size)
    assert last is not None and alloc.available_size() == 0
    assert alloc.alloc(page_size) is None
    assert alloc.alloc(0) is not None and alloc.alloc(0).numel() == 0


@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_double_free_asserts_with_page_id(page_size: int) -> None:
    alloc = PagedAllocator(8 * page_size, page_size)
    slots = alloc.alloc(2 * page_size)
    assert slots is not None
    alloc.free(slots)
    with pytest.raises(AssertionError, match="double free"):
        alloc.free(slots[-1:])
    never = torch.tensor([7 * page_size])  # page 7 was never allocated
    with pytest.raises(AssertionError, match=r"\[7\]"):
        alloc.free(never)


def test_free_whole_page_from_one_slot_and_empty_is_noop() -> None:
    alloc = PagedAllocator(16, 4)
    slots = alloc.alloc(8)
    assert slots is not None
    alloc.free(torch.empty(0, dtype=torch.int64))
    assert alloc.available_size() == 8
    alloc.free(slots[5:6])  # frees the whole second page
    assert alloc.available_size() == 12
    assert not bool(alloc.is_free[slots[0] // 4])
    assert bool(alloc.is_free[slots[5] // 4])


def test_bad_arguments() -> None:
    with pytest.raises(ValueError):
        PagedAllocator(10, 4)
    with pytest.raises(ValueError):
        PagedAllocator(0, 1)
    alloc = PagedAllocator(16, 4)
    with pytest.raises(AssertionError):
        alloc.alloc(3)
    with pytest.raises(AssertionError):
        alloc.free(torch.tensor([16]))


def test_reset_and_reuse_of_recent_pages() -> None:
    alloc = PagedAllocator(16, 4)
    a = alloc.alloc(8)
    assert a is not None
    alloc.free(a[4:])
    again = alloc.alloc(4)
    assert again is not None and again.tolist() == a[4:].tolist()
    alloc.reset()
    assert alloc.available_size() == 16 and bool(alloc.is_free.all())


@settings(max_examples=60, deadline=None)
@given(
    page_size=st.sampled_from([1, 4]),
    ops=st.lists(st.tuples(st.booleans(), st.integers(0, 6)), max_size=40),
)
def test_random_alloc_free_keeps_accounting(page_size: int, ops: list[tuple[bool, int]]) -> None:
    alloc = PagedAllocator(16 * page_size, page_size)
    held: list[torch.Tensor] = []
    for is_alloc, n in ops:
        if is_alloc:
            slots = alloc.alloc(n * page_size)
            if slots is None:
                assert n * page_size > alloc.available_size()
            else:
                held.append(slots)
        elif held:
            alloc.free(held.pop(n % len(held)))
        owned = torch.cat(held) if held else torch.empty(0, dtype=torch.int64)
        free = alloc.free_slots()
        assert owned.numel() + free.numel() == alloc.size == owned.numel() + alloc.available_size()
        everything = torch.cat([owned, free]).sort().values
        assert torch.equal(everything, torch.arange(alloc.size))
