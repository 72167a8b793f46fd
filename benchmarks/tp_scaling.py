"""Tensor parallelism's costs: weight bytes per rank, and the share of a decode step that
rank 0 spends in collectives, at TP=1 and TP=2.

    python benchmarks/tp_scaling.py --preset small [--batch 8] [--context 256] [--rounds 5]

Weight memory: the parameters each rank builds and loads from its slices of the
checkpoint (``load_model`` with that rank's group, no processes needed to build it).
Decode step: ``ModelRunner.forward`` of a batch of ``--batch`` sequences with
``--context`` tokens in the pool, timed on rank 0 (this process; the other ranks are
the real follower processes). Collectives are timed by wrapping ``TpGroup``'s
all-reduce, logits gather and step broadcast on rank 0; that time includes waiting for
the slower rank, which on a shared CPU is most of it. Both settings use the same cores
(TP=1 with ``--threads``, TP=2 with ``--threads / 2`` per rank): no speed-up is expected
on a CPU, the point is what the collectives cost.

A GPU section (NCCL) runs the same decode step on ``cuda`` when at least two GPUs exist,
and says that it was skipped otherwise.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from radixlm.runtime.config import ServerArgs
from radixlm.runtime.distributed.parallel_state import TpGroup
from radixlm.runtime.executor.model_runner import ModelRunner
from radixlm.runtime.executor.models import load_model
from radixlm.runtime.executor.worker_batch import ModelWorkerBatch
from radixlm.runtime.managers.scheduler.tp_ranks import start_tp_ranks
from radixlm.runtime.model_config import ModelConfig
from radixlm.tiny_model import add_model_args, resolve_model

_COLLECTIVE = [0.0]


def _timed(fn: Callable) -> Callable:
    def wrapper(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            _COLLECTIVE[0] += time.perf_counter() - t0

    return wrapper


def _time_collectives() -> None:
    for name in ("all_reduce", "gather_last_dim", "broadcast_bytes"):
        setattr(TpGroup, name, _timed(getattr(TpGroup, name)))


def rank_bytes(model_path: str, tp_size: int) -> list[int]:
    """Parameter bytes of each rank's slice of the model (float32 on the CPU)."""
    cfg = ModelConfig.from_hf(model_path, dtype="float32")
    out = []
    for rank in range(tp_size):
        model = load_model(cfg, model_path, "cpu", TpGroup(rank, tp_size))
        out.append(sum(p.numel() * p.element_size() for p in model.parameters()))
    return out


def _batch(batch: int, context: int, pool: int) -> tuple[ModelWorkerBatch, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    width = context + 1
    req_to_token = torch.randperm(pool, generator=g)[: batch * width].view(batch, width)
    wb = ModelWorkerBatch(
        is_decode=True, req_pool_indices=list(range(batch)), prefix_lens=[context] * batch,
        extend_lens=[1] * batch, input_ids=torch.randint(0, 1000, (batch,)).tolist(),
        logit_ranges=[(0, 1)] * batch)
    return wb, req_to_token


def decode_step(model_path: str, tp_size: int, device: str, a: argparse.Namespace
                ) -> tuple[float, float]:
    """Median (step seconds, collective seconds) on rank 0."""
    pool = a.batch * (a.context + 1) + 64
    args = ServerArgs(model_path=model_path, max_total_tokens=pool, device=device,
                      dtype="float32", tp_size=tp_size, cpu_threads=a.threads)
    torch.set_num_threads(a.threads)  # at TP=2 start_tp_ranks gives each rank half
    args, ranks = start_tp_ranks(args, model_path)
    runner = None
    try:
        runner = ModelRunner(args, model_path)
        wb, req_to_token = _batch(a.batch, a.context, pool)
        req_to_token = req_to_token.to(runner.device)
        steps, comm = [], []
        for r in range(a.rounds + 1):
            _COLLECTIVE[0] = 0.0
            if runner.device.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            runner.forward(wb, req_to_token)
            if runner.device.type == "cuda":
                torch.cuda.synchronize()
            if r:  # round 0 warms up
                steps.append(time.perf_counter() - t0)
                comm.append(_COLLECTIVE[0])
        return statistics.median(steps), statistics.median(comm)
    finally:
        if ranks is not None:
            ranks.stop(runner)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_model_args(ap)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2, help="CPU threads in all (TP=1)")
    a = ap.parse_args()
    model_path = resolve_model(a.model_path, a.preset)
    _time_collectives()
    print(f"model {model_path}; float32; batch {a.batch}, context {a.context}; medians of "
          f"{a.rounds} decode steps")
    print("| TP | device | weight MiB per rank | decode step (ms) | collectives (ms) | share |")
    print("|---|---|---|---|---|---|")
    full = rank_bytes(model_path, 1)
    for tp in (1, 2):
        per_rank = rank_bytes(model_path, tp) if tp > 1 else full
        mib = " / ".join(f"{b / 2**20:.1f}" for b in per_rank)
        step, comm = decode_step(model_path, tp, "cpu", a)
        device = "cpu (gloo)" if tp > 1 else "cpu"
        print(f"| {tp} | {device} | {mib} | {step * 1e3:.1f} | {comm * 1e3:.1f} | "
              f"{comm / step:.0%} |")
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if gpus < 2:
        print(f"GPU section skipped: {gpus} CUDA device(s) here, TP=2 on GPUs needs 2")
        return
    for tp in (1, 2):
        step, comm = decode_step(model_path, tp, "cuda", a)
        print(f"| {tp} | cuda (nccl) | - | {step * 1e3:.1f} | {comm * 1e3:.1f} | "
              f"{comm / step:.0%} |")


if __name__ == "__main__":
    main()
