"""Where the CPU time of a workload goes, by part and by phase, on one thread: per-thread
CPU time (``time.thread_time``) around the engine's calls, so the split holds on a machine
shared with other work (wall time would count the time the thread waited for a core).

    .venv/bin/python benchmarks/cpu_time_split.py --preset small --dtype bfloat16 \\
        --workload shared-prefix unique variable

Parts: the linears (``Prepackable.matmul``: every projection, the LM head included),
attention (``RadixAttention.forward``: the KV store and ``decode_attention`` /
``extend_attention``), the fused elementwise kernels (RMSNorm, rotary, SiLU-and-mul) and the
KV store alone; phases: extend forwards (prefill chunks, mixed batches) and decode forwards;
``outside`` is the CPU time of the run outside every forward (scheduling, batch building,
sampling, output processing). ``radixlm.Engine`` with ``cpu_threads=1``, greedy, EOS
ignored, the workloads of ``benchmarks/transformers_side_by_side.py``. ``--threads N``
(N > 1) times the same parts in wall time (``time.perf_counter``) with N threads instead:
where two threads scale less than the parts' CPU time says, on an otherwise idle machine.
"""

from __future__ import annotations

import argparse
import collections
import time
from collections.abc import Callable
from typing import Any

from transformers_side_by_side import workload

import radixlm  # noqa: I001 - before torch: radixlm sets OpenMP's wait policy
from radixlm import kernels
from radixlm.runtime.distributed.layers import Prepackable
from radixlm.runtime.executor.layers.attention import RadixAttention
from radixlm.runtime.executor.model_runner import ModelRunner
from radixlm.tiny_model import add_model_args, resolve_model

CPU: collections.Counter = collections.Counter()
PHASE = ["outside"]  # the phase of the forward running now
CLOCK = [time.thread_time]  # per-thread CPU time; wall time with --threads > 1
PARTS = {"linears": (Prepackable, "matmul"), "attention": (RadixAttention, "forward"),
         "kv store": (kernels, "store_kv"), "rms_norm": (kernels, "rms_norm"),
         "rotary": (kernels, "apply_rotary"), "silu_and_mul": (kernels, "silu_and_mul")}


def _timed(part: str, fn: Callable) -> Callable:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        t0 = CLOCK[0]()
        try:
            return fn(*args, **kwargs)
        finally:
            CPU[PHASE[0], part] += CLOCK[0]() - t0
    return wrapper


def _phased(fn: Callable) -> Callable:
    def forward(self: ModelRunner, batch: Any, *args: Any, **kwargs: Any) -> Any:
        PHASE[0] = "decode" if batch.is_decode else "extend"
        try:
            return _timed("forward", fn)(self, batch, *args, **kwargs)
        finally:
            PHASE[0] = "outside"
    return forward


def run(eng: radixlm.Engine, name: str) -> None:
    reqs = workload(name, eng.model_config.vocab_size)
    sps = [{"max_new_tokens": o, "temperature": 0, "ignore_eos": True} for _, o in reqs]
    eng.flush_cache()
    CPU.clear()
    t0 = CLOCK[0]()
    eng.generate(input_ids=[p for p, _ in reqs], sampling_params=sps)
    total = CLOCK[0]() - t0
    inside = sum(v for (phase, part), v in CPU.items() if part == "forward")
    unit = "CPU" if CLOCK[0] is time.thread_time else "wall"
    print(f"{name}: {total:.2f} s {unit}, outside the forwards {total - inside:.2f} s")
    for phase in ("extend", "decode"):
        parts = ", ".join(f"{part} {CPU[phase, part]:.3f}" for part in ["forward", *PARTS])
        print(f"  {phase}: {parts}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workload", nargs="+", default=["shared-prefix", "unique", "variable"])
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--threads", type=int, default=1,
                    help="--cpu-threads; above 1 the parts are timed in wall time")
    add_model_args(ap)
    a = ap.parse_args()
    if a.threads > 1:
        CLOCK[0] = time.perf_counter
    for part, (owner, name) in PARTS.items():
        setattr(owner, name, _timed(part, getattr(owner, name)))
    ModelRunner.forward = _phased(ModelRunner.forward)
    eng = radixlm.Engine(model_path=resolve_model(a.model_path, a.preset), dtype=a.dtype,
                         random_seed=0, cpu_threads=a.threads, max_total_tokens=65536)
    eng.generate(input_ids=[[1, 2, 3]], sampling_params={"max_new_tokens": 2})  # warm up
    for name in a.workload:
        run(eng, name)
    eng.shutdown()


if __name__ == "__main__":
    main()
