"""Offline throughput when another process keeps a core busy: old thread defaults vs new.

    .venv/bin/python benchmarks/shared_machine.py --preset small            # the table
    .venv/bin/python benchmarks/shared_machine.py --preset small --dtype bfloat16 float32 \\
        --rounds 3 --variants old new passive spin10k one

The unique workload (32 prompts x 256 random tokens in, 64 out, greedy, EOS ignored)
through ``radixlm.Engine``, each measurement in a fresh child process (OpenMP reads its
wait policy once, when torch loads it), idle and with a busy-looping process beside it
(``python -c 'while True: pass'``, pinned to one CPU with ``--pin-hog CPU``). Variants:

- ``old``: what radixlm did before ``runtime/cpu_threads.py``: torch's default thread count
  (one per core) and libgomp's default wait (spin 300,000 times at every barrier);
- ``new``: radixlm's defaults, nothing set (threads from the free cores, short spin);
- ``passive``: one thread per core, ``OMP_WAIT_POLICY=PASSIVE``;
- ``spin10k`` / ``spin1k``: one thread per core, ``GOMP_SPINCOUNT=10000`` / ``1000`` (the
  new default wait with the old thread count);
- ``one``: one thread, libgomp's default wait.

Rows alternate variants within each round; the table has median (min-max) output tok/s.
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

WAIT_ENV = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "OMP_NUM_THREADS")
LIBGOMP_DEFAULT_SPIN = "300000"  # libgomp's spin count when OMP_WAIT_POLICY is unset


def variant_setup(name: str, cores: int) -> tuple[int | None, dict[str, str]]:
    """(cpu_threads for the Engine or None = radixlm's default, extra environment)."""
    table: dict[str, tuple[int | None, dict[str, str]]] = {
        "old": (cores, {"GOMP_SPINCOUNT": LIBGOMP_DEFAULT_SPIN}),
        "new": (None, {}),
        "passive": (cores, {"OMP_WAIT_POLICY": "PASSIVE"}),
        "spin10k": (cores, {"GOMP_SPINCOUNT": "10000"}),
        "spin1k": (cores, {"GOMP_SPINCOUNT": "1000"}),
        "one": (1, {"GOMP_SPINCOUNT": LIBGOMP_DEFAULT_SPIN}),
    }
    if name not in table:
        raise SystemExit(f"--variants: unknown {name!r}; choose from {sorted(table)}")
    return table[name]


def measure(spec: dict) -> dict:
    """One child: start an Engine, warm it, time the workload ``spec['repeats']`` times."""
    import radixlm  # before torch: radixlm sets OpenMP's defaults while it still can

    eng = radixlm.Engine(model_path=spec["path"], dtype=spec["dtype"], random_seed=0,
                         cpu_threads=spec["threads"], max_total_tokens=32768)
    rng = random.Random(0)
    vocab = eng.model_config.vocab_size
    prompts = [[rng.randrange(10, vocab) for _ in range(spec["input_len"])]
               for _ in range(spec["prompts"])]
    sp = {"max_new_tokens": spec["output_len"], "temperature": 0, "ignore_eos": True}
    eng.generate(input_ids=prompts[:2], sampling_params={**sp, "max_new_tokens": 4})
    rates = []
    for _ in range(spec["repeats"]):
        eng.flush_cache()
        t0 = time.perf_counter()
        eng.generate(input_ids=prompts, sampling_params=sp)
        rates.append(spec["prompts"] * spec["output_len"] / (time.perf_counter() - t0))
    info = eng.get_server_info()
    eng.shutdown()
    return {"tok_s": rates, "threads": info.get("torch_threads"),
            "wait": info.get("omp_wait_policy")}


def child(spec: dict, env_extra: dict[str, str]) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in WAIT_ENV}
    env.update(env_extra)
    out = subprocess.run([sys.executable, __file__, "--one", json.dumps(spec)], env=env,
                         capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"child failed ({out.returncode}):\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def start_hog(pin: int | None) -> subprocess.Popen:
    def pin_it() -> None:
        if pin is not None:
            os.sched_setaffinity(0, {pin})
    return subprocess.Popen([sys.executable, "-c", "while True: pass"], preexec_fn=pin_it)


def fmt(xs: list[float]) -> str:
    return f"{statistics.median(xs):.1f} ({min(xs):.1f}-{max(xs):.1f})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="small")
    ap.add_argument("--model-path", default=None)
    ap.add_argument("--dtype", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument("--variants", nargs="+", default=["old", "new"])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=1, help="timed runs per child")
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--input-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--pin-hog", type=int, default=None, help="CPU the busy loop runs on")
    ap.add_argument("--load", nargs="+", choices=["none", "busy"], default=["none", "busy"],
                    help="rows without and with the busy-looping process")
    ap.add_argument("--one", default=None, help="(internal) one measurement, JSON spec")
    a = ap.parse_args()
    if a.one is not None:
        print(json.dumps(measure(json.loads(a.one))))
        return
    from radixlm.tiny_model import resolve_model

    path = resolve_model(a.model_path, None if a.model_path else a.preset)
    cores = len(os.sched_getaffinity(0))
    loads = ["busy loop" if x == "busy" else "none" for x in a.load]
    results: dict[tuple, list[float]] = {}
    seen: dict[tuple, str] = {}
    for r in range(a.rounds):
        for load in loads:
            hog = start_hog(a.pin_hog) if load != "none" else None
            try:
                for dtype in a.dtype:
                    order = a.variants if r % 2 == 0 else a.variants[::-1]
                    for v in order:
                        threads, env = variant_setup(v, cores)
                        spec = {"path": path, "dtype": dtype, "threads": threads,
                                "prompts": a.prompts, "input_len": a.input_len,
                                "output_len": a.output_len, "repeats": a.repeats}
                        out = child(spec, env)
                        results.setdefault((load, dtype, v), []).extend(out["tok_s"])
                        seen[(load, dtype, v)] = f"{out['threads']}, {out['wait']}"
                        print(f"round {r}: {load}, {dtype}, {v}: "
                              f"{[round(x, 1) for x in out['tok_s']]} tok/s "
                              f"(threads, wait: {seen[(load, dtype, v)]})",
                              file=sys.stderr, flush=True)
            finally:
                if hog is not None:
                    hog.kill()
                    hog.wait()
    print(f"\n{a.prompts} prompts x {a.input_len} in, {a.output_len} out; {cores} CPUs; "
          f"median (min-max) output tok/s of {a.rounds} rounds x {a.repeats}")
    print("| other process | dtype | variant | threads, wait policy | output tok/s |")
    print("|---|---|---|---|---|")
    for (load, dtype, v), xs in results.items():
        print(f"| {load} | {dtype} | {v} | {seen[(load, dtype, v)]} | {fmt(xs)} |")


if __name__ == "__main__":
    main()
