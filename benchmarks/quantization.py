"""Weight-only int8 (``--torchao-config int8wo``) against the dense model, both activation
dtypes, side by side in one process:

- engine: output tok/s on the unique workload (32 prompts x 256 random tokens, 64 output
  tokens, greedy, EOS ignored) for bf16, bf16 + int8 weights, fp32, fp32 + int8 weights,
  the four alternating each round; medians (min-max) of ``--rounds``; weight_bytes of each;
- match: greedy token-match rate of int8 against the dense model of the same dtype (and
  of bf16 against fp32, for scale): 16 prompts x 64 tokens, the tokens before each
  prompt's first divergence over all tokens, and teacher-forced (each position predicted
  from the reference's own prefix, so one early divergence does not end the count);
- kernels (``--kernels``): CPU time (one thread, so a busy machine does not count) of one
  layer's four projections for each row count: dense F.linear, oneDNN-prepacked, the
  packed int8 kernel, the widened int8 weight, and ``int8_linear`` (what the engine runs).

    .venv/bin/python benchmarks/quantization.py --preset small
    .venv/bin/python benchmarks/quantization.py --preset small --kernels --rows 1 8 32 256
    .venv/bin/python benchmarks/quantization.py --preset small --prompts 1 --match-prompts 0
    .venv/bin/python benchmarks/quantization.py --rounds 1 --prompts 8   # quick, tiny model
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch
import torch.nn.functional as F

import radixlm
from radixlm.kernels.int8_linear import int8_linear, quantize_per_channel
from radixlm.runtime.model_config import ModelConfig
from radixlm.tiny_model import add_model_args, resolve_model

VARIANTS = {  # name -> (dtype, torchao_config)
    "bf16": ("bfloat16", ""), "bf16+int8": ("bfloat16", "int8wo"),
    "fp32": ("float32", ""), "fp32+int8": ("float32", "int8wo"),
}
# (name, out_features, in_features) of the small preset's projections in one layer
SHAPES = [("qkv_proj", 1280, 768), ("o_proj", 768, 768), ("gate_up_proj", 4096, 768),
          ("down_proj", 768, 2048)]


def prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(10, vocab) for _ in range(length)] for _ in range(n)]


def run_round(engines: dict, ids: list[list[int]],
              out_len: int) -> dict[str, tuple[float, float]]:
    """(output tok/s, output tokens per CPU-second of this process) of each engine on
    ``ids``, one after the other. The Engine steps in the caller's threads, so with one
    torch thread the second figure is what an idle core would give, however busy the
    machine is."""
    sp = {"max_new_tokens": out_len, "temperature": 0, "ignore_eos": True}
    result = {}
    for name, eng in engines.items():
        eng.flush_cache()
        t0, c0 = time.perf_counter(), time.process_time()
        outs = eng.generate(input_ids=ids, sampling_params=sp)
        dt, dc = time.perf_counter() - t0, time.process_time() - c0
        assert all(len(o["output_ids"]) == out_len for o in outs)
        result[name] = (len(ids) * out_len / dt, len(ids) * out_len / dc)
    return result


def match_rate(a: list[list[int]], b: list[list[int]]) -> float:
    """Tokens before each pair's first divergence, over all tokens."""
    same = 0
    for x, y in zip(a, b):
        n = next((i for i, (p, q) in enumerate(zip(x, y)) if p != q), len(x))
        same += n
    return same / sum(len(x) for x in a)


def engine_report(args: argparse.Namespace, path: str) -> None:
    engines = {name: radixlm.Engine(model_path=path, dtype=dt, torchao_config=cfg,
                                    cpu_threads=args.threads, random_seed=0,
                                    max_total_tokens=args.prompts * (args.input_len
                                                                     + args.output_len) + 64)
               for name, (dt, cfg) in VARIANTS.items()}
    try:
        vocab = ModelConfig.from_hf(path).vocab_size
        print(f"model {path}, {args.threads} threads")
        for name, eng in engines.items():
            mb = eng.get_server_info()["weight_bytes"] / 1e6
            print(f"  {name:10s} weight_bytes {mb:8.1f} MB")
        ids = prompts(args.prompts, args.input_len, vocab, seed=0)
        run_round(engines, ids[:2], 4)  # warm-up
        rounds: dict[str, list[tuple[float, float]]] = {k: [] for k in engines}
        for r in range(args.rounds):
            order = list(engines) if r % 2 == 0 else list(engines)[::-1]
            got = run_round({k: engines[k] for k in order}, ids, args.output_len)
            for k, v in got.items():
                rounds[k].append(v)
            print(f"  round {r + 1} (tok/s, tok per CPU-s): "
                  + ", ".join(f"{k} {got[k][0]:.1f} {got[k][1]:.1f}" for k in engines),
                  flush=True)
        print_table(rounds, f"{args.prompts} x {args.input_len} in, {args.output_len} out")
        if args.match_prompts:
            match_report(engines, prompts(args.match_prompts, 32, vocab, seed=1),
                         args.match_tokens)
    finally:
        for eng in engines.values():
            eng.shutdown()


def print_table(rounds: dict[str, list[tuple[float, float]]], workload: str) -> None:
    """Medians (min-max) of both figures, and each against the dense model of its dtype."""
    def cell(k: str, i: int) -> tuple[str, float]:
        v = [r[i] for r in rounds[k]]
        base = statistics.median(r[i] for r in rounds[k.split("+")[0]])
        return (f"{statistics.median(v):.1f} ({min(v):.1f}-{max(v):.1f})",
                statistics.median(v) / base)
    print(f"\n| {workload} | output tok/s, median (min-max) of {len(rounds['fp32'])} | vs "
          "dense | output tokens per CPU-second | vs dense |\n|---|---|---|---|---|")
    for k in rounds:
        (wall, wr), (cpu, cr) = cell(k, 0), cell(k, 1)
        print(f"| {k} | {wall} | {wr:.2f}x | {cpu} | {cr:.2f}x |")


def match_report(engines: dict, ids: list[list[int]], n: int) -> None:
    sp = {"max_new_tokens": n, "temperature": 0, "ignore_eos": True}
    out = {k: [o["output_ids"] for o in eng.generate(input_ids=ids, sampling_params=sp)]
           for k, eng in engines.items()}
    print(f"\ngreedy token-match ({len(ids)} prompts x {n} tokens): the tokens before each "
          "prompt's first divergence over all; teacher-forced: the share of b's greedy "
          "tokens that a also ranks first given b's sequence so far")
    for a, b in (("bf16+int8", "bf16"), ("fp32+int8", "fp32"), ("bf16", "fp32"),
                 ("bf16+int8", "fp32")):
        forced = teacher_forced(engines[a], ids, out[b])
        print(f"  {a} vs {b}: {match_rate(out[a], out[b]):.3f}, teacher-forced {forced:.3f}")


def teacher_forced(eng, ids: list[list[int]], targets: list[list[int]]) -> float:
    """Share of ``targets`` (greedy continuations of ``ids``) that ``eng`` predicts first
    at each position, given the target's own prefix (one prefill per prompt)."""
    eng.flush_cache()
    seqs = [p + t[:-1] for p, t in zip(ids, targets)]
    outs = eng.generate(input_ids=seqs, sampling_params={"max_new_tokens": 1,
                                                         "temperature": 0},
                        return_logprob=True, logprob_start_len=0, top_logprobs_num=1)
    hits = total = 0
    for p, t, o in zip(ids, targets, outs):
        top = o["meta_info"]["input_top_logprobs"]
        preds = [top[len(p) + k][0][1] for k in range(len(t) - 1)] + o["output_ids"][:1]
        hits += sum(x == y for x, y in zip(preds, t))
        total += len(t)
    return hits / total


def _cpu_us(fn, calls: int) -> float:
    t0 = time.process_time()
    for _ in range(calls):
        fn()
    return (time.process_time() - t0) / calls * 1e6


def kernel_report(rows: list[int], repeats: int) -> None:
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    print("CPU time (us, one thread) of one small-preset layer's four projections, "
          f"median of {repeats} alternating runs\n| dtype | rows | dense F.linear | "
          "oneDNN prepacked | int8 packed kernel | int8 widened | int8_linear |")
    print("|---|---|---|---|---|---|---|")
    for dtype in (torch.bfloat16, torch.float32):
        for m in rows:
            total = [0.0] * 5
            for _, n, k in SHAPES:
                w = (torch.randn(n, k, generator=g) * 0.02).to(dtype)
                q, s = quantize_per_channel(w)
                x = torch.randn(m, k, generator=g).to(dtype)
                p = torch.ops.mkldnn._reorder_linear_weight(w, None)
                fns = [lambda x=x, w=w: F.linear(x, w),
                       lambda x=x, p=p: torch.ops.mkldnn._linear_pointwise(
                           x, p, None, "none", [], ""),
                       lambda x=x, q=q, s=s: torch.ops.aten._weight_int8pack_mm(x, q, s),
                       lambda x=x, q=q, s=s: F.linear(x, q.to(x.dtype)) * s,
                       lambda x=x, q=q, s=s: int8_linear(x, q, s)]
                calls = max(2, min(50, int(4e8 / (m * n * k + 4e6))))
                times: list[list[float]] = [[] for _ in fns]
                for _ in range(repeats):
                    for i, fn in enumerate(fns):
                        times[i].append(_cpu_us(fn, calls))
                total = [t + statistics.median(v) for t, v in zip(total, times)]
            print(f"| {str(dtype)[6:]} | {m} | " + " | ".join(f"{t:.0f}" for t in total)
                  + " |", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_model_args(ap)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--input-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--match-prompts", type=int, default=16, help="0: no match report")
    ap.add_argument("--match-tokens", type=int, default=64)
    ap.add_argument("--kernels", action="store_true", help="the matmul table instead")
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 4, 8, 16, 32, 256])
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    if args.kernels:
        kernel_report(args.rows, args.repeats)
    else:
        engine_report(args, resolve_model(args.model_path, args.preset))


if __name__ == "__main__":
    main()
