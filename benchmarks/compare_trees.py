"""Offline output tok/s of two (or more) source trees of radixlm side by side: before and
after a change, on issue 25's three workloads, in float32 and bfloat16.

    .venv/bin/python benchmarks/compare_trees.py --tree before=/tmp/old-checkout --tree after=.
        [--preset small] [--dtype float32 bfloat16] [--rounds 3] [--workload unique ...]

Make the old tree with ``git worktree add`` or ``git archive REV | tar -x -C DIR``. Each
(tree, dtype) runs in a child process with ``PYTHONPATH=tree`` (one Engine, every
workload in turn, the cache flushed between them); rounds alternate the trees, so a busy
machine slows them alike. Medians with min and max. Workloads (greedy, EOS ignored):

- unique: 32 prompts of 256 random tokens, 64 output tokens;
- shared: 4 groups x 8 prompts, a 512-token prefix per group + 32 tokens, 32 out;
- variable: 48 prompts of 16-1024 tokens with 8-256 output tokens.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time

Request = tuple[list[int], int]  # prompt ids, output tokens
WORKLOADS = ("unique", "shared", "variable")


def workload(name: str, vocab: int, seed: int = 0) -> list[Request]:
    rng = random.Random(seed)

    def ids(n: int) -> list[int]:
        return [rng.randrange(10, vocab) for _ in range(n)]

    if name == "unique":
        return [(ids(256), 64) for _ in range(32)]
    if name == "shared":
        return [(prefix + ids(32), 32) for prefix in (ids(512) for _ in range(4))
                for _ in range(8)]
    if name == "variable":
        return [(ids(rng.randint(16, 1024)), rng.randint(8, 256)) for _ in range(48)]
    raise ValueError(f"unknown workload {name!r}; one of {WORKLOADS}")


def child(model: str, dtype: str, names: list[str], threads: int) -> None:
    """One round in this process: prints {workload: output tok/s} as JSON."""
    import radixlm  # the tree on PYTHONPATH

    eng = radixlm.Engine(model_path=model, dtype=dtype, random_seed=0, cpu_threads=threads,
                         max_total_tokens=65536)
    vocab = eng.model_config.vocab_size
    eng.generate(input_ids=[p for p, _ in workload("unique", vocab, seed=9)[:2]],
                 sampling_params={"max_new_tokens": 4, "ignore_eos": True})  # warm up
    out = {}
    for name in names:
        reqs = workload(name, vocab)
        eng.flush_cache()
        sps = [{"max_new_tokens": o, "temperature": 0, "ignore_eos": True} for _, o in reqs]
        t0 = time.perf_counter()
        outs = eng.generate(input_ids=[p for p, _ in reqs], sampling_params=sps)
        dt = time.perf_counter() - t0
        assert [o["meta_info"]["completion_tokens"] for o in outs] == [o for _, o in reqs]
        out[name] = sum(o for _, o in reqs) / dt
    eng.shutdown()
    print(json.dumps(out))


def run_child(tree: str, model: str, dtype: str, names: list[str], threads: int) -> dict:
    env = {**os.environ, "PYTHONPATH": os.path.abspath(tree)}
    cmd = [sys.executable, os.path.abspath(__file__), "--child", "--model-path", model,
           "--dtype", dtype, "--threads", str(threads), "--workload", *names]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=tree)
    if proc.returncode != 0:
        raise RuntimeError(f"{tree} ({dtype}) failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tree", action="append", default=[], metavar="NAME=DIR",
                    help="a source tree to time (give two or more)")
    ap.add_argument("--dtype", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument("--workload", nargs="+", choices=WORKLOADS, default=list(WORKLOADS))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--preset", choices=["tiny", "small"], default="small")
    ap.add_argument("--model-path", default=None)
    a = ap.parse_args()
    if a.child:
        child(a.model_path, a.dtype[0], a.workload, a.threads)
        return
    from radixlm.tiny_model import resolve_model

    model = resolve_model(a.model_path, a.preset)
    trees = dict(t.split("=", 1) for t in a.tree)
    if len(trees) < 2:
        raise SystemExit("give --tree NAME=DIR at least twice")
    tps: dict[tuple[str, str, str], list[float]] = {}
    for r in range(a.rounds):
        for dtype in a.dtype:
            order = list(trees) if r % 2 == 0 else list(reversed(trees))
            for name in order:
                res = run_child(trees[name], model, dtype, a.workload, a.threads)
                for w, v in res.items():
                    tps.setdefault((dtype, w, name), []).append(v)
                print(f"round {r + 1} {dtype} {name}: "
                      + ", ".join(f"{w} {v:.0f}" for w, v in res.items()), flush=True)
    print(f"\n{model}, {a.threads} threads; output tok/s, median (min-max) of {a.rounds} "
          "alternating rounds")
    names = list(trees)
    print("| dtype | workload | " + " | ".join(names) + f" | {names[-1]} / {names[0]} |")
    print("|---|---|" + "---|" * (len(names) + 1))
    for dtype in a.dtype:
        for w in a.workload:
            cells = [tps[(dtype, w, n)] for n in names]
            text = [f"{statistics.median(c):.0f} ({min(c):.0f}-{max(c):.0f})" for c in cells]
            ratio = statistics.median(cells[-1]) / statistics.median(cells[0])
            print(f"| {dtype} | {w} | " + " | ".join(text) + f" | {ratio:.2f}x |")


if __name__ == "__main__":
    main()
