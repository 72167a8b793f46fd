"""Decode forwards replayed from CUDA graphs (SGLang's ``--cuda-graph-max-bs`` and
``--disable-cuda-graph``).

A decode step of a small batch launches a few hundred kernels whose launch cost exceeds
their work; a CUDA graph replays them with one launch. At startup, on CUDA with the
Triton attention path, ``CudaGraphRunner`` captures the model's decode forward once per
batch size of ``capture_batch_sizes(max_bs)``, over static buffers sized for the largest.
A decode batch of B sequences then runs in the smallest captured size >= B:

    static buffer     rows [0, B)                     rows [B, bs): padding
    input_ids         the batch's tokens              0
    positions         the batch's positions           0
    out_cache_loc     the new tokens' slots           pad_slot
    kv_indptr         the batch's ranges              one key each, at pad_slot
    kv_indices        the batch's slots (nnz)         pad_slot

``pad_slot`` is one KV slot past the allocator's range (the pool has ``pool_size + 1``
slots), so padding rows write and read only it and no request's KV is touched. The graph's
``Layout`` is ``(bs, 1, max_context)``: the decode kernel's split count is fixed at
capture, and its programs read each sequence's real length from ``kv_indptr`` on the
device. Nothing in the forward reads back to the host (tests/kernels/test_triton_no_readback),
which capture requires. Logits ``[:B]`` of the replay are returned (a copy: the next replay
overwrites the graph's output).

The capture mechanism is injected (``graph_factory``): ``CudaGraph`` on CUDA; the tests
replay the same static-buffer logic eagerly on a CPU.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Protocol

import torch

from radixlm.kernels.reference import Layout
from radixlm.runtime.executor.forward_batch import ForwardBatch, ForwardMode

logger = logging.getLogger(__name__)

DEFAULT_MAX_BS = 160


def capture_batch_sizes(max_bs: int) -> list[int]:
    """1, 2, 4, 8, then every multiple of 8 up to max_bs (and max_bs itself), as SGLang's
    default list: dense where decode batches usually are, padding at most 7 rows."""
    sizes = [b for b in (1, 2, 4) if b < max_bs] + list(range(8, max_bs + 1, 8))
    if not sizes or sizes[-1] != max_bs:
        sizes.append(max_bs)
    return sizes


class Graph(Protocol):
    def capture(self, fn: Callable[[], torch.Tensor]) -> torch.Tensor: ...
    def replay(self) -> None: ...


class CudaGraph:
    """One captured CUDA graph; graphs of one runner share a memory pool."""

    def __init__(self, pool) -> None:
        self.graph = torch.cuda.CUDAGraph()
        self.pool = pool

    def capture(self, fn: Callable[[], torch.Tensor]) -> torch.Tensor:
        # warm up on a side stream first: Triton compiles, cuBLAS picks its algorithms
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                fn()
        torch.cuda.current_stream().wait_stream(stream)
        with torch.cuda.graph(self.graph, pool=self.pool):
            out = fn()
        return out

    def replay(self) -> None:
        self.graph.replay()


def cuda_graph_factory() -> Callable[[], Graph]:
    pool = torch.cuda.graph_pool_handle()
    return lambda: CudaGraph(pool)


class CudaGraphRunner:
    """Captured decode forwards of ``model`` over a KV pool whose last slot is padding."""

    def __init__(self, model, kv_pool, attention_backend: str | None, max_bs: int,
                 max_context: int, kv_pool_size: int, device: torch.device,
                 graph_factory: Callable[[], Graph] | None = None) -> None:
        on_cuda = device.type == "cuda"
        reserved = torch.cuda.memory_reserved(device) if on_cuda else 0
        pad_slot = kv_pool_size  # the pool's extra last slot
        self.model, self.kv_pool = model, kv_pool
        self.attention_backend = attention_backend
        self.batch_sizes = capture_batch_sizes(max_bs)
        self.max_bs, self.max_context, self.pad_slot = self.batch_sizes[-1], max_context, pad_slot
        top, i64 = self.max_bs, dict(dtype=torch.int64, device=device)
        self.input_ids = torch.zeros(top, **i64)
        self.positions = torch.zeros(top, **i64)
        self.out_cache_loc = torch.full((top,), pad_slot, **i64)
        self.steps = torch.arange(top + 1, **i64)  # qo_indptr, logits rows, padding ranges
        self.kv_indptr = self.steps.clone()  # every row one key (the pad slot) until filled
        # each sequence's KV is at most max_context; beyond 4 pools' worth of slots (shared
        # prefixes repeat slots) a batch runs eagerly instead (can_run)
        size = min(top * max_context, max(4 * kv_pool_size, 2 * top))
        self.kv_indices = torch.full((size,), pad_slot, **i64)
        factory = graph_factory or cuda_graph_factory()
        self.graphs: dict[int, Graph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        for bs in reversed(self.batch_sizes):  # largest first: the others fit its memory
            graph = factory()
            self.outputs[bs] = graph.capture(lambda bs=bs: self._forward(bs))
            self.graphs[bs] = graph
        # what the static buffers and the graphs' memory pool hold (/v1/loads' graph_gb)
        self.memory_bytes = torch.cuda.memory_reserved(device) - reserved if on_cuda else 0
        logger.info("captured decode CUDA graphs for batch sizes %s", self.batch_sizes)

    def _forward(self, bs: int) -> torch.Tensor:
        fb = ForwardBatch(
            mode=ForwardMode.DECODE,
            input_ids=self.input_ids[:bs],
            positions=self.positions[:bs],
            out_cache_loc=self.out_cache_loc[:bs],
            qo_indptr=self.steps[: bs + 1],
            kv_indptr=self.kv_indptr[: bs + 1],
            kv_indices=self.kv_indices,
            logits_indices=self.steps[:bs],
            kv_pool=self.kv_pool,
            attention_backend=self.attention_backend,
            layout=Layout(bs, 1, self.max_context),
        )
        return self.model(fb)

    def can_run(self, batch_size: int, nnz: int) -> bool:
        """Whether a decode batch of ``batch_size`` sequences and ``nnz`` KV entries fits."""
        return batch_size <= self.max_bs and nnz + self.max_bs <= self.kv_indices.numel()

    def replay(self, fb: ForwardBatch, nnz: int) -> torch.Tensor:
        """Logits [B, vocab] of the decode batch ``fb`` (``nnz`` = len(fb.kv_indices), known
        on the host), through the smallest captured graph that holds it."""
        b = fb.batch_size
        bs = next(s for s in self.batch_sizes if s >= b)
        self.input_ids[:b].copy_(fb.input_ids)
        self.input_ids[b:bs].zero_()
        self.positions[:b].copy_(fb.positions)
        self.positions[b:bs].zero_()
        self.out_cache_loc[:b].copy_(fb.out_cache_loc)
        self.out_cache_loc[b:bs].fill_(self.pad_slot)
        self.kv_indptr[: b + 1].copy_(fb.kv_indptr)
        self.kv_indptr[b + 1: bs + 1].copy_(self.steps[1: bs - b + 1] + nnz)
        self.kv_indices[:nnz].copy_(fb.kv_indices)
        self.kv_indices[nnz: nnz + bs - b].fill_(self.pad_slot)
        self.graphs[bs].replay()
        return self.outputs[bs][:b].clone()
