"""The engine with and without ``--disable-cpu-malloc-cache`` (runtime/executor/
forward_heap.py): output tok/s, the system CPU time and minor page faults of each
workload's ``generate``, and the process's resident memory after it, the two settings
alternating round by round, each run in a fresh process.

    .venv/bin/python benchmarks/malloc_cache.py --preset small --dtype float32
    radixlm make-tiny-model ~/q05 --arch qwen2 --preset small --hidden-size 896 \\
        --num-layers 24 --num-heads 14 --num-kv-heads 2 --head-dim 64 \\
        --intermediate-size 4864     # the Qwen2.5-0.5B shape (a 32k vocabulary)
    .venv/bin/python benchmarks/malloc_cache.py --model-path ~/q05 --workloads unique

Workloads are ``workloads.py``'s (greedy, EOS ignored, 2 threads by default), each after a
cache flush, in one Engine per run; ``--repeat N`` runs them N times in that Engine (the
resident memory after each shows whether the kept heap grows).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

from workloads import workload

from radixlm.runtime.constrained.compile_worker import rss_bytes
from radixlm.tiny_model import add_model_args, resolve_model

SETTINGS = {"cache": False, "no cache": True}  # name -> disable_cpu_malloc_cache
WORKLOADS = ("unique", "shared-prefix", "variable")


def run_one(model: str, dtype: str, threads: int, disable: bool, names: list[str],
            repeat: int) -> list[dict]:
    """One Engine, each workload ``repeat`` times: what it measured, per run."""
    import radixlm  # noqa: I001 - here: the parent process never loads the model

    eng = radixlm.Engine(model_path=model, dtype=dtype, random_seed=0, cpu_threads=threads,
                         max_total_tokens=65536, disable_cpu_malloc_cache=disable)
    eng.generate(input_ids=[[1, 2, 3]], sampling_params={"max_new_tokens": 2})  # warm up
    rows = []
    for r in range(repeat):
        for name in names:
            reqs = workload(name, eng.model_config.vocab_size)
            sps = [{"max_new_tokens": o, "temperature": 0, "ignore_eos": True}
                   for _, o in reqs]
            eng.flush_cache()
            before = resource.getrusage(resource.RUSAGE_SELF)
            t0 = time.perf_counter()
            eng.generate(input_ids=[p for p, _ in reqs], sampling_params=sps)
            seconds = time.perf_counter() - t0
            after = resource.getrusage(resource.RUSAGE_SELF)
            rows.append({"workload": name, "repeat": r,
                         "tok_s": sum(o for _, o in reqs) / seconds,
                         "sys_s": after.ru_stime - before.ru_stime,
                         "faults": after.ru_minflt - before.ru_minflt,
                         "rss_mb": rss_bytes(os.getpid()) >> 20})
    eng.shutdown()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workloads", nargs="+", choices=WORKLOADS,
                    default=["unique", "shared-prefix", "variable"])
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    add_model_args(ap)
    a = ap.parse_args()
    model = resolve_model(a.model_path, a.preset)
    if a.child is not None:  # one run, in its own process
        print(json.dumps(run_one(model, a.dtype, a.threads, SETTINGS[a.child], a.workloads,
                                 a.repeat)))
        return
    results: dict[str, list[dict]] = {s: [] for s in SETTINGS}
    for r in range(a.rounds):
        for setting in SETTINGS:
            out = subprocess.run(
                [sys.executable, str(Path(__file__).resolve()), "--child", setting,
                 "--model-path", model, "--dtype", a.dtype, "--threads", str(a.threads),
                 "--repeat", str(a.repeat), "--workloads", *a.workloads],
                check=True, capture_output=True, text=True).stdout
            rows = json.loads(out.strip().splitlines()[-1])
            results[setting] += rows
            print(f"round {r} {setting}: " + ", ".join(
                f"{x['workload']} {x['tok_s']:.1f} tok/s (sys {x['sys_s']:.2f} s, "
                f"{x['faults']} faults, {x['rss_mb']} MB)" for x in rows), flush=True)
    print(f"\n{Path(model).name}, {a.dtype}, {a.threads} threads, median (min-max) of "
          f"{a.rounds} rounds\n")
    print("| workload | tok/s: cache / no cache | ratio | sys s | minor faults | "
          "resident MB after |")
    print("|---|---|---|---|---|---|")
    for name in a.workloads:
        cells = {s: [x for x in results[s] if x["workload"] == name] for s in SETTINGS}

        def med(s: str, key: str, fmt: str = ".1f", cells: dict = cells) -> str:
            v = [x[key] for x in cells[s]]
            return f"{statistics.median(v):{fmt}} ({min(v):{fmt}}-{max(v):{fmt}})"

        ratio = (statistics.median(x["tok_s"] for x in cells["cache"])
                 / statistics.median(x["tok_s"] for x in cells["no cache"]))
        print(f"| {name} | {med('cache', 'tok_s')} / {med('no cache', 'tok_s')} | "
              f"{ratio:.2f}x | {med('cache', 'sys_s', '.2f')} / "
              f"{med('no cache', 'sys_s', '.2f')} | {med('cache', 'faults', '.0f')} / "
              f"{med('no cache', 'faults', '.0f')} | {max(x['rss_mb'] for x in cells['cache'])}"
              f" / {max(x['rss_mb'] for x in cells['no cache'])} |")


if __name__ == "__main__":
    main()
