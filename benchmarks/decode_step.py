"""One decode step of the engine's model runner, and the share of it spent in attention.

    python benchmarks/decode_step.py --preset small [--batch 32] [--context 512]
        [--kv-cache-dtype bfloat16] [--disable-cpu-weight-prepack] [--paths paged]
        [--no-huge-pages] [--dtype bfloat16]

A batch of ``--batch`` sequences, each with ``--context`` tokens already in the KV pool
(random K/V, pages shuffled as a long-running pool's are), decodes one token; the step is
``ModelRunner.forward`` (batch building, the 12-layer forward, logits). Decode attention
is timed by wrapping ``kernels.decode_attention`` (CPU work is synchronous, so wall time
around the call is its cost). Two attention paths alternate in one process: the compiled
CPU kernel reading K/V in place (``paged``) and the padded torch passes that gather each
sequence's K/V rows every layer (``gather``); ``--paths paged`` runs the kernel alone (the
gather path's copies otherwise flush the caches between its steps). Medians of
``--rounds`` steps.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from radixlm import kernels
from radixlm.kernels import cpu_paged
from radixlm.radix_cache import kv_pool
from radixlm.runtime.config import ServerArgs
from radixlm.runtime.executor import model_runner as mr
from radixlm.runtime.executor.worker_batch import ModelWorkerBatch
from radixlm.runtime.tokenizer import resolve_model_path
from radixlm.tiny_model import add_model_args, resolve_model

_ATTN = [0.0]


def _timed_decode_attention(fn):
    def wrapper(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            _ATTN[0] += time.perf_counter() - t0

    return wrapper


def _setup(model_path: str, batch: int, context: int, threads: int, kv_dtype: str,
           no_prepack: bool, dtype: str = "auto"):
    torch.set_num_threads(threads)
    pool = batch * (context + 1) + 64
    args = ServerArgs(model_path=model_path, max_total_tokens=pool, device="cpu", dtype=dtype,
                      kv_cache_dtype=kv_dtype, disable_cpu_weight_prepack=no_prepack)
    runner = mr.ModelRunner(args, model_path)
    g = torch.Generator().manual_seed(0)
    for layer in range(runner.model_config.num_layers):
        for buf in runner.kv_pool.get_kv_buffer(layer):
            buf.copy_(torch.randn(buf.shape, generator=g) * 0.5)
    width = context + 1
    slots = torch.randperm(pool, generator=g)[: batch * width].view(batch, width)
    req_to_token = slots.clone()
    wb = ModelWorkerBatch(
        is_decode=True, req_pool_indices=list(range(batch)), prefix_lens=[context] * batch,
        extend_lens=[1] * batch, input_ids=torch.randint(0, 1000, (batch,)).tolist(),
        logit_ranges=[(0, 1)] * batch)
    return runner, wb, req_to_token


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_model_args(ap)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--kv-cache-dtype", default="auto", help="the KV pool's dtype")
    ap.add_argument("--dtype", default="auto", help="the model's dtype (--dtype)")
    ap.add_argument("--disable-cpu-weight-prepack", action="store_true")
    ap.add_argument("--no-huge-pages", action="store_true",
                    help="the KV pool in ordinary pages (without kv_pool's huge-page advice)")
    ap.add_argument("--paths", default="paged,gather",
                    help="attention paths to time, alternating: paged, gather or both")
    a = ap.parse_args()
    model_path = resolve_model_path(resolve_model(a.model_path, a.preset))  # a .gguf too
    if a.no_huge_pages:
        kv_pool._advise_huge_pages = lambda t: False
    runner, wb, req_to_token = _setup(model_path, a.batch, a.context, a.threads,
                                      a.kv_cache_dtype, a.disable_cpu_weight_prepack, a.dtype)
    kernels.decode_attention = _timed_decode_attention(kernels.decode_attention)
    wanted = set(a.paths.split(","))
    if not wanted or wanted - {"paged", "gather"}:
        ap.error(f"--paths: paged, gather or paged,gather, got {a.paths!r}")
    if not cpu_paged.available():
        wanted.discard("paged")
    paths = {p: p == "paged" for p in ("paged", "gather") if p in wanted}
    if not paths:
        ap.error("the CPU kernel is not available here; time --paths gather")
    steps: dict[str, list[float]] = {p: [] for p in paths}
    attn: dict[str, list[float]] = {p: [] for p in paths}
    for r in range(a.rounds + 1):
        for name, use in paths.items():
            type(runner).paged_kernel = property(lambda self, use=use: use)
            _ATTN[0] = 0.0
            t0 = time.perf_counter()
            runner.forward(wb, req_to_token)
            if r:  # round 0 warms up
                steps[name].append(time.perf_counter() - t0)
                attn[name].append(_ATTN[0])
    print(f"model {model_path} in {runner.dtype}; batch {a.batch}, context {a.context}, "
          f"{a.threads} threads; {runner.kv_cache_dtype} K/V; {runner.prepacked_layers} "
          f"prepacked linear layers; medians of {a.rounds} alternating steps")
    print("| attention path | decode step (ms) | decode attention (ms) | attention share |")
    print("|---|---|---|---|")
    for name in paths:
        s, t = statistics.median(steps[name]), statistics.median(attn[name])
        print(f"| {name} | {s * 1e3:.1f} | {t * 1e3:.1f} | {t / s:.0%} |")


if __name__ == "__main__":
    main()
