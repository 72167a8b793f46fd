"""The state pool of hybrid models: fixed-size recurrent state per running request, beside the
paged KV pool.

A linear-attention layer (Gated DeltaNet, Mamba2) keeps no K/V rows: each sequence carries
one ``conv`` state (the short convolution's last ``K - 1`` inputs) and one ``ssm`` state (a
matrix per head), whatever its length. So the pool is ``size`` slots, each holding every
linear layer's pair, and a running request owns exactly one slot::

    scheduler (CacheManager)              executor (ModelRunner)
    StateSlots: free list of slot ids     StatePool: conv[layer] [size, C, K - 1]
      admit   -> alloc()  -> req.state_slot            ssm[layer]  [size, *ssm_shape]
      release -> free(req.state_slot)                  read / write at batch.state_slots

A slot is allocated when a request is admitted (no free slot: the request waits) and freed
when it finishes or is retracted. A forward of a sequence with no computed token
(``prefix_len == 0``: a fresh or a retracted request, which recomputes its whole sequence)
reads zeros instead of its slot (``StatePool.read``'s ``fresh``), so a freed slot's stale
numbers are never read.

With the radix cache on, more slots hold the tree's **snapshots**: the state after a cached
prefix (``snapshot_tree.py``). A request matching one has it copied into its own slot before
its first forward (``StatePool.copy``); a prefill writes new ones at chosen points of its
chunk, and a finished request's slot may become one. The accounting ``free + request-owned
+ pending snapshots + tree-held == size`` is checked by ``CacheManager.check_accounting``.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch


class StateSlots:
    """The scheduler's free list of state slots ``0 .. size-1`` (bookkeeping only).

    ``alloc`` takes the most recently freed slot; freeing a free or unknown slot is a bug
    and raises ``AssertionError``."""

    def __init__(self, size: int) -> None:
        if size < 1:
            raise ValueError(f"state pool size must be >= 1, got {size}")
        self.size = size
        self._free: list[int] = list(range(size - 1, -1, -1))
        self._is_free = [True] * size

    def available_size(self) -> int:
        return len(self._free)

    def alloc(self) -> int | None:
        """A free slot, or None when every slot is owned."""
        if not self._free:
            return None
        slot = self._free.pop()
        self._is_free[slot] = False
        return slot

    def is_free(self, slot: int) -> bool:
        return self._is_free[slot]

    def free(self, slot: int) -> None:
        assert 0 <= slot < self.size and not self._is_free[slot], (
            f"bad free of state slot {slot} (size {self.size})")
        self._is_free[slot] = True
        self._free.append(slot)

    def check_integrity(self, owned: Iterable[int]) -> None:
        """Every slot is either free or owned by exactly one request: ``owned`` (the running
        requests' slots) has no duplicate and no free slot, and with the free list covers
        ``0 .. size-1``."""
        owned = list(owned)
        assert len(set(owned)) == len(owned), f"state slots owned twice: {sorted(owned)}"
        assert len(set(self._free)) == len(self._free), f"free list repeats: {self._free}"
        assert all(self._is_free[s] for s in self._free), "free list and flags disagree"
        bad = [s for s in owned if not 0 <= s < self.size or self._is_free[s]]
        assert not bad, f"requests own free or unknown state slots {bad}"
        assert len(owned) + len(self._free) == self.size, (
            f"state accounting broken: free {len(self._free)} + request-owned {len(owned)} "
            f"!= state pool size {self.size}")


@dataclass(frozen=True)
class StateSpec:
    """One linear-attention layer's state of one sequence: ``conv`` [conv_dim, conv_width]
    (conv_width = kernel size - 1) in the model's dtype, ``ssm`` [*ssm_shape] in float32."""

    conv_dim: int
    conv_width: int
    ssm_shape: tuple[int, ...]

    def bytes(self, conv_dtype: torch.dtype, ssm_dtype: torch.dtype) -> int:
        conv = self.conv_dim * self.conv_width * conv_dtype.itemsize
        ssm = ssm_dtype.itemsize
        for d in self.ssm_shape:
            ssm *= d
        return conv + ssm


class StatePool:
    """The executor's state tensors: for each linear layer id in ``specs``, ``conv[layer]``
    [size, conv_dim, conv_width] and ``ssm[layer]`` [size, *ssm_shape]."""

    def __init__(self, size: int, specs: dict[int, StateSpec], conv_dtype: torch.dtype,
                 device: torch.device | str = "cpu",
                 ssm_dtype: torch.dtype = torch.float32) -> None:
        self.size = size
        self.specs = dict(specs)
        self.conv_dtype, self.ssm_dtype = conv_dtype, ssm_dtype
        self.conv = {i: torch.zeros(size, s.conv_dim, s.conv_width, dtype=conv_dtype,
                                    device=device) for i, s in self.specs.items()}
        self.ssm = {i: torch.zeros(size, *s.ssm_shape, dtype=ssm_dtype, device=device)
                    for i, s in self.specs.items()}

    @staticmethod
    def bytes_per_slot(specs: dict[int, StateSpec], conv_dtype: torch.dtype,
                       ssm_dtype: torch.dtype = torch.float32) -> int:
        return sum(s.bytes(conv_dtype, ssm_dtype) for s in specs.values())

    @property
    def nbytes(self) -> int:
        return self.size * self.bytes_per_slot(self.specs, self.conv_dtype, self.ssm_dtype)

    def read(self, layer: int, slots: torch.Tensor, fresh: torch.Tensor | None
             ) -> tuple[torch.Tensor, torch.Tensor]:
        """Copies of ``layer``'s (conv, ssm) states at ``slots`` [B]; the rows where
        ``fresh`` [B] bool is set are zeros (a sequence with nothing computed yet)."""
        conv, ssm = self.conv[layer][slots], self.ssm[layer][slots]
        if fresh is not None:
            conv[fresh] = 0
            ssm[fresh] = 0
        return conv, ssm

    def copy(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Every layer's states of slots ``src`` [n] into slots ``dst`` [n] (a snapshot
        into a request's slot, or a request's state into a snapshot)."""
        for layer in self.specs:
            self.conv[layer][dst] = self.conv[layer][src]
            self.ssm[layer][dst] = self.ssm[layer][src]

    def write(self, layer: int, slots: torch.Tensor, conv: torch.Tensor,
              ssm: torch.Tensor) -> None:
        """Store ``layer``'s new states of the sequences at ``slots`` [B]."""
        self.conv[layer][slots] = conv.to(self.conv_dtype)
        self.ssm[layer][slots] = ssm.to(self.ssm_dtype)

    # --- one slot whole, as contiguous buffers (a prefill/decode transfer) ----------------
    def slot_layout(self) -> list[tuple[int, tuple[int, ...], str, tuple[int, ...], str]]:
        """What ``read_slot`` returns, layer by layer in ``read_slot``'s order:
        ``(layer, conv shape, conv dtype, ssm shape, ssm dtype)`` (dtypes as "float32")."""
        conv, ssm = (str(t).removeprefix("torch.") for t in (self.conv_dtype, self.ssm_dtype))
        return [(i, tuple(self.conv[i].shape[1:]), conv, tuple(self.ssm[i].shape[1:]), ssm)
                for i in sorted(self.specs)]

    def read_slot(self, slot: int) -> list[torch.Tensor]:
        """Slot ``slot``'s whole state as contiguous CPU copies (never views: the slot may
        change while they are in flight): ``[conv, ssm]`` of each linear layer in ascending
        layer order (``slot_layout``)."""
        out = []
        for i in sorted(self.specs):
            out += [t[slot].to("cpu", copy=True).contiguous() for t in (self.conv[i], self.ssm[i])]
        return out

    def write_slot(self, slot: int, states: Sequence[torch.Tensor]) -> None:
        """Write ``states`` as ``read_slot`` made them (shapes and dtypes of ``slot_layout``)
        into slot ``slot``."""
        layers = sorted(self.specs)
        assert len(states) == 2 * len(layers), f"{len(states)} states for {len(layers)} layers"
        for n, i in enumerate(layers):
            conv, ssm = states[2 * n], states[2 * n + 1]
            assert conv.shape == self.conv[i].shape[1:] and ssm.shape == self.ssm[i].shape[1:], (
                f"layer {i}: states {tuple(conv.shape)}, {tuple(ssm.shape)} for a slot of "
                f"{tuple(self.conv[i].shape[1:])}, {tuple(self.ssm[i].shape[1:])}")
            self.conv[i][slot] = conv.to(self.conv[i].device, self.conv_dtype)
            self.ssm[i][slot] = ssm.to(self.ssm[i].device, self.ssm_dtype)


def state_slots_of(slots: Sequence[int | None]) -> list[int]:
    """The slots of a batch's requests; every one must hold one (a hybrid model's request
    is admitted only with a slot)."""
    assert all(s is not None for s in slots), f"requests without a state slot: {slots}"
    return [int(s) for s in slots]  # type: ignore[arg-type]
