"""One decode step of a sliding-window model: the window's truncated layout through the plain
kernels (``ForwardBatch.window_views``) against the per-sequence masked path, and the same
weights with full attention.

    python benchmarks/sliding_window_decode.py [--batch 32] [--context 1024] [--window 256]

A Mistral of the ``small`` preset's shape (hidden 768, 12 layers, 12 heads, 4 KV heads,
intermediate 2048, vocabulary 32k; written by transformers' own classes, random weights) with
``--context`` tokens of random K/V per sequence decodes one token; the step is
``ModelRunner.forward``. Three variants alternate in one process: ``views`` (the default),
``masked`` (the windowed layers forced through ``kernels.masked_attention``) and ``full`` (a
checkpoint of the same weights without a window). Medians of ``--rounds`` steps.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
import transformers

from radixlm.runtime.config import ServerArgs
from radixlm.runtime.executor import model_runner as mr
from radixlm.runtime.executor.worker_batch import ModelWorkerBatch

SHAPE = {"hidden_size": 768, "intermediate_size": 2048, "num_hidden_layers": 12,
         "num_attention_heads": 12, "num_key_value_heads": 4, "head_dim": 64,
         "vocab_size": 32000, "max_position_embeddings": 8192}


def _checkpoints(root: Path, window: int) -> tuple[Path, Path]:
    config = transformers.MistralConfig(**SHAPE, sliding_window=window)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    windowed, full = root / "windowed", root / "full"
    model.save_pretrained(windowed)
    model.save_pretrained(full)
    cfg = json.loads((full / "config.json").read_text())
    (full / "config.json").write_text(json.dumps({**cfg, "sliding_window": None}))
    return windowed, full


def _runner(path: Path, batch: int, context: int) -> tuple[mr.ModelRunner, ModelWorkerBatch,
                                                            torch.Tensor]:
    pool = batch * (context + 1) + 64
    runner = mr.ModelRunner(ServerArgs(model_path=str(path), max_total_tokens=pool,
                                       device="cpu"), str(path))
    g = torch.Generator().manual_seed(0)
    for layer in range(runner.model_config.num_layers):
        for buf in runner.kv_pool.get_kv_buffer(layer):
            buf.copy_(torch.randn(buf.shape, generator=g) * 0.5)
    slots = torch.randperm(pool, generator=g)[: batch * (context + 1)].view(batch, -1)
    wb = ModelWorkerBatch(
        is_decode=True, req_pool_indices=list(range(batch)), prefix_lens=[context] * batch,
        extend_lens=[1] * batch, input_ids=torch.randint(0, 1000, (batch,)).tolist(),
        logit_ranges=[(0, 1)] * batch)
    return runner, wb, slots


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--window", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    with tempfile.TemporaryDirectory() as tmp:
        windowed, full = _checkpoints(Path(tmp), a.window)
        views = _runner(windowed, a.batch, a.context)
        full_runner = _runner(full, a.batch, a.context)
    windows = views[0].decode_windows
    variants = {"views": (views, windows), "masked": (views, []), "full": (full_runner, [])}
    steps: dict[str, list[float]] = {name: [] for name in variants}
    for r in range(a.rounds + 1):
        for name, ((runner, wb, table), decode_windows) in variants.items():
            runner.decode_windows = decode_windows
            t0 = time.perf_counter()
            runner.forward(wb, table)
            if r:  # round 0 warms up
                steps[name].append(time.perf_counter() - t0)
    print(f"Mistral, small shape, float32; batch {a.batch}, context {a.context}, window "
          f"{a.window}, {a.threads} threads; medians of {a.rounds} alternating steps")
    print("| variant | decode step (ms) |")
    print("|---|---|")
    for name, times in steps.items():
        print(f"| {name} | {statistics.median(times) * 1e3:.1f} |")


if __name__ == "__main__":
    main()
