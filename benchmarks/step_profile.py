"""Where a step's time goes outside the linears: the engine's wall time split into the model
forward, sampling and the rest (scheduling, batch building, bookkeeping), and torch's top
operators by self CPU time.

    .venv/bin/python benchmarks/step_profile.py --preset small --workload unique variable
    .venv/bin/python benchmarks/step_profile.py --preset small --profile --top 20

Workloads are ``benchmarks/workloads.py``'s (unique: 32 x 256 in, 64 out; variable: 48
prompts, 16-512 in, 8-128 out), greedy, EOS ignored, through ``radixlm.Engine`` in float32
(``--dtype``). The split wraps ``ModelRunner.forward`` and ``build_forward_batch`` in it, the
output processor's ``process`` and ``sample`` inside it with timers (CPU work is
synchronous); ``--profile`` runs one round under
``torch.profiler`` instead and prints the top operators.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from workloads import Request, workload

import radixlm  # noqa: I001 - before torch: radixlm sets OpenMP's wait policy
from radixlm.runtime.executor.model_runner import ModelRunner
from radixlm.runtime.managers.scheduler import output_processor
from radixlm.runtime.managers.scheduler.output_processor import OutputProcessor
from radixlm.tiny_model import add_model_args, resolve_model

TIMERS = {"forward": 0.0, "batch": 0.0, "outputs": 0.0, "sample": 0.0}


def timed(name: str, fn: Callable) -> Callable:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            TIMERS[name] += time.perf_counter() - t0
    return wrapper


def run(eng: radixlm.Engine, reqs: list[Request]) -> float:
    eng.flush_cache()
    sps = [{"max_new_tokens": o, "temperature": 0, "ignore_eos": True} for _, o in reqs]
    for k in TIMERS:
        TIMERS[k] = 0.0
    t0 = time.perf_counter()
    eng.generate(input_ids=[p for p, _ in reqs], sampling_params=sps)
    return time.perf_counter() - t0


def split(eng: radixlm.Engine, reqs: list[Request], rounds: int) -> None:
    out_tokens = sum(o for _, o in reqs)
    rows = []
    for _ in range(rounds):
        wall = run(eng, reqs)
        rows.append((wall, TIMERS["forward"], TIMERS["sample"], TIMERS["outputs"],
                     TIMERS["batch"]))
    wall, fwd, smp, outs, fb = (statistics.median(r[i] for r in rows) for i in range(5))
    print(f"  wall {wall:.2f} s ({out_tokens / wall:.1f} output tok/s, min-max "
          f"{out_tokens / max(r[0] for r in rows):.1f}-{out_tokens / min(r[0] for r in rows):.1f})"
          f"; model forward {100 * (fwd - fb) / wall:.1f}%, forward batch building "
          f"{100 * fb / wall:.1f}%, sampling {100 * smp / wall:.1f}%, "
          f"the rest of output processing {100 * (outs - smp) / wall:.1f}%, the rest "
          f"(scheduling, batch building, tokenizing) {100 * (wall - fwd - outs) / wall:.1f}%")


def profile(eng: radixlm.Engine, reqs: list[Request], top: int) -> None:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        wall = run(eng, reqs)
    events = prof.key_averages()
    total = sum(e.self_cpu_time_total for e in events)
    print(f"  one round under the profiler: {wall:.2f} s; top {top} operators by self CPU "
          f"time (% of all operators' self time)")
    for e in sorted(events, key=lambda e: -e.self_cpu_time_total)[:top]:
        print(f"  {100 * e.self_cpu_time_total / total:5.1f}%  {e.count:7d} calls  {e.key}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workload", nargs="+", default=["unique", "variable"])
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None, help="--cpu-threads (default: auto)")
    ap.add_argument("--profile", action="store_true", help="top operators instead of the split")
    ap.add_argument("--top", type=int, default=15)
    ap.add_argument("--requests", type=int, default=None, help="the workload's first N only")
    add_model_args(ap)
    a = ap.parse_args()
    path = resolve_model(a.model_path, a.preset)
    ModelRunner.forward = timed("forward", ModelRunner.forward)
    ModelRunner.build_forward_batch = timed("batch", ModelRunner.build_forward_batch)
    OutputProcessor.process = timed("outputs", OutputProcessor.process)
    output_processor.sample = timed("sample", output_processor.sample)
    eng = radixlm.Engine(model_path=path, dtype=a.dtype, random_seed=0, cpu_threads=a.threads,
                         max_total_tokens=65536)
    run(eng, workload("unique", eng.model_config.vocab_size, seed=9)[:2])
    print(f"model {path}, {a.dtype}, torch threads {torch.get_num_threads()}")
    for name in a.workload:
        print(f"{name}:")
        reqs = workload(name, eng.model_config.vocab_size)[: a.requests]
        (profile(eng, reqs, a.top) if a.profile else split(eng, reqs, a.rounds))
    eng.shutdown()


if __name__ == "__main__":
    main()
