"""Throughput when another process keeps a core busy: torch threads and OpenMP's wait policy.

    .venv/bin/python benchmarks/colocated_load.py            # the table
    .venv/bin/python benchmarks/colocated_load.py --one 2    # one measurement (a child)

The small preset, 16 unique prompts of 128 tokens, 16 output tokens, greedy; radixlm's
Engine and transformers `generate` in the same child process (median of 3 each), for
torch threads 2 and 1 and OMP_WAIT_POLICY=PASSIVE, with and without a busy-looping
process beside them. OpenMP threads spin at every barrier; when one of them shares its
core with another process, every parallel region waits for it.
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

import torch
from transformers import AutoModelForCausalLM

import radixlm
from radixlm.tiny_model import default_tiny_model_path

CONFIGS = [(2, None), (1, None), (2, "PASSIVE")]


def measure(threads: int) -> dict:
    torch.set_num_threads(threads)
    path = str(default_tiny_model_path(preset="small"))
    eng = radixlm.Engine(model_path=path, cpu_threads=threads, max_total_tokens=32768,
                         random_seed=0)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    rng = random.Random(0)
    reqs = [[rng.randrange(10, 32000) for _ in range(128)] for _ in range(16)]
    sp = {"max_new_tokens": 16, "temperature": 0, "ignore_eos": True}

    def run_engine() -> float:
        eng.flush_cache()
        t0 = time.perf_counter()
        eng.generate(input_ids=reqs, sampling_params=sp)
        return time.perf_counter() - t0

    def run_hf() -> float:
        ids = torch.tensor(reqs)
        t0 = time.perf_counter()
        with torch.no_grad():
            hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=16,
                        min_new_tokens=16, do_sample=False, pad_token_id=0)
        return time.perf_counter() - t0

    run_engine(), run_hf()
    e = statistics.median(run_engine() for _ in range(3))
    h = statistics.median(run_hf() for _ in range(3))
    eng.shutdown()
    return {"engine_s": e, "hf_s": h}


def child(threads: int, wait_policy: str | None) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    if wait_policy:
        env["OMP_WAIT_POLICY"] = wait_policy
    out = subprocess.run([sys.executable, __file__, "--one", str(threads)], env=env,
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--one", type=int, default=None, help="(internal) one measurement")
    args = ap.parse_args()
    if args.one is not None:
        print(json.dumps(measure(args.one)))
        return
    print("| other process | torch threads | OMP_WAIT_POLICY | radixlm (s) | transformers (s) |")
    print("|---|---|---|---|---|")
    for busy in (False, True):
        hog = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if busy else None
        try:
            for threads, policy in CONFIGS:
                r = child(threads, policy)
                print(f"| {'busy loop' if busy else 'none'} | {threads} | {policy or 'default'} "
                      f"| {r['engine_s']:.2f} | {r['hf_s']:.2f} |", flush=True)
        finally:
            if hog is not None:
                hog.kill()
                hog.wait()


if __name__ == "__main__":
    main()
