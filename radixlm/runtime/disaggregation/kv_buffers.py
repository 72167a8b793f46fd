"""One side's view of its KV pool (and a hybrid model's state pool) for a transfer: slots
read into frames (prefill), frames checked and written to slots (decode)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch

from radixlm.runtime.disaggregation.wire import KVLayout, StateLayer

CHUNK_BYTES = 4 << 20  # one KVChunk message carries at most this much K/V (whole pages)
# the largest message header (a KVChunk with the first token's top logprobs: ~15 bytes a
# pair) and what CurveZMQ adds to a frame: the frame limit's floor and slack
META_BYTES = 4 << 20
FRAME_SLACK = 64 << 10


class SlotStates(Protocol):
    """A hybrid model's state pool as a transfer sees it (``radix_cache.state_pool``'s
    ``StatePool``): one slot's whole state read into, and written from, contiguous
    buffers."""

    def slot_layout(self) -> list[tuple[int, tuple[int, ...], str, tuple[int, ...], str]]: ...

    def read_slot(self, slot: int) -> list[torch.Tensor]: ...

    def write_slot(self, slot: int, states: Sequence[torch.Tensor]) -> None: ...


class KVBuffers:
    """The per-layer K and V buffers of one side's pool (``KVPool.k_buffers`` /
    ``v_buffers``): ``gather`` reads slots into frames, ``scatter`` writes frames to slots.

    Frames always hold every KV head of the model. A tensor-parallel pool holds a shard of
    them (``k``'s heads); ``shards`` then gives the whole model's KV head count and the
    reader and writer that assemble and split the heads over the ranks
    (``ModelRunner.read_kv`` / ``write_kv``), so peers with different --tp-size meet.
    ``model``: whose pages these are (``KVLayout.model``). ``states``: a hybrid model's
    state pool, whose slot of a request travels whole beside its pages (``KVLayout.state``:
    its shapes and dtypes, which both sides must agree on as on the pages')."""

    def __init__(self, k: list[torch.Tensor], v: list[torch.Tensor], page_size: int,
                 shards: tuple[int, Callable, Callable] | None = None,
                 model: str = "", states: SlotStates | None = None) -> None:
        assert len(k) == len(v) and k, f"{len(k)} K buffers, {len(v)} V buffers"
        self.k, self.v, self.page_size = k, v, page_size
        _, heads, dim = k[0].shape
        self.read = self.write = None
        if shards is not None:
            heads, self.read, self.write = shards
        self.states = states
        state = tuple(StateLayer(*layer) for layer in states.slot_layout()) if states else ()
        self.layout = KVLayout(len(k), heads, dim, str(k[0].dtype).removeprefix("torch."),
                               page_size, model, state)
        self.token_bytes = heads * dim * k[0].element_size()
        # each state frame's bytes: conv then ssm of each linear layer
        self.state_frame_bytes = [_shape_bytes(shape, dtype) for layer in state for
                                  shape, dtype in ((layer.conv_shape, layer.conv_dtype),
                                                   (layer.ssm_shape, layer.ssm_dtype))]

    def chunk_tokens(self) -> int:
        """Tokens per KVChunk: whole pages, about CHUNK_BYTES of K and V over all layers."""
        per_page = 2 * len(self.k) * self.token_bytes * self.page_size
        return max(CHUNK_BYTES // per_page, 1) * self.page_size

    def max_frame(self) -> int:
        """The largest frame a peer with this layout sends (one layer's K or V of a chunk,
        one linear layer's conv or SSM state, or a message header), plus slack: every PD
        socket's ``zmq.MAXMSGSIZE``."""
        return max(self.chunk_tokens() * self.token_bytes, META_BYTES,
                   *self.state_frame_bytes) + FRAME_SLACK

    def gather(self, slots: torch.Tensor) -> list[torch.Tensor]:
        """[K_0, V_0, K_1, V_1, ...] at ``slots``, each [n, heads, dim], contiguous, on CPU."""
        if self.read is not None:
            return self.read(slots)
        idx = slots.to(self.k[0].device)
        frames = []
        for k, v in zip(self.k, self.v):
            frames += [k[idx].cpu().contiguous(), v[idx].cpu().contiguous()]
        return frames

    def scatter(self, slots: torch.Tensor, frames: list[torch.Tensor]) -> None:
        """Write frames as ``gather`` made them into ``slots`` (the peers' layouts, dtype
        included, were checked equal when they met)."""
        if self.write is not None:
            self.write(slots, frames)
            return
        idx = slots.to(self.k[0].device)
        for layer, (k, v) in enumerate(zip(self.k, self.v)):
            k[idx] = frames[2 * layer].to(k.device)
            v[idx] = frames[2 * layer + 1].to(v.device)

    def frames_problem(self, frames: list[Any], n: int) -> str | None:
        """Why received ``frames`` cannot hold ``n`` tokens' K and V (None: they can)."""
        if len(frames) != 2 * len(self.k):
            return f"{len(frames)} frames, expected {2 * len(self.k)}"
        want = n * self.token_bytes
        sizes = {_nbytes(f) for f in frames}
        if sizes != {want}:
            return f"frame sizes {sorted(sizes)}, expected {want} bytes"
        return None

    def as_tensors(self, frames: list[Any], n: int) -> list[torch.Tensor]:
        """Received frames as [n, heads, dim] tensors of the pool's dtype (views, no copy)."""
        shape = (n, self.layout.num_kv_heads, self.layout.head_dim)
        return [_as_tensor(f, self.k[0].dtype, shape) for f in frames]


    # --- a hybrid model's recurrent state: one request's slot, whole -------------------
    def gather_state(self, slot: int) -> list[torch.Tensor]:
        """State slot ``slot`` as frames: [conv_0, ssm_0, conv_1, ...] (``KVLayout.state``'s
        order), contiguous, on CPU."""
        assert self.states is not None, "no state pool: the model has no recurrent state"
        return self.states.read_slot(slot)

    def state_frames_problem(self, frames: list[Any]) -> str | None:
        """Why received ``frames`` are not one slot's state in this layout (None: they
        are)."""
        want = self.state_frame_bytes
        if not want:
            return "this decode server's model has no recurrent state"
        if len(frames) != len(want):
            return f"{len(frames)} state frames, expected {len(want)}"
        sizes = [_nbytes(f) for f in frames]
        if sizes != want:
            return f"state frame sizes {sizes}, expected {want} bytes"
        return None

    def scatter_state(self, slot: int, frames: list[Any]) -> None:
        """Write received state frames (checked by ``state_frames_problem``) into state slot
        ``slot``."""
        assert self.states is not None, "no state pool: the model has no recurrent state"
        tensors = []
        for layer in self.layout.state:
            for shape, dtype in ((layer.conv_shape, layer.conv_dtype),
                                 (layer.ssm_shape, layer.ssm_dtype)):
                tensors.append(_as_tensor(frames[len(tensors)], getattr(torch, dtype), shape))
        self.states.write_slot(slot, tensors)


def _as_tensor(frame: Any, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """A received frame as a tensor of ``dtype`` and ``shape`` (a view, no copy)."""
    if not isinstance(frame, torch.Tensor):
        frame = torch.frombuffer(memoryview(frame), dtype=torch.uint8)
    return frame.view(torch.uint8).view(dtype).view(shape)


def _shape_bytes(shape: tuple[int, ...], dtype: str) -> int:
    n = getattr(torch, dtype).itemsize
    for d in shape:
        n *= d
    return n


def _nbytes(frame: Any) -> int:
    if isinstance(frame, torch.Tensor):
        return frame.numel() * frame.element_size()
    return memoryview(frame).nbytes
