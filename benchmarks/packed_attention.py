"""The CPU kernel's packed float32 path against its FMA path (``csrc/packed_attention.cpp``;
``RADIXLM_CPU_PACKED=0`` turns it off, read once per process), float32 q and pool.

    python benchmarks/packed_attention.py [--threads 2] [--rounds 2]

Each case: 32 segments of n query rows over k scattered keys (heads of 64, 6 query heads per
KV head, 2 KV heads: rows per head = 6 n), causal (extend chunks: the rows are the last n
keys) or not (a decode step's shared-prefix groups: n members over the prefix), then two
whole forwards' shapes: 4 prompts of 512 tokens, and 32 chunks of 32 new tokens over 512
cached ones. Each system runs in a subprocess of its own, alternating, ``--rounds`` times;
cells are the fastest of each's medians (ms) and packed / FMA.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import subprocess
import sys
import time

HKV, GROUP, D = 2, 6, 64


def _cases() -> list[tuple[str, list[tuple[int, int]], bool]]:
    cases = [(f"{'causal' if causal else 'group '} {6 * n:>2} rows/head x {keys:>3} keys",
              [(n, keys)] * 32, causal)
             for causal in (True, False) for n in (1, 2, 4, 8) for keys in (32, 64, 128, 512)]
    return cases + [("4 prompts of 512 tokens", [(512, 512)] * 4, True),
                    ("32 x 32 new over 512 cached", [(32, 544)] * 32, True)]


def _child(threads: int) -> None:
    import torch

    from radixlm.kernels import cpu_paged

    assert cpu_paged.available()
    torch.set_num_threads(threads)
    g = torch.Generator().manual_seed(0)
    pool = 80_000
    k = torch.randn(pool, HKV, D, generator=g)
    v = torch.randn(pool, HKV, D, generator=g)
    out = {"packed": cpu_paged.packed()}
    for name, segs, causal in _cases():
        rows = sum(n for n, _ in segs)
        q = torch.randn(rows, HKV * GROUP, D, generator=g)
        slots = torch.randperm(pool, generator=g)[: sum(keys for _, keys in segs)]
        qi = torch.tensor([0] + [n for n, _ in segs]).cumsum(0)
        ki = torch.tensor([0] + [keys for _, keys in segs]).cumsum(0)
        call = functools.partial(cpu_paged.paged_attention, q, k, v, torch.arange(rows), qi,
                                 ki, slots, 0.125, causal)
        for _ in range(3):
            call()
        times = []
        for _ in range(max(5, int(0.3 / max(_once(call), 1e-6)))):
            times.append(_once(call))
        out[name] = statistics.median(times) * 1e3
    print(json.dumps(out))


def _once(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        return _child(a.threads)
    runs: dict[str, list[dict]] = {"packed": [], "fma": []}
    for _ in range(a.rounds):
        for system, flag in (("fma", "0"), ("packed", "1")):
            proc = subprocess.run([sys.executable, __file__, "--child", "--threads",
                                   str(a.threads)], env=dict(os.environ, RADIXLM_CPU_PACKED=flag),
                                  capture_output=True, text=True, check=True)
            runs[system].append(json.loads(proc.stdout))
    if not all(r["packed"] for r in runs["packed"]):
        sys.exit("this build has no packed path (no AVX-512)")
    print(f"{'case':44s} {'FMA ms':>9s} {'packed ms':>10s} {'packed/FMA':>11s}")
    for name, _, _ in _cases():
        fma = min(r[name] for r in runs["fma"])
        packed = min(r[name] for r in runs["packed"])
        print(f"{name:44s} {fma:9.3f} {packed:10.3f} {packed / fma:10.2f}x")


if __name__ == "__main__":
    main()
