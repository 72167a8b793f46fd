"""The CPU matmuls of a model's linear layers: torch's ``F.linear`` (which repacks the
weight on every call) against oneDNN over a weight prepacked once (what the engine does on
a CPU in float32, ``distributed/layers.py``: ``Prepackable``), for the small preset's
shapes at decode (32 rows) and prefill (512, 2048 rows) sizes.

    .venv/bin/python benchmarks/cpu_linear.py [--threads 2] [--rows 32 512 2048]

Each cell: median ms of ``--runs`` calls, the two alternating; the last column checks
both against a float64 product (max abs error).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

# (name, out_features, in_features) of the small preset (hidden 768, 12 heads of 64,
# 4 KV heads, intermediate 2048, vocabulary 32000)
SHAPES = [("qkv_proj", 1280, 768), ("o_proj", 768, 768), ("gate_up_proj", 4096, 768),
          ("down_proj", 768, 2048), ("lm_head", 32000, 768)]


def _median_ms(fns: dict, runs: int) -> dict[str, float]:
    times: dict[str, list[float]] = {k: [] for k in fns}
    for r in range(runs + 2):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            if r >= 2:
                times[name].append(time.perf_counter() - t0)
    return {k: statistics.median(v) * 1e3 for k, v in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rows", type=int, nargs="+", default=[32, 512, 2048])
    ap.add_argument("--runs", type=int, default=10)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    g = torch.Generator().manual_seed(0)
    print(f"torch {torch.__version__}, {a.threads} threads, float32; median ms of {a.runs}")
    print("| layer | rows | F.linear (ms) | prepacked oneDNN (ms) | speed-up | max abs error "
          "(F.linear / oneDNN) |")
    print("|---|---|---|---|---|---|")
    with torch.inference_mode():
        for rows in a.rows:
            for name, n_out, n_in in SHAPES:
                w = torch.randn(n_out, n_in, generator=g) * 0.02
                x = torch.randn(rows, n_in, generator=g)
                packed = torch.ops.mkldnn._reorder_linear_weight(w, None)
                fns = {
                    "dense": lambda x=x, w=w: F.linear(x, w),
                    "packed": lambda x=x, p=packed: torch.ops.mkldnn._linear_pointwise(
                        x, p, None, "none", [], ""),
                }
                t = _median_ms(fns, a.runs)
                ref = F.linear(x.double(), w.double())
                err = [(fn().double() - ref).abs().max().item() for fn in fns.values()]
                print(f"| {name} | {rows} | {t['dense']:.2f} | {t['packed']:.2f} | "
                      f"{t['dense'] / t['packed']:.2f} | {err[0]:.1e} / {err[1]:.1e} |",
                      flush=True)


if __name__ == "__main__":
    main()
