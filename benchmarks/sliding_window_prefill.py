"""Prefill of a sliding-window model: its windowed layers through the compiled CPU kernel
(the window in the kernel, key blocks behind each row skipped) against the masked torch
path (``kernels.masked_attention``, query blocks of 128 rows).

    python benchmarks/sliding_window_prefill.py [--prompts 1024 2048 4096] [--window 512]

A Mistral of the ``small`` preset's shape (sliding_window_decode.SHAPE: hidden 768, 12
layers, 12 heads, 4 KV heads of 64; written by transformers' own classes, random weights)
prefills one prompt of each length in one forward (``ModelRunner.forward``), float32. The
two variants alternate in one process (the masked one: ``AttentionPlan.masked_passes``
made to return None, which is what a plan without the kernel returns); a 256-token
prompt through both warms up. Medians of ``--rounds``.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch
import transformers
from sliding_window_decode import SHAPE  # benchmarks/: the script's directory

from radixlm.kernels import cpu_paged
from radixlm.kernels.shared_prefix import AttentionPlan
from radixlm.runtime.config import ServerArgs
from radixlm.runtime.executor import model_runner as mr
from radixlm.runtime.executor.worker_batch import ModelWorkerBatch


def _runner(root: Path, window: int, longest: int) -> mr.ModelRunner:
    config = transformers.MistralConfig(**SHAPE, sliding_window=window)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(root)
    return mr.ModelRunner(ServerArgs(model_path=str(root), max_total_tokens=longest + 64,
                                     device="cpu"), str(root))


def _prefill(runner: mr.ModelRunner, n: int, table: torch.Tensor) -> float:
    """Seconds of one forward prefilling an ``n``-token prompt from an empty cache."""
    wb = ModelWorkerBatch(is_decode=False, req_pool_indices=[0], prefix_lens=[0],
                          extend_lens=[n], input_ids=torch.randint(0, 1000, (n,)).tolist(),
                          logit_ranges=[(n - 1, n)])
    t0 = time.perf_counter()
    runner.forward(wb, table)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompts", type=int, nargs="+", default=[1024, 2048, 4096])
    ap.add_argument("--window", type=int, default=512)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    assert cpu_paged.available(), "the CPU kernel is not built"
    with tempfile.TemporaryDirectory() as tmp:
        runner = _runner(Path(tmp), a.window, max(a.prompts))
    table = torch.randperm(max(a.prompts) + 64)[None, :]  # the prompt's slots, scattered
    kernel_passes = AttentionPlan.masked_passes
    variants = {"kernel": kernel_passes, "masked": lambda self, window: None}
    times: dict[tuple[str, int], list[float]] = {}
    for r in range(a.rounds + 1):
        for n in a.prompts if r else [256]:  # round 0 warms up
            for name, passes in variants.items():
                AttentionPlan.masked_passes = passes
                dt = _prefill(runner, n, table)
                if r:
                    times.setdefault((name, n), []).append(dt)
                    print(f"round {r} {name} {n}: {dt:.2f} s", flush=True)
    AttentionPlan.masked_passes = kernel_passes
    print(f"Mistral, small shape, float32, window {a.window}, {a.threads} threads; medians "
          f"of {a.rounds} alternating rounds")
    print("| prompt | kernel (s) | masked (s) | masked / kernel |")
    print("|---|---|---|---|")
    for n in a.prompts:
        k, m = (statistics.median(times[(v, n)]) for v in ("kernel", "masked"))
        print(f"| {n} | {k:.2f} | {m:.2f} | {m / k:.1f}x |")


if __name__ == "__main__":
    main()
