"""Two pools behind one slot space: full-attention slots and sliding-window (SWA) slots.

A model with sliding layers (Mistral; Gemma 2 / 3 interleaving sliding and full layers)
needs, in its sliding layers, only the K/V of each sequence's last ``window`` tokens.
``SWAAllocator`` hands out *full* slots as ``PagedAllocator`` does (they name a token
everywhere: ``req_to_token``, the radix tree) and, with each full page, one page of a
smaller SWA pool; ``full_to_swa[full slot]`` says which SWA slot holds that token's
sliding-layer K/V. ``free_swa`` drops only the SWA page of tokens that fell out of every
window (their full page stays: full layers still read it), and maps them to
``swa_sentinel``, a slot past the SWA pool that is never handed out, so an index
translated through the mapping always reads a valid row (attention masks those keys).

Full page ``p`` maps to a whole SWA page ``q``: ``full_to_swa[p*ps + i] == q*ps + i``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from radixlm.radix_cache.allocator import PagedAllocator


@dataclass(frozen=True)
class SWASpec:
    """What the cache manager needs of the runner's SWA pool: its size, the widest window
    of the sliding layers, and the pool's ``full_to_swa`` mapping."""

    size: int
    window: int
    full_to_swa: torch.Tensor


class SWAAllocator(PagedAllocator):
    """``PagedAllocator`` over ``size`` full slots plus ``swa_size`` SWA slots.

    ``alloc`` takes pages of both pools (None if either is short); ``free`` gives back
    the full pages and, where a token still has one, its SWA page; ``free_swa`` gives back
    only SWA pages. ``full_to_swa``: ``[size + 1]`` int64 (the last entry: the KV pool's
    padding slot), owned by the KV pool and written here.
    """

    def __init__(self, size: int, swa_size: int, full_to_swa: torch.Tensor,
                 page_size: int = 1, device: torch.device | str = "cpu") -> None:
        assert full_to_swa.numel() == size + 1, (
            f"full_to_swa has {full_to_swa.numel()} entries for {size} full slots (+1)")
        self.swa = PagedAllocator(swa_size, page_size, device=device)
        self.swa_sentinel = swa_size
        self.full_to_swa = full_to_swa
        super().__init__(size, page_size, device=device)

    def reset(self) -> None:
        super().reset()
        self.swa.reset()
        self.full_to_swa.fill_(self.swa_sentinel)

    def swa_available_size(self) -> int:
        return self.swa.available_size()

    def can_alloc(self, num_tokens: int) -> bool:
        return super().can_alloc(num_tokens) and self.swa.can_alloc(num_tokens)

    def alloc_pages(self, num_pages: int) -> torch.Tensor | None:
        """Full pages, each with a fresh SWA page mapped to it; None (no change) if either
        pool has fewer than ``num_pages`` free."""
        if num_pages > self.swa.free_pages.numel():
            return None
        pages = super().alloc_pages(num_pages)
        if pages is None:
            return None
        swa_pages = self.swa.alloc_pages(num_pages)
        assert swa_pages is not None
        self.full_to_swa[self.pages_to_slots(pages.to(self.full_to_swa.device))] = (
            self.swa.pages_to_slots(swa_pages).to(self.full_to_swa.device))
        return pages

    def free(self, slots: torch.Tensor) -> None:
        """Free the full pages holding ``slots`` and the SWA pages still mapped to them."""
        if slots.numel() == 0:
            return
        self._drop_swa(self._whole_pages(slots), strict=False)
        super().free(slots)

    def free_swa(self, slots: torch.Tensor) -> None:
        """Free the SWA pages of the full pages holding ``slots`` (which must have them);
        the full pages stay allocated."""
        if slots.numel() > 0:
            self._drop_swa(self._whole_pages(slots), strict=True)

    def move_swa(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Give full slots ``dst`` (none with a sliding slot) the sliding slots of ``src``
        (all with one), position by position; ``src`` keeps none (whole pages)."""
        src, dst = src.to(self.full_to_swa.device), dst.to(self.full_to_swa.device)
        swa = self.full_to_swa[src]
        assert bool((swa != self.swa_sentinel).all()) and not bool(self.has_swa(dst).any()), (
            f"move_swa from {src.tolist()} to {dst.tolist()}")
        self.full_to_swa[dst] = swa
        self.full_to_swa[src] = self.swa_sentinel

    def has_swa(self, slots: torch.Tensor) -> torch.Tensor:
        """Per slot: whether it still has an SWA slot."""
        return self.full_to_swa[slots] != self.swa_sentinel

    def _whole_pages(self, slots: torch.Tensor) -> torch.Tensor:
        pages = torch.unique(slots.to(device=self.device, dtype=torch.int64) // self.page_size)
        return self.pages_to_slots(pages)

    def _drop_swa(self, full: torch.Tensor, strict: bool) -> None:
        full = full.to(self.full_to_swa.device)
        swa = self.full_to_swa[full]
        present = swa != self.swa_sentinel
        assert not strict or bool(present.all()), (
            f"free_swa of slots without an SWA slot: {full[~present].tolist()}")
        self.swa.free(swa[present])
        self.full_to_swa[full] = self.swa_sentinel

    def check_mapping(self) -> None:
        """The mapping is one-to-one onto the allocated SWA slots, page to page, and free
        full slots map to the sentinel."""
        mapping = self.full_to_swa[: self.size].to(self.device)
        mapped = mapping != self.swa_sentinel
        full_free = self.is_free.repeat_interleave(self.page_size)
        assert not bool((mapped & full_free).any()), (
            f"free full slots mapped to SWA slots: {torch.nonzero(mapped & full_free)[:8]}")
        targets = mapping[mapped]
        assert torch.unique(targets).numel() == targets.numel(), "two slots share an SWA slot"
        used = ~self.swa.is_free.repeat_interleave(self.page_size)
        assert targets.numel() == int(used.sum()), (
            f"{targets.numel()} mapped SWA slots but {int(used.sum())} allocated")
        assert bool(used[targets].all()), "a full slot maps to a free SWA slot"
        ps = self.page_size
        pages = mapping.view(-1, ps)  # [num_pages, page_size]
        whole = pages[:, :1] + torch.arange(ps, device=pages.device)
        ok = (pages == self.swa_sentinel).all(1) | ((pages == whole).all(1) & (pages[:, 0] % ps
                                                                                 == 0))
        assert bool(ok.all()), "a full page maps to part of an SWA page"
        assert int(self.full_to_swa[self.size]) == self.swa_sentinel, "padding slot mapped"
