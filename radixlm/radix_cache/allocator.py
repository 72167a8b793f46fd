"""Paged free list over KV slots: alloc / free / available."""

from __future__ import annotations

import torch


class PagedAllocator:
    """Hands out KV slots ``0 .. size-1`` in whole pages of ``page_size`` consecutive slots.

    Page ``p`` is slots ``[p * page_size, (p + 1) * page_size)``. Free pages live in a
    tensor used as a stack: ``free`` pushes pages on the front and ``alloc`` takes from the
    front, so recently freed pages are reused first. ``is_free[p]`` says whether page ``p``
    is free; freeing a free page is a bug and raises ``AssertionError``.
    """

    def __init__(self, size: int, page_size: int = 1, device: torch.device | str = "cpu"):
        if page_size <= 0:
            raise ValueError(f"page_size must be positive, got {page_size}")
        if size <= 0 or size % page_size != 0:
            raise ValueError(
                f"size must be a positive multiple of page_size={page_size}, got {size}"
            )
        self.size = size
        self.page_size = page_size
        self.num_pages = size // page_size
        self.device = torch.device(device)
        self._page_offsets = torch.arange(page_size, dtype=torch.int64, device=self.device)
        self.reset()

    def reset(self) -> None:
        """Make every page free again."""
        self.free_pages = torch.arange(self.num_pages, dtype=torch.int64, device=self.device)
        self.is_free = torch.ones(self.num_pages, dtype=torch.bool, device=self.device)

    def available_size(self) -> int:
        """Number of free slots (free pages * page_size)."""
        return self.free_pages.numel() * self.page_size

    def can_alloc(self, num_tokens: int) -> bool:
        return self._num_pages_for(num_tokens) <= self.free_pages.numel()

    def alloc(self, num_tokens: int) -> torch.Tensor | None:
        """Slot indices (int64) of ``num_tokens / page_size`` whole pages, or None if short.

        Each page's slots come consecutive and in order. On None nothing changes.
        """
        pages = self.alloc_pages(self._num_pages_for(num_tokens))
        if pages is None:
            return None
        return self.pages_to_slots(pages)

    def alloc_pages(self, num_pages: int) -> torch.Tensor | None:
        """Page ids of ``num_pages`` free pages, or None (and no change) if there are fewer."""
        assert num_pages >= 0, f"alloc_pages({num_pages})"
        if num_pages > self.free_pages.numel():
            return None
        pages = self.free_pages[:num_pages]
        self.free_pages = self.free_pages[num_pages:]
        self.is_free[pages] = False
        return pages

    def free(self, slots: torch.Tensor) -> None:
        """Free the pages that contain ``slots``. Empty is a no-op; a free page is a bug."""
        if slots.numel() == 0:
            return
        pages = torch.unique(slots.to(device=self.device, dtype=torch.int64) // self.page_size)
        lo, hi = int(pages[0]), int(pages[-1])
        assert 0 <= lo and hi < self.num_pages, (
            f"free of pages outside [0, {self.num_pages}): min {lo}, max {hi}"
        )
        already = self.is_free[pages]
        assert not bool(already.any()), f"double free of pages {pages[already].tolist()}"
        self.is_free[pages] = True
        self.free_pages = torch.cat([pages, self.free_pages])

    def free_slots(self) -> torch.Tensor:
        """Every free slot index, ascending (for invariant checks)."""
        pages = torch.nonzero(self.is_free).flatten()
        return self.pages_to_slots(pages)

    def pages_to_slots(self, pages: torch.Tensor) -> torch.Tensor:
        # [num_pages, page_size] -> [num_pages * page_size]
        return (pages[:, None] * self.page_size + self._page_offsets).flatten()

    def _num_pages_for(self, num_tokens: int) -> int:
        assert num_tokens >= 0 and num_tokens % self.page_size == 0, (
            f"num_tokens={num_tokens} is not a multiple of page_size={self.page_size}"
        )
        return num_tokens // self.page_size
