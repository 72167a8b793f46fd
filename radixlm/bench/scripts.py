"""``radixlm bench NAME [ARGS]``: the user-facing scripts of ``benchmarks/`` under one command.

Each name runs its script in a child process with this interpreter and the arguments as
given (``radixlm bench vllm --help`` prints the script's own help). The scripts live in a
source checkout, beside the package, not in an installed wheel. The kernel
microbenchmarks, ``compare_trees.py`` and the GPU checks stay scripts for contributors
(docs/benchmarks.md, "Which script measures what").
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parents[2] / "benchmarks"

# name -> (script in benchmarks/, one line for --help)
SCRIPTS: dict[str, tuple[str, str]] = {
    "offline": ("offline_throughput.py", "Engine against transformers generate, shared prefixes"),
    "transformers": ("transformers_side_by_side.py",
                     "Engine against transformers on three workloads (--preset small)"),
    "vllm": ("vllm_side_by_side.py", "against vLLM's CPU build, offline and served"),
    "llamacpp": ("llamacpp_side_by_side.py",
                 "against llama.cpp (llama-cpp-python) on the same GGUF files"),
    "quant-formats": ("quantized_formats.py", "every quantized format: file size, resident "
                      "memory, 1-stream / prompt / 8-stream speed against bf16"),
    "serving": ("serving.py", "radixlm serve against the offline Engine"),
    "grammar": ("grammar_backends.py", "each grammar backend's compile and mask times"),
    "constrained": ("constrained_throughput.py",
                    "JSON-schema decoding per backend, jump-forward on and off"),
    "dsl": ("dsl_fewshot.py", "the DSL's run_batch over a shared prefix"),
    "eviction": ("eviction_policy.py", "--radix-eviction-policy lru against lfu"),
    "hicache": ("hicache.py", "time to first token with the file storage tier"),
    "dp-routing": ("dp_routing.py", "--dp-size dispatch policies against sglang-router"),
    "dp-engine": ("dp_engine.py", "Engine(dp_size=N) against one process"),
    "moe": ("moe_speed.py", "a Mixtral against the dense model of the same active size"),
    "int8": ("quantization.py", "weight-only int8: matmuls, engine, token match"),
    "pd": ("pd_disaggregation.py", "prefill/decode disaggregation against one server"),
    "tp": ("tp_scaling.py", "tensor parallelism: weights per rank, the collectives' cost"),
    "swa-memory": ("swa_pool.py", "KV memory of a long context with and without the SWA pool"),
    "threads": ("shared_machine.py", "the thread defaults with and without a busy core"),
    "hostile": ("hostile_load.py", "an abort storm and 1,000 concurrent streams"),
    "cpu-time": ("cpu_time_split.py", "where a workload's CPU time goes, by part"),
}


def run(name: str, argv: list[str]) -> int:
    """Run ``benchmarks/<SCRIPTS[name]>`` with ``argv``; its exit status."""
    script = BENCH_DIR / SCRIPTS[name][0]
    if not script.is_file():
        print(f"radixlm bench {name} runs {script.name} from benchmarks/ of a source checkout "
              f"(git clone, then make install); not found at {script}", file=sys.stderr)
        return 2
    return subprocess.call([sys.executable, str(script), *argv])
