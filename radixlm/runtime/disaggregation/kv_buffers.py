"""One side's view of its KV pool for a transfer: slots read into frames (prefill), frames
checked and written to slots (decode)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from radixlm.runtime.disaggregation.wire import KVLayout

CHUNK_BYTES = 4 << 20  # one KVChunk message carries at most this much K/V (whole pages)
# the largest message header (a KVChunk with the first token's top logprobs: ~15 bytes a
# pair) and what CurveZMQ adds to a frame: the frame limit's floor and slack
META_BYTES = 4 << 20
FRAME_SLACK = 64 << 10


class KVBuffers:
    """The per-layer K and V buffers of one side's pool (``KVPool.k_buffers`` /
    ``v_buffers``): ``gather`` reads slots into frames, ``scatter`` writes frames to slots.

    Frames always hold every KV head of the model. A tensor-parallel pool holds a shard of
    them (``k``'s heads); ``shards`` then gives the whole model's KV head count and the
    reader and writer that assemble and split the heads over the ranks
    (``ModelRunner.read_kv`` / ``write_kv``), so peers with different --tp-size meet.
    ``model``: whose pages these are (``KVLayout.model``)."""

    def __init__(self, k: list[torch.Tensor], v: list[torch.Tensor], page_size: int,
                 shards: tuple[int, Callable, Callable] | None = None,
                 model: str = "") -> None:
        assert len(k) == len(v) and k, f"{len(k)} K buffers, {len(v)} V buffers"
        self.k, self.v, self.page_size = k, v, page_size
        _, heads, dim = k[0].shape
        self.read = self.write = None
        if shards is not None:
            heads, self.read, self.write = shards
        self.layout = KVLayout(len(k), heads, dim, str(k[0].dtype).removeprefix("torch."),
                               page_size, model)
        self.token_bytes = heads * dim * k[0].element_size()

    def chunk_tokens(self) -> int:
        """Tokens per KVChunk: whole pages, about CHUNK_BYTES of K and V over all layers."""
        per_page = 2 * len(self.k) * self.token_bytes * self.page_size
        return max(CHUNK_BYTES // per_page, 1) * self.page_size

    def max_frame(self) -> int:
        """The largest frame a peer with this layout sends (one layer's K or V of a chunk,
        or a message header), plus slack: every PD socket's ``zmq.MAXMSGSIZE``."""
        return max(self.chunk_tokens() * self.token_bytes, META_BYTES) + FRAME_SLACK

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
        lay, dtype = self.layout, self.k[0].dtype
        out = []
        for f in frames:
            if not isinstance(f, torch.Tensor):
                f = torch.frombuffer(memoryview(f), dtype=torch.uint8).view(dtype)
            out.append(f.view(n, lay.num_kv_heads, lay.head_dim))
        return out


def _nbytes(frame: Any) -> int:
    if isinstance(frame, torch.Tensor):
        return frame.numel() * frame.element_size()
    return memoryview(frame).nbytes
