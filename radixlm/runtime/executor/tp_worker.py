"""What rank 0 of a tensor-parallel group tells the other ranks before each forward.

Only rank 0 runs the scheduler (requests, radix tree, sampling). Before each of its own
forwards it broadcasts the step, a ``ModelWorkerBatch`` plus the KV slots of its
sequences, as msgspec bytes over the CPU group; the other ranks (``run_follower``) run
the same forward on their heads. Rank 0 assigns every KV slot, so every rank's pool has
the same layout, each for its own heads.

    rank 0:  scheduler -> ModelRunner.forward -> send_step(ForwardStep) -> model(fb)
    rank k:  run_follower: recv_step -> ModelRunner.forward -> model(fb)   (logits unused)
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


TpStep = ForwardStep | UpdateWeightsStep | ShutdownStep
_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(TpStep)


def forward_step(batch: ModelWorkerBatch, req_to_token: torch.Tensor) -> ForwardStep:
    """The step as rank 0 sends it: only the rows (and columns) of req_to_token it reads."""
    widths = [p + n for p, n in zip(batch.prefix_lens, batch.extend_lens)]
    rows = [req_to_token[r, :w] for r, w in zip(batch.req_pool_indices, widths)]
    slots = torch.cat(rows).to("cpu", torch.int64).numpy().tobytes()
    return ForwardStep(dataclasses.replace(batch, req_pool_indices=list(range(len(batch)))),
                       slots)


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
        runner.forward(step.batch, step_tables(step, runner.device))
