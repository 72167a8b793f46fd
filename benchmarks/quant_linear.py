"""The CPU products by quantized weights (``radixlm/kernels/quant_linear.py``) against
dense bf16 through oneDNN's prepacked linear (what the engine runs for a bf16 model,
``distributed/layers.py``: ``Prepackable``) and the per-channel int8 of ``int8_linear.py``:
``int8`` torch's packed int8 kernel (``aten._weight_int8pack_mm``), ``int8wo`` what
``--torchao-config int8wo`` runs on a bf16 model with AVX512-BF16 (``quant_linear``'s
weight-only w8 kernel, x in bf16).

    .venv/bin/python benchmarks/quant_linear.py [--threads 2] [--rows 1 8 128]
        [--preset small 1b] [--runs 15] [--stream-mb 300] [--cpu-time]

One transformer layer's four products (qkv, o, gate_up, down) of each preset: ``small``
(hidden 768, 12/4 heads of 64, intermediate 2048) and ``1b`` (hidden 2048, 32/8 heads of
64, intermediate 8192). Each method holds enough copies of the layer to fill
``--stream-mb`` of bf16 weights, so that, as in a decode step, every product reads its
weight from memory; a round times one pass over every copy per method, the methods
alternating; the figure is the median over rounds of ms per layer, and its ratio to bf16.

    w4  g32 with offsets (GGUF Q4_K-like)   w8  g32 (Q8_0-like)   fp8  block 128 columns
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from radixlm.kernels import int8_linear, quant_linear
from radixlm.kernels.qweight import QuantWeight

PRESETS = {  # (hidden, heads, kv_heads, head_dim, intermediate)
    "small": (768, 12, 4, 64, 2048),
    "1b": (2048, 32, 8, 64, 8192),
}
KINDS = {"w4": ("w4", 32, True), "w8": ("w8", 32, False), "fp8": ("fp8", 128, False)}


def shapes(preset: str) -> list[tuple[str, int, int]]:
    """(name, out_features, in_features) of one layer's products."""
    hidden, heads, kv_heads, head_dim, inter = PRESETS[preset]
    return [("qkv", (heads + 2 * kv_heads) * head_dim, hidden),
            ("o", hidden, heads * head_dim), ("gate_up", 2 * inter, hidden),
            ("down", hidden, inter)]


def random_qweight(kind: str, n: int, k: int, group: int, mins: bool,
                   g: torch.Generator) -> QuantWeight:
    groups = -(-k // group)
    if kind == "w4":
        data = torch.randint(0, 256, (n, -(-k // 2)), dtype=torch.uint8, generator=g)
    elif kind == "w8":
        data = torch.randint(-128, 128, (n, k), dtype=torch.int8, generator=g)
    else:
        data = (torch.randn(n, k, generator=g) * 64).to(torch.float8_e4m3fn)
    scales = torch.rand(n, groups, generator=g) * 1e-3 + 1e-4
    offsets = -8 * scales if mins else None
    return QuantWeight(kind, n, k, group, data, scales, offsets)


def methods(preset: str, g: torch.Generator
            ) -> dict[str, Callable[[dict[int, torch.Tensor]], object]]:
    """One layer's four products per method, as a function of x by in-features."""
    out: dict[str, list[Callable[[torch.Tensor], object]]] = {"bf16": [], "int8": []}
    for _, n, k in shapes(preset):
        w = (torch.randn(n, k, generator=g) * 0.02).to(torch.bfloat16)
        pw = torch.ops.mkldnn._reorder_linear_weight(w, None)
        out["bf16"].append(lambda x, p=pw: torch.ops.mkldnn._linear_pointwise(
            x, p, None, "none", [], ""))
        q, s = int8_linear.quantize_per_channel(w)
        out["int8"].append(lambda x, q=q, s=s: int8_linear.int8_linear(x, q, s))
        wo = int8_linear.pack(q, s)
        if wo is not None:
            out.setdefault("int8wo", []).append(
                lambda x, q=q, s=s, p=wo: int8_linear.int8_linear(x, q, s, None, p))
        for name, (kind, group, mins) in KINDS.items():
            packed = quant_linear.pack(random_qweight(kind, n, k, group, mins, g))
            out.setdefault(name, []).append(lambda x, p=packed: quant_linear.linear(x, p))
    ins = [k for _, _, k in shapes(preset)]
    return {name: (lambda xs, fs=fs: [f(xs[k]) for f, k in zip(fs, ins)])
            for name, fs in out.items()}


def bench(preset: str, rows: list[int], runs: int, stream_mb: int, cpu_time: bool) -> None:
    g = torch.Generator().manual_seed(0)
    layer_mb = sum(n * k for _, n, k in shapes(preset)) * 2 / 2**20
    copies = max(1, round(stream_mb / layer_mb))
    stacks = [methods(preset, g) for _ in range(copies)]
    print(f"\n{preset}: {copies} copies of a layer ({layer_mb:.0f} MB in bf16 each)")
    print("| rows | " + " | ".join(f"{m} ms (x bf16)" for m in stacks[0]) + " |")
    print("|---" * (len(stacks[0]) + 1) + "|")
    ins = {k for _, _, k in shapes(preset)}
    for m in rows:
        x = {k: torch.randn(m, k, generator=g).to(torch.bfloat16) for k in ins}
        times: dict[str, list[float]] = {name: [] for name in stacks[0]}
        clock = time.thread_time if cpu_time else time.perf_counter
        for r in range(runs + 1):
            for name in times:
                t0 = clock()
                for stack in stacks:
                    stack[name](x)
                if r:  # the first round warms up
                    times[name].append((clock() - t0) / copies * 1e3)
        med = {name: statistics.median(t) for name, t in times.items()}
        cells = [f"{v:.3f} ({v / med['bf16']:.2f})" for v in med.values()]
        print(f"| {m} | " + " | ".join(cells) + " |", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8, 128])
    ap.add_argument("--preset", nargs="+", default=list(PRESETS), choices=list(PRESETS))
    ap.add_argument("--runs", type=int, default=15)
    ap.add_argument("--stream-mb", type=int, default=300)
    ap.add_argument("--cpu-time", action="store_true", help="time the thread's CPU time, "
                    "not the wall clock (with --threads 1: figures that hold on a busy host)")
    a = ap.parse_args()
    if a.cpu_time and a.threads != 1:
        raise SystemExit("--cpu-time measures one thread: pass --threads 1")
    torch.set_num_threads(a.threads)
    if not all(quant_linear.supports(random_qweight(kind, 16, 64, group, mins,
                                                    torch.Generator()))
               for kind, group, mins in KINDS.values()):
        raise SystemExit("the CPU kernel library is not built (see kernels/cpu_paged.py)")
    clock = "CPU time" if a.cpu_time else "wall clock"
    print(f"torch {torch.__version__}, {a.threads} threads, x bf16, quant_linear isa "
          f"{quant_linear.isa()} (fp8 {quant_linear.fp8_isa()}); median of {a.runs} rounds, "
          f"{clock}")
    with torch.inference_mode():
        for preset in a.preset:
            bench(preset, a.rows, a.runs, a.stream_mb, a.cpu_time)


if __name__ == "__main__":
    main()
