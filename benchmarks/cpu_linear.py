"""The CPU matmuls of a model's linear layers: torch's ``F.linear`` (which repacks the
weight on every call) against oneDNN over a weight prepacked once (what the engine does on
a CPU in float32, ``distributed/layers.py``: ``Prepackable``), for the small preset's
shapes at decode (32 rows) and prefill (512, 2048 rows) sizes.

    .venv/bin/python benchmarks/cpu_linear.py [--threads 2] [--rows 32 512 2048]
        [--dtype bfloat16]

With ``--dtype bfloat16`` both run in bf16 (oneDNN's AMX / AVX512-BF16 kernels where the
CPU has them) and a third column times the float32 prepacked matmul, the float32 engine's.
Each cell: median ms of ``--runs`` calls, the two alternating; the last column checks
both against a float64 product (max abs error).

``--tiles`` (bf16, a CPU with AMX) times the decode path instead: oneDNN's prepacked bf16
linear against the tile kernel of ``radixlm/kernels/amx_linear.py`` at few rows (default 1,
16, 32, 48); ``--fma`` the same in float32 against ``radixlm/kernels/fma_linear.py``'s
AVX-512 panels; each over enough copies of the layer's weight to fill ``--stream-mb`` (the
copies cycled, so every call reads its weight from memory, as a decode step does):
ms per call and the GB/s of weight read, the two alternating, best of ``--runs`` passes.
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


def _packed(x: torch.Tensor, w: torch.Tensor):
    """``x @ w.T`` through oneDNN over ``w`` prepacked once (``Prepackable.matmul``)."""
    packed = torch.ops.mkldnn._reorder_linear_weight(w, None)
    return lambda: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")


def _decode_kernel(a: argparse.Namespace, fma: bool) -> None:
    """oneDNN's prepacked linear against the decode kernel of the dtype: the AMX tiles
    (bf16, ``--tiles``) or the AVX-512 panels (float32, ``--fma``)."""
    from radixlm.kernels import amx_linear, fma_linear

    kernel, dtype, flag = ((fma_linear, torch.float32, "--fma") if fma
                           else (amx_linear, torch.bfloat16, "--tiles"))
    if not kernel.supports(torch.zeros(1, 1, dtype=dtype)):
        raise SystemExit(f"{flag}: this CPU (or build) lacks the kernel's instructions")
    label = "panels" if fma else "tiles"
    rows = a.rows if a.rows != DEFAULT_ROWS else [1, 16, 32, 48]
    g = torch.Generator().manual_seed(0)
    size = dtype.itemsize
    print(f"torch {torch.__version__}, {a.threads} threads, {dtype}, weights from memory "
          f"({a.stream_mb} MB of copies); best of {a.runs} passes")
    print(f"| layer | rows | oneDNN ms (GB/s) | {label} ms (GB/s) | speed-up |")
    print("|---|---|---|---|---|")
    for name, n_out, n_in in SHAPES:
        copies = max(2, a.stream_mb * 2**20 // (n_out * n_in * size))
        ws = [(torch.randn(n_out, n_in, generator=g) * 0.02).to(dtype) for _ in range(copies)]
        onednn = [torch.ops.mkldnn._reorder_linear_weight(w, None) for w in ws]
        ours = [kernel.pack(w) for w in ws]
        for m in rows:
            x = torch.randn(m, n_in, generator=g).to(dtype)
            fns = {"onednn": lambda p, x=x: torch.ops.mkldnn._linear_pointwise(
                       x, p, None, "none", [], ""),
                   "ours": lambda p, x=x, n=n_out: kernel.linear(x, p, n)}
            best = {"onednn": float("inf"), "ours": float("inf")}
            for _ in range(a.runs):
                for key, packs in (("onednn", onednn), ("ours", ours)):
                    t0 = time.perf_counter()
                    for p in packs:
                        fns[key](p)
                    best[key] = min(best[key], (time.perf_counter() - t0) / copies)
            gbs = {k: n_out * n_in * size / v / 1e9 for k, v in best.items()}
            print(f"| {name} | {m} | {best['onednn'] * 1e3:.3f} ({gbs['onednn']:.1f}) | "
                  f"{best['ours'] * 1e3:.3f} ({gbs['ours']:.1f}) | "
                  f"{best['onednn'] / best['ours']:.2f} |", flush=True)


DEFAULT_ROWS = [32, 512, 2048]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rows", type=int, nargs="+", default=DEFAULT_ROWS)
    ap.add_argument("--runs", type=int, default=10)
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    ap.add_argument("--tiles", action="store_true", help="oneDNN vs the AMX tile kernel at "
                    "decode rows, weights read from memory (bf16)")
    ap.add_argument("--fma", action="store_true", help="oneDNN vs the AVX-512 panel kernel "
                    "at decode rows, weights read from memory (float32)")
    ap.add_argument("--stream-mb", type=int, default=200)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    if a.tiles or a.fma:
        with torch.inference_mode():
            _decode_kernel(a, a.fma)
        return
    dtype = getattr(torch, a.dtype)
    bf16 = dtype == torch.bfloat16
    torch.set_num_threads(a.threads)
    g = torch.Generator().manual_seed(0)
    print(f"torch {torch.__version__}, {a.threads} threads, {a.dtype}; median ms of {a.runs}")
    extra = " float32 prepacked (ms) |" if bf16 else ""
    print(f"| layer | rows | F.linear (ms) | prepacked oneDNN (ms) | speed-up |{extra} max abs "
          "error (F.linear / oneDNN) |")
    print("|---|---|---|---|---|---|" + ("---|" if bf16 else ""))
    with torch.inference_mode():
        for rows in a.rows:
            for name, n_out, n_in in SHAPES:
                w = (torch.randn(n_out, n_in, generator=g) * 0.02).to(dtype)
                x = torch.randn(rows, n_in, generator=g).to(dtype)
                fns = {"dense": lambda x=x, w=w: F.linear(x, w),
                       "packed": _packed(x, w)}
                if bf16:
                    fns["fp32"] = _packed(x.float(), w.float())
                t = _median_ms(fns, a.runs)
                ref = F.linear(x.double(), w.double())
                err = [(fns[k]().double() - ref).abs().max().item() for k in ("dense", "packed")]
                fp32 = f" {t['fp32']:.2f} |" if bf16 else ""
                print(f"| {name} | {rows} | {t['dense']:.2f} | {t['packed']:.2f} | "
                      f"{t['dense'] / t['packed']:.2f} |{fp32} {err[0]:.1e} / {err[1]:.1e} |",
                      flush=True)


if __name__ == "__main__":
    main()
