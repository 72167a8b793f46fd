"""Offline batch throughput of ``Engine(dp_size=N)`` against ``Engine(dp_size=1)``.

One batched ``Engine.generate`` of ``--prompts`` distinct random prompts of
``--input-len`` token ids each, ``--output-len`` greedy tokens each (EOS ignored), on every
engine in turn: all engines are built first and stay up, and the rounds alternate
between them (each round starts from an empty cache), so machine load hits them alike.
Each engine is ``DP:THREADS`` in ``--configs``: dp_size and its torch threads in all
(dp_size 1 runs them in this process, dp_size N gives each replica process THREADS / N);
the default compares one replica on all cores, one replica on one thread, and one replica
per core. Reported per engine: output tokens per second (median, min, max over the rounds)
and the ratio of the medians to the first engine; the load average before and after,
since a shared machine moves the figures.

    .venv/bin/python benchmarks/dp_engine.py --preset tiny
    .venv/bin/python benchmarks/dp_engine.py --preset small --rounds 3 --configs 1:2 2:2
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import time

import radixlm
from radixlm.tiny_model import add_model_args, resolve_model


def prompts_of(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(10, vocab) for _ in range(length)] for _ in range(n)]


def one_round(eng: radixlm.Engine, prompts: list[list[int]], out_len: int) -> float:
    """Output tokens per second of one batch, from an empty cache."""
    eng.flush_cache()
    sp = {"max_new_tokens": out_len, "temperature": 0, "ignore_eos": True}
    t0 = time.perf_counter()
    outs = eng.generate(input_ids=prompts, sampling_params=sp)
    wall = time.perf_counter() - t0
    assert all(len(o["output_ids"]) == out_len for o in outs)
    return len(prompts) * out_len / wall


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_args(p)
    p.add_argument("--prompts", type=int, default=64)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3)
    cores = len(os.sched_getaffinity(0))
    p.add_argument("--configs", nargs="+", default=[f"1:{cores}", "1:1", f"{cores}:{cores}"],
                   help="DP:THREADS per engine (dp_size, torch threads shared by its replicas)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    model = resolve_model(args.model_path, args.preset)
    pool = (args.input_len + args.output_len) * args.prompts + 1024
    configs = [tuple(int(x) for x in c.split(":")) for c in args.configs]
    engines = {(dp, threads): radixlm.Engine(model, dp_size=dp, cpu_threads=threads,
                                             max_total_tokens=pool, log_level="warning")
               for dp, threads in configs}
    try:
        vocab = next(iter(engines.values())).model_config.vocab_size
        prompts = prompts_of(args.prompts, args.input_len, vocab, args.seed)
        for eng in engines.values():  # first-step costs out of the measurement
            eng.generate(input_ids=prompts[:4], sampling_params={"max_new_tokens": 2})
        load0 = os.getloadavg()[0]
        rates: dict[tuple[int, int], list[float]] = {c: [] for c in engines}
        for _ in range(args.rounds):
            for c, eng in engines.items():
                rates[c].append(one_round(eng, prompts, args.output_len))
        load1 = os.getloadavg()[0]
    finally:
        for eng in engines.values():
            eng.shutdown()
    base = statistics.median(rates[configs[0]])
    print(f"{args.prompts} prompts x {args.input_len} tokens in, {args.output_len} out; "
          f"{args.rounds} rounds; load average {load0:.1f} before, {load1:.1f} after\n")
    print(f"| dp_size | torch threads | output tok/s (median) | min | max "
          f"| vs {args.configs[0]} |")
    print("|---|---|---|---|---|---|")
    for (dp, threads), r in rates.items():
        med = statistics.median(r)
        print(f"| {dp} | {threads} | {med:.1f} | {min(r):.1f} | {max(r):.1f} "
              f"| {med / base:.2f}x |")


if __name__ == "__main__":
    main()
