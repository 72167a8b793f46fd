"""The fused CPU layer kernels (``kernels/cpu_fused``) against the torch reference they
replace: per operator, and inside the model runner's decode and prefill steps.

    python benchmarks/fused_layers_cpu.py --preset small [--dtype bfloat16] [--rounds 7]
        [--rows 1,32,512] [--no-steps]

Operators at the preset's shapes (RMSNorm with the residual add over ``hidden``, rotary
on q [N, heads, head_dim] / k [N, kv_heads, head_dim] as strided views of the qkv output,
SiLU-and-mul over [N, 2 * intermediate]) for each ``--rows`` N; then one decode step
(``--batch`` sequences over ``--context`` cached tokens) and one prefill step (``--batch``
prompts of ``--prompt`` tokens) of ``ModelRunner.forward``. The two paths alternate in one
process (``cpu_fused.supports`` patched off for ``torch``); each cell is the median of
``--rounds`` (operators: of ``--rounds`` batches of calls) and the table gives
torch / fused with the min..max of the per-round ratios.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from radixlm.kernels import cpu_fused, reference
from radixlm.runtime.config import ServerArgs
from radixlm.runtime.executor import model_runner as mr
from radixlm.runtime.executor.worker_batch import ModelWorkerBatch
from radixlm.runtime.model_config import ModelConfig
from radixlm.tiny_model import add_model_args, resolve_model

_SUPPORTS = cpu_fused.supports


def _use(fused: bool) -> None:
    cpu_fused.supports = _SUPPORTS if fused else (lambda *t: False)


def _alternate(fns: dict[str, Callable[[], object]], rounds: int, reps: int) -> dict:
    """Per variant: the per-call times of ``rounds`` rounds (after one warm-up round)."""
    times: dict[str, list[float]] = {k: [] for k in fns}
    for r in range(rounds + 1):
        for name, fn in fns.items():
            _use(name == "fused")
            t0 = time.perf_counter()
            for _ in range(reps):
                fn()
            if r:
                times[name].append((time.perf_counter() - t0) / reps)
    _use(True)
    return times


def _row(label: str, times: dict) -> str:
    t, f = times["torch"], times["fused"]
    ratios = [a / b for a, b in zip(t, f)]
    return (f"| {label} | {statistics.median(t) * 1e6:.0f} | {statistics.median(f) * 1e6:.0f} "
            f"| {statistics.median(ratios):.2f}x ({min(ratios):.2f}..{max(ratios):.2f}) |")


def _ops(cfg: ModelConfig, dtype: torch.dtype, n: int) -> dict[str, tuple[Callable, Callable]]:
    """The three operators on random inputs of ``n`` rows at the model's shapes: (torch
    reference, fused kernel), called directly (float32 RMSNorm is fused here too, though
    ``kernels.rms_norm`` keeps the reference for it)."""
    h, hq, d = cfg.hidden_size, cfg.num_attention_heads, cfg.head_dim
    hkv, inter = cfg.num_key_value_heads, cfg.intermediate_size
    g = torch.Generator().manual_seed(n)
    x, res = torch.randn(n, h, generator=g).to(dtype), torch.randn(n, h, generator=g).to(dtype)
    w = torch.randn(h, generator=g).to(dtype)
    qkv = torch.randn(n, (hq + 2 * hkv) * d, generator=g).to(dtype)
    q = qkv[:, : hq * d].view(n, hq, d)
    k = qkv[:, hq * d: (hq + hkv) * d].view(n, hkv, d)
    cs = torch.randn(4096, d, generator=g)
    pos = torch.randint(0, 4096, (n,), generator=g)
    gu = torch.randn(n, 2 * inter, generator=g).to(dtype)
    return {
        "add + RMSNorm": (lambda: reference.rms_norm(x, w, 1e-5, res),
                          lambda: cpu_fused.rms_norm(x, w, 1e-5, res)),
        "rotary q, k": (lambda: reference.apply_rotary(q, k, cs, pos),
                        lambda: cpu_fused.apply_rotary(q, k, cs, pos)),
        "SiLU x up": (lambda: reference.silu_and_mul(gu), lambda: cpu_fused.silu_and_mul(gu)),
    }


def op_table(cfg: ModelConfig, dtype: torch.dtype, rows: list[int], rounds: int) -> None:
    print("| operator, rows | torch (us) | fused (us) | torch / fused (min..max) |")
    print("|---|---|---|---|")
    for n in rows:
        reps = max(3, 2500 // max(n, 1))
        for name, (ref, fused) in _ops(cfg, dtype, n).items():
            print(_row(f"{name}, {n}", _alternate({"torch": ref, "fused": fused}, rounds, reps)),
                  flush=True)


def _runner(model_path: str, dtype: str, batch: int, context: int) -> mr.ModelRunner:
    args = ServerArgs(model_path=model_path, max_total_tokens=batch * (context + 1) + 64,
                      device="cpu", dtype=dtype)
    return mr.ModelRunner(args, model_path)


def step_table(model_path: str, dtype: str, batch: int, context: int, prompt: int,
               rounds: int) -> None:
    runner = _runner(model_path, dtype, batch, max(context, prompt))
    width = max(context, prompt) + 1
    req_to_token = torch.randperm(batch * width).view(batch, width)
    decode = ModelWorkerBatch(
        is_decode=True, req_pool_indices=list(range(batch)), prefix_lens=[context] * batch,
        extend_lens=[1] * batch, input_ids=[7] * batch, logit_ranges=[(0, 1)] * batch)
    prefill = ModelWorkerBatch(
        is_decode=False, req_pool_indices=list(range(batch)), prefix_lens=[0] * batch,
        extend_lens=[prompt] * batch, input_ids=[7] * (batch * prompt),
        logit_ranges=[(prompt - 1, prompt)] * batch)
    print(f"| step ({dtype}) | torch (us) | fused (us) | torch / fused (min..max) |")
    print("|---|---|---|---|")
    for label, wb in ((f"decode {batch} x {context}", decode),
                      (f"prefill {batch} x {prompt}", prefill)):
        def step(wb=wb):
            return runner.forward(wb, req_to_token)
        print(_row(label, _alternate({"torch": step, "fused": step}, rounds, 1)), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_model_args(ap)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--rows", default="1,32,512")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--no-steps", action="store_true", help="operators only")
    a = ap.parse_args()
    if not _SUPPORTS(torch.zeros(1)):
        ap.error("the CPU kernels are not built here (no compiler?)")
    torch.set_num_threads(a.threads)
    model_path = resolve_model(a.model_path, a.preset)
    cfg = ModelConfig.from_hf(model_path)
    print(f"model {model_path}; {a.dtype}; {a.threads} threads; medians of {a.rounds} "
          f"alternating rounds")
    op_table(cfg, getattr(torch, a.dtype), [int(r) for r in a.rows.split(",")], a.rounds)
    if not a.no_steps:
        step_table(model_path, a.dtype, a.batch, a.context, a.prompt, a.rounds)


if __name__ == "__main__":
    main()
