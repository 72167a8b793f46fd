"""CPU timings of the torch attention paths (the engine's CPU path), tiny-model shapes.

    python benchmarks/kernels_cpu.py [--quick]

Compares, for decode and extend batches (float32, Hq=4, Hkv=2, D=32 and 64):
  loop     one scaled_dot_product_attention per sequence (repeat_interleave for GQA)
  padded   the whole batch padded to the longest sequence, one SDPA call with a mask
  grouped  what ``radixlm.kernels.reference`` does: sequences of similar length in
           cache-sized padded groups, one SDPA call per group (GQA via enable_gqa)
Lengths: ``eq`` all sequences the same, ``var`` uniform between ctx/100 and ctx.

    python benchmarks/kernels_cpu.py --paged

The engine's two CPU paths at the small preset's head shape (Hq=12, Hkv=4, D=64), through
``AttentionPlan``: ``padded`` (K/V rows gathered per layer, torch's fused attention) and
``paged`` (the compiled kernel reading the pool in place, ``kernels/cpu_paged``, here for
every chunk length), for decode and for extend chunks of ``new`` tokens over ``ctx``
cached ones.

    python benchmarks/kernels_cpu.py --amx [--threads 1]

A bfloat16 model's three CPU paths at the same shapes (bf16 q and pool): ``padded``
(torch's fused attention in bf16), ``fma`` (the compiled kernel, q widened to float32)
and ``amx`` (the kernel with q in bf16: AMX tiles for tasks of 16 rows per KV head or
more, ``csrc/amx_attention.cpp``), with every chunk length in the kernel; each checked
against the padded result.

    python benchmarks/kernels_cpu.py --decode-pool [--threads 2]

The kernel alone over one decode step's K/V at ``decode_step.py``'s shape (32 sequences x
512 tokens at scattered slots, 12 layers each with its own buffers in the engine's
huge-page pool, Hq=12, Hkv=4, D=64), per pool dtype: ``cold`` reads K/V from memory as a
step does; ``hot`` has every sequence read the same 512 slots, so K/V come from cache and
the kernel's own arithmetic is what is timed.

    python benchmarks/kernels_cpu.py --thread-scaling [--threads 2]

The kernel on one thread against ``--threads`` (default 2) over the batches a step
hands it, at the small preset's shape (Hq=12, Hkv=2, D=64), float32 and bfloat16 (AMX
where the CPU has it): mixed batches (prompts of new tokens first, then decode rows, as
the scheduler orders them), prompts alone and decode rows alone; slots shuffled. Each
thread count gives the same bits (checked); the table is the time of each and the ratio.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from radixlm.kernels import cpu_paged, reference, shared_prefix
from radixlm.kernels.shared_prefix import AttentionPlan, planned_attention
from radixlm.radix_cache import kv_pool


def loop_attention(q, k, v, k_buf, v_buf, qo_indptr, kv_indptr, kv_indices, scale):
    """The first reference: a Python loop over sequences."""
    out = torch.empty_like(q)
    hq, hkv = q.shape[1], k_buf.shape[1]
    qo, kv = qo_indptr.tolist(), kv_indptr.tolist()
    for b in range(len(qo) - 1):
        qs, qe = qo[b], qo[b + 1]
        idx = kv_indices[kv[b] : kv[b + 1]]
        kk, vv = k_buf[idx], v_buf[idx]  # [P, Hkv, D]
        if k is not None:
            kk, vv = torch.cat((kk, k[qs:qe])), torch.cat((vv, v[qs:qe]))
        n_new, n_kv = qe - qs, kk.shape[0]
        rows = torch.arange(n_new).unsqueeze(1) + (n_kv - n_new)
        mask = torch.arange(n_kv).unsqueeze(0) <= rows
        kk = kk.transpose(0, 1).repeat_interleave(hq // hkv, 0)  # [Hq, n_kv, D]
        vv = vv.transpose(0, 1).repeat_interleave(hq // hkv, 0)
        o = F.scaled_dot_product_attention(
            q[qs:qe].transpose(0, 1)[None], kk[None], vv[None], attn_mask=mask, scale=scale
        )
        out[qs:qe] = o[0].transpose(0, 1)
    return out


def padded_attention(q, k, v, k_buf, v_buf, qo_indptr, kv_indptr, kv_indices, scale):
    """The whole batch as one padded group."""
    out = torch.empty_like(q)
    q_lens = (qo_indptr[1:] - qo_indptr[:-1]).tolist()
    kv_lens = (kv_indptr[1:] - kv_indptr[:-1]).tolist()
    reference._padded_attention(
        q,
        k,
        v,
        k_buf,
        v_buf,
        qo_indptr[:-1],
        kv_indptr[:-1],
        q_lens,
        kv_lens,
        kv_indices,
        scale,
        out,
    )
    return out


def grouped_attention(q, k, v, k_buf, v_buf, qo_indptr, kv_indptr, kv_indices, scale):
    if k is None:
        return reference.decode_attention(q, k_buf, v_buf, kv_indptr, kv_indices, scale)
    return reference.extend_attention(
        q, k, v, k_buf, v_buf, qo_indptr, kv_indptr, kv_indices, scale
    )


IMPLS: dict[str, Callable] = {
    "loop": loop_attention,
    "padded": padded_attention,
    "grouped": grouped_attention,
}


def make_batch(kind: str, batch: int, ctx: int, new: int, var: bool, d: int, gen: torch.Generator):
    """Ragged batch: ``ctx`` cached tokens (decode: including the new one), ``new`` queries
    per sequence; extend batches also carry the new tokens' k and v."""
    lens = torch.full((batch,), ctx)
    if var and ctx > 1:
        lens = torch.randint(max(ctx // 100, 1), ctx + 1, (batch,), generator=gen)
        lens[0] = ctx
    hq, hkv = 4, 2
    nnz = int(lens.sum())
    k_buf, v_buf = torch.randn(nnz + 16, hkv, d), torch.randn(nnz + 16, hkv, d)
    kv_indices = torch.randperm(nnz + 16, generator=gen)[:nnz]
    kv_indptr = torch.cat((torch.zeros(1, dtype=torch.long), lens.cumsum(0)))
    qo_indptr = torch.arange(batch + 1) * new
    q = torch.randn(batch * new, hq, d)
    k = v = None
    if kind != "decode":
        k, v = torch.randn(batch * new, hkv, d), torch.randn(batch * new, hkv, d)
    return q, k, v, k_buf, v_buf, qo_indptr, kv_indptr, kv_indices, d**-0.5


def time_ms(fn: Callable, args: tuple, budget_s: float) -> float:
    fn(*args)
    times = []
    start = time.perf_counter()
    while time.perf_counter() - start < budget_s or len(times) < 3:
        t0 = time.perf_counter()
        fn(*args)
        times.append(time.perf_counter() - t0)
    return min(times) * 1e3  # the minimum: other processes share this machine


def run(cases: list[tuple[str, int, int, int]], budget_s: float) -> None:
    gen = torch.Generator().manual_seed(0)
    head = f"{'kind':7} {'D':>3} {'B':>3} {'ctx':>5} {'new':>4} {'lens':4} "
    print(head + " ".join(f"{n:>9}" for n in IMPLS) + "   best  (ms, min of runs)")
    for kind, batch, ctx, new in cases:
        for d in (32, 64):
            for var in (False, True):
                args = make_batch(kind, batch, ctx, new, var, d, gen)
                ref = grouped_attention(*args)
                row = {}
                for name, fn in IMPLS.items():
                    torch.testing.assert_close(fn(*args), ref, rtol=1e-4, atol=1e-4)
                    row[name] = time_ms(fn, args, budget_s)
                best = min(row, key=row.get)
                cells = " ".join(f"{row[n]:9.3f}" for n in IMPLS)
                lens = "var" if var else "eq"
                print(f"{kind:7} {d:3} {batch:3} {ctx:5} {new:4} {lens:4} {cells}   {best}")


def paged_case(batch: int, ctx: int, new: int, gen: torch.Generator,
               dtype: torch.dtype = torch.float32, amx: bool = False):
    """``batch`` sequences of ``ctx`` cached + ``new`` tokens in shuffled slots; the new
    tokens' K/V already in the pool (as the model stores them before attention). With
    ``amx`` a third plan, ``amx``: the kernel taking q in bf16."""
    hq, hkv, d = 12, 4, 64
    n = batch * (ctx + new)
    k_buf = torch.randn(n + 64, hkv, d).to(dtype)
    v_buf = torch.randn(n + 64, hkv, d).to(dtype)
    slots = torch.randperm(n + 64, generator=gen)[:n].view(batch, ctx + new)
    kv_indices, new_slots = slots[:, :ctx].reshape(-1), slots[:, ctx:].reshape(-1)
    q = torch.randn(batch * new, hq, d, generator=gen).to(dtype)
    qo = torch.arange(batch + 1) * new
    extend = new > 1 or ctx == 0
    if not extend:  # decode: the new token is the last of each sequence's KV
        kv_indices, new_slots = slots.reshape(-1), None
    kv_indptr = torch.arange(batch + 1) * (ctx + (0 if extend else new))
    kinds = [("padded", False, False), ("paged", True, False)] + [("amx", True, True)] * amx
    plans = {name: AttentionPlan.build(qo, kv_indptr, kv_indices, hkv * d, extend=extend,
                                       paged_kernel=paged, new_slots=new_slots, dtype=dtype,
                                       amx=use_amx)
             for name, paged, use_amx in kinds}
    k = k_buf[new_slots] if extend else None
    v = v_buf[new_slots] if extend else None
    return plans, (q, k, v, k_buf, v_buf, d**-0.5)


def _checked_times(plans: dict, args: tuple, budget_s: float, tol: float) -> dict[str, float]:
    """Each plan's result checked against the padded one's (within ``tol``), then each
    plan's time (ms, min of runs)."""
    ref = planned_attention(plans["padded"], *args).float()
    for name, plan in plans.items():
        torch.testing.assert_close(planned_attention(plan, *args).float(), ref, rtol=tol,
                                   atol=tol, msg=lambda m, name=name: f"{name}: {m}")
    return {name: time_ms(planned_attention, (plan, *args), budget_s)
            for name, plan in plans.items()}


def _table_head(dtype: str, columns: list[str]) -> None:
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {dtype}, "
          "Hq=12 Hkv=4 D=64; ms, min of runs")
    cols = ["B", "ctx", "new", *columns]
    print("| " + " | ".join(cols) + " |")
    print("|" + "---|" * len(cols))


def run_paged(budget_s: float) -> None:
    if not cpu_paged.available():
        raise SystemExit("the CPU kernel is not built (no C++ compiler?)")
    gen = torch.Generator().manual_seed(0)
    _table_head("float32", ["padded (ms)", "paged (ms)", "padded / paged"])
    # the kernel for every extend chunk here, whatever its length, to find where it stops
    # paying (the engine's threshold, shared_prefix.KERNEL_MAX_EXTEND_ROWS)
    shared_prefix.KERNEL_MAX_EXTEND_ROWS = 1 << 30
    cases = [(32, 128, 1), (32, 512, 1), (8, 2048, 1), (1, 4096, 1), (8, 512, 4),
             (8, 512, 8), (8, 512, 16), (8, 512, 32), (8, 512, 64), (4, 512, 128),
             (4, 512, 256), (1, 512, 512), (1, 512, 1024),
             (8, 0, 16), (8, 0, 32), (4, 0, 256), (1, 0, 512), (1, 0, 1024), (1, 0, 2048)]
    for batch, ctx, new in cases:
        plans, args = paged_case(batch, ctx, new, gen)
        t = _checked_times(plans, args, budget_s, 1e-4)
        print(f"| {batch} | {ctx} | {new} | {t['padded']:.2f} | {t['paged']:.2f} | "
              f"{t['padded'] / t['paged']:.2f} |")


def run_amx(budget_s: float) -> None:
    if not cpu_paged.amx():
        raise SystemExit("no AMX path here (kernel not built, or no AMX-BF16 on this CPU)")
    gen = torch.Generator().manual_seed(0)
    _table_head("bfloat16", ["padded (ms)", "fma (ms)", "amx (ms)", "fma / amx", "padded / amx"])
    shared_prefix.KERNEL_MAX_EXTEND_ROWS_BF16 = 1 << 30  # fma: the kernel for every chunk
    cases = [(32, 512, 1), (8, 512, 4), (8, 512, 8), (8, 512, 32), (32, 512, 32),
             (4, 512, 128), (4, 512, 256), (1, 512, 1024), (8, 0, 32), (4, 0, 256),
             (1, 0, 1024), (1, 0, 2048)]
    for batch, ctx, new in cases:
        plans, args = paged_case(batch, ctx, new, gen, torch.bfloat16, amx=True)
        t = _checked_times(plans, args, budget_s, 2e-2)
        print(f"| {batch} | {ctx} | {new} | {t['padded']:.2f} | {t['paged']:.2f} | "
              f"{t['amx']:.2f} | {t['paged'] / t['amx']:.2f} | {t['padded'] / t['amx']:.2f} |")


def run_decode_pool(rounds: int) -> None:
    if not cpu_paged.available():
        raise SystemExit("the CPU kernel is not built (no C++ compiler?)")
    b, ctx, hq, hkv, d, layers = 32, 512, 12, 4, 64, 12
    gen = torch.Generator().manual_seed(0)
    size = b * (ctx + 1) + 64
    q = torch.randn(b, hq, d, generator=gen)
    rows, q_indptr = torch.arange(b), torch.arange(b + 1)
    kv_indptr = torch.arange(b + 1) * ctx
    cold = torch.randperm(size, generator=gen)[: b * ctx]
    hot = cold[:ctx].repeat(b)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; {layers} layers x "
          f"{b} sequences x {ctx} tokens, Hq={hq} Hkv={hkv} D={d}; ms per step, "
          f"median of {rounds}")
    print("| K/V dtype | cold (ms) | K/V read rate (GB/s) | hot (ms) |")
    print("|---|---|---|---|")
    for dtype in cpu_paged.KV_DTYPES:
        bufs = kv_pool.pool_buffers(2 * layers, (size, hkv, d), dtype, torch.device("cpu"))
        for buf in bufs:
            buf.copy_(torch.randn(buf.shape, generator=gen) * 0.5)
        t = {}
        for name, idx in (("cold", cold), ("hot", hot)):
            times = []
            for r in range(rounds + 1):  # round 0 warms up
                t0 = time.perf_counter()
                for i in range(layers):
                    cpu_paged.paged_attention(q, bufs[i], bufs[layers + i], rows, q_indptr,
                                              kv_indptr, idx, d**-0.5)
                times += [time.perf_counter() - t0] if r else []
            t[name] = statistics.median(times)
        nbytes = 2 * layers * b * ctx * hkv * d * bufs[0].element_size()
        print(f"| {str(dtype).removeprefix('torch.')} | {t['cold'] * 1e3:.2f} | "
              f"{nbytes / t['cold'] / 1e9:.1f} | {t['hot'] * 1e3:.2f} |")


def _mixed_call(dtype: torch.dtype, prompts: int, new: int, rows: int, ctx: int,
                gen: torch.Generator) -> Callable:
    """One kernel call over ``prompts`` prompts of ``new`` tokens (nothing cached) and then
    ``rows`` decode rows over ``ctx`` keys each, causal, slots shuffled."""
    hq, hkv, d = 12, 2, 64
    q_lens, k_lens = [new] * prompts + [1] * rows, [new] * prompts + [ctx] * rows
    n, size = sum(q_lens), sum(k_lens)
    q = torch.randn(n, hq, d, generator=gen).to(dtype)
    k_buf, v_buf = (torch.randn(size, hkv, d, generator=gen).to(dtype) for _ in range(2))
    slots = torch.randperm(size, generator=gen)
    q_rows = torch.arange(n)
    q_indptr = torch.tensor([0, *q_lens]).cumsum(0)
    kv_indptr = torch.tensor([0, *k_lens]).cumsum(0)
    return lambda: cpu_paged.paged_attention(q, k_buf, v_buf, q_rows, q_indptr, kv_indptr,
                                             slots, d**-0.5, causal=True)


def run_thread_scaling(threads: int, budget_s: float) -> None:
    if not cpu_paged.available():
        raise SystemExit("the CPU kernel is not built (no C++ compiler?)")
    gen = torch.Generator().manual_seed(0)
    cases = [(8, 256, 24, 300), (1, 1024, 30, 600), (3, 700, 8, 400), (8, 256, 0, 0),
             (0, 0, 48, 600), (0, 0, 4, 2000)]
    print(f"torch {torch.__version__}, Hq=12 Hkv=2 D=64, causal, shuffled slots; ms, min "
          f"of runs")
    print(f"| dtype | prompts x new | decode rows x keys | 1 thread (ms) | {threads} threads "
          f"(ms) | ratio |")
    print("|---|---|---|---|---|---|")
    for dtype in (torch.float32, torch.bfloat16):
        for prompts, new, rows, ctx in cases:
            call = _mixed_call(dtype, prompts, new, rows, ctx, gen)
            times, outs = {}, {}
            for n in (1, threads):
                torch.set_num_threads(n)
                outs[n] = call()
                times[n] = time_ms(call, (), budget_s)
            same = all(torch.equal(a, b) for a, b in zip(outs[1], outs[threads]))
            assert same, f"{threads} threads changed the bits of {prompts, new, rows, ctx}"
            print(f"| {str(dtype).removeprefix('torch.')} | {prompts} x {new} | {rows} x {ctx} "
                  f"| {times[1]:.2f} | {times[threads]:.2f} | "
                  f"{times[1] / times[threads]:.2f}x |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer shapes, shorter timing")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: default)")
    parser.add_argument("--paged", action="store_true",
                        help="the engine's padded vs paged (compiled kernel) CPU paths")
    parser.add_argument("--amx", action="store_true",
                        help="a bf16 model's paths: padded, the kernel in fp32, on AMX tiles")
    parser.add_argument("--decode-pool", action="store_true",
                        help="the compiled kernel over a decode step's pool, per K/V dtype")
    parser.add_argument("--thread-scaling", action="store_true",
                        help="the compiled kernel on one thread against --threads (2)")
    args = parser.parse_args()
    if args.thread_scaling:
        run_thread_scaling(args.threads or 2, 0.05 if args.quick else 0.3)
        return
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.decode_pool:
        run_decode_pool(5 if args.quick else 15)
        return
    if args.paged:
        run_paged(0.05 if args.quick else 0.3)
        return
    if args.amx:
        run_amx(0.05 if args.quick else 0.3)
        return
    decode = [("decode", b, c, 1) for b in (1, 8, 32) for c in (64, 512, 2048)]
    # extend: prefill chunks over a cached prefix (ctx), and a mixed batch of 1-token rows
    extend = [("extend", b, c, n) for b, c, n in ((1, 0, 256), (1, 512, 256), (4, 256, 64))]
    extend += [("mixed", 16, 512, 1)]
    if args.quick:
        decode = [("decode", b, c, 1) for b in (1, 32) for c in (64, 1024)]
        extend = extend[1:2] + extend[-1:]
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, float32, Hq=4 Hkv=2")
    run(decode + extend, 0.05 if args.quick else 0.2)


if __name__ == "__main__":
    main()
