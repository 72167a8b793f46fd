"""What rank 0 of a tensor-parallel group tells the other ranks before each forward.

Only rank 0 runs the scheduler (requests, radix tree) and samples (its ModelRunner's
``Sampler``, on the whole logits). Before each of its own forwards it broadcasts the step,
a ``ModelWorkerBatch`` plus the KV slots of its sequences, as msgspec bytes over the CPU
group; the other ranks (``run_follower``) run the same forward on their heads. Rank 0
assigns every KV slot, so every rank's pool has the same layout, each for its own heads.

    rank 0:  scheduler -> ModelRunner.forward_and_sample -> send_step(ForwardStep)
                                                          -> model(fb) -> Sampler.sample
    rank k:  run_follower: recv_step -> ModelRunner.forward -> model(fb)   (logits unused)

A PD transfer moves pages with every KV head of the model (the peer may shard them over
another number of ranks): rank 0 reads them from all ranks (``ReadKVStep``, a gather) on a
prefill server and writes each rank its heads (``WriteKVStep``, a scatter) on a decode
server, between two forwards.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import msgspec
import torch

from radixlm.runtime.distributed.parallel_state import TpGroup
from radixlm.runtime.executor.worker_batch import ModelWorkerBatch

logger = logging.getLogger(__name__)


class ForwardStep(msgspec.Struct, tag=True):
    """One forward: the batch, with ``req_pool_indices`` renumbered 0..B-1 and ``slots``
    holding each sequence's KV slots ``[0, prefix_len + extend_len)`` (int64, packed)."""

    batch: ModelWorkerBatch
    slots: bytes


class UpdateWeightsStep(msgspec.Struct, tag=True):
    model_path: str


class ShutdownStep(msgspec.Struct, tag=True):
    pass


class ReadKVStep(msgspec.Struct, tag=True):
    """Every rank sends rank 0 its K/V rows at ``slots`` (int64, packed)."""

    slots: bytes


class WriteKVStep(msgspec.Struct, tag=True):
    """Rank 0 sends every rank its heads of the K/V rows for ``slots`` (int64, packed)."""

    slots: bytes


TpStep = ForwardStep | UpdateWeightsStep | ShutdownStep | ReadKVStep | WriteKVStep
_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(TpStep)


def forward_step(batch: ModelWorkerBatch, req_to_token: torch.Tensor) -> ForwardStep:
    """The step as rank 0 sends it: only the rows (and columns) of req_to_token it reads."""
    widths = [p + n for p, n in zip(batch.prefix_lens, batch.extend_lens)]
    rows = [req_to_token[r, :w] for r, w in zip(batch.req_pool_indices, widths)]
    slots = torch.cat(rows).to("cpu", torch.int64).numpy().tobytes()
    return ForwardStep(dataclasses.replace(batch, req_pool_indices=list(range(len(batch))),
                                           sampling=None), slots)


def step_tables(step: ForwardStep, device: torch.device) -> torch.Tensor:
    """A req_to_token table ``[B, widest]`` for the renumbered batch of ``step``."""
    batch = step.batch
    widths = [p + n for p, n in zip(batch.prefix_lens, batch.extend_lens)]
    flat = torch.frombuffer(bytearray(step.slots), dtype=torch.int64)
    table = torch.zeros(len(batch), max(widths), dtype=torch.int64)
    for i, row in enumerate(flat.split(widths)):
        table[i, : len(row)] = row
    return table.to(device)


def send_step(tp: TpGroup, step: Any) -> None:
    tp.broadcast_bytes(_ENCODER.encode(step))


def recv_step(tp: TpGroup) -> Any:
    return _DECODER.decode(tp.broadcast_bytes())


def run_follower(runner: Any, tp: TpGroup) -> None:
    """The loop of ranks other than 0: apply rank 0's steps until it says stop.
    ``runner`` is this rank's ModelRunner."""
    assert tp.rank != 0, "rank 0 runs the scheduler, not this loop"
    while True:
        step = recv_step(tp)
        if isinstance(step, ShutdownStep):
            logger.info("rank %d: shutdown from rank 0", tp.rank)
            return
        if isinstance(step, UpdateWeightsStep):
            runner.update_weights_from_disk(step.model_path)
            continue
        if isinstance(step, ReadKVStep):
            tp.gather_to_first(_kv_shard(runner, _unpack(step.slots)))
            continue
        if isinstance(step, WriteKVStep):
            slots = _unpack(step.slots)
            _write_shard(runner, slots, tp.scatter_from_first(None, _shard_like(runner, slots)))
            continue
        runner.forward(step.batch, step_tables(step, runner.device))


# --- K/V rows of a PD transfer -----------------------------------------------------------------
def _unpack(data: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.int64)


def _kv_shard(runner: Any, slots: torch.Tensor) -> torch.Tensor:
    """This rank's rows at ``slots``: [2 * layers (K_0, V_0, ...), n, its heads, head_dim
    * itemsize] as bytes on the CPU (the collectives need no dtype of their own)."""
    pool = runner.kv_pool
    idx = slots.to(pool.k_buffers[0].device)
    rows = [b[idx] for k, v in zip(pool.k_buffers, pool.v_buffers) for b in (k, v)]
    return torch.stack(rows).cpu().contiguous().view(torch.uint8)


def _shard_like(runner: Any, slots: torch.Tensor) -> torch.Tensor:
    k = runner.kv_pool.k_buffers[0]
    _, heads, dim = k.shape
    return torch.empty(2 * len(runner.kv_pool.k_buffers), len(slots), heads,
                       dim * k.element_size(), dtype=torch.uint8)


def _write_shard(runner: Any, slots: torch.Tensor, shard: torch.Tensor) -> None:
    pool = runner.kv_pool
    rows = shard.view(pool.k_buffers[0].dtype)
    idx = slots.to(pool.k_buffers[0].device)
    for layer, (k, v) in enumerate(zip(pool.k_buffers, pool.v_buffers)):
        k[idx] = rows[2 * layer].to(k.device)
        v[idx] = rows[2 * layer + 1].to(v.device)


def whole_heads(parts: list[torch.Tensor], starts: list[int], local: int) -> torch.Tensor:
    """The ranks' shards (head dimension 2) joined into every head once: rank r holds
    heads ``starts[r] ..`` (``local`` of them); ranks that replicate a head repeat it."""
    chosen, covered = [], 0
    for part, start in zip(parts, starts):
        if start == covered:
            chosen.append(part)
            covered += local
    return torch.cat(chosen, dim=2)


def read_kv(runner: Any, starts: list[int], slots: torch.Tensor) -> list[torch.Tensor]:
    """Rank 0: [K_0, V_0, K_1, ...] at ``slots``, each [n, all KV heads, head_dim] on the
    CPU, from every rank's shard."""
    tp = runner.tp
    send_step(tp, ReadKVStep(slots.to("cpu", torch.int64).numpy().tobytes()))
    parts = tp.gather_to_first(_kv_shard(runner, slots))
    local = runner.kv_pool.k_buffers[0].shape[1]
    rows = whole_heads(parts, starts, local).view(runner.kv_pool.k_buffers[0].dtype)
    return list(rows.unbind(0))


def write_kv(runner: Any, starts: list[int], slots: torch.Tensor,
             frames: list[torch.Tensor]) -> None:
    """Rank 0: write ``frames`` (as ``read_kv`` returns them) at ``slots``, each rank its
    heads."""
    tp = runner.tp
    whole = torch.stack([f.cpu() for f in frames]).view(torch.uint8)
    local = runner.kv_pool.k_buffers[0].shape[1]
    parts = [whole[:, :, s: s + local].contiguous() for s in starts]
    send_step(tp, WriteKVStep(slots.to("cpu", torch.int64).numpy().tobytes()))
    _write_shard(runner, slots, tp.scatter_from_first(parts, parts[0]))
