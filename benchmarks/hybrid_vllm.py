"""Hybrid models against vLLM's CPU build: which families it serves, and decode speed.

    .venv/bin/python benchmarks/hybrid_vllm.py --probe
    .venv/bin/python benchmarks/hybrid_vllm.py [--rounds 2] [--threads 2]

``--probe``: for each hybrid family of ``radixlm make-tiny-model`` (Qwen3-Next MoE, Qwen3.5
dense and MoE, Nemotron-H, Granite 4 hybrid, Falcon-H1, Bamba), its tiny checkpoint with
attention heads of 64 (vLLM's CPU attention takes head sizes 32, 64, 80, ... 512; the tiny
ones are 16), float32; vLLM loads it and decodes 8 greedy tokens from one prompt, radixlm
the same. Prints per family ``served`` with both token lists, or vLLM's last error line.

Default: a Qwen3-Next MoE checkpoint of benchmark size written once under
``~/.cache/radixlm/hybrid-bench/`` by transformers' config classes (``hybrid_speed.py``'s
Qwen3.5-shaped layers: hidden 1,024, 24 layers, three Gated DeltaNet layers to one gated
attention layer of 16 heads of 64 with 4 KV heads; each MLP 32 experts of 256, 4 a token,
and a shared expert of 512; 32k vocabulary), weights drawn by ``tiny_families._redraw``
(router logits spread, so bf16 rounding seldom flips an expert or a token), bf16. Each system
runs in its own subprocess (``vllm_side/hybrid_worker.py``), alternating round by round, on
``--threads`` threads (radixlm ``cpu_threads``; vLLM ``VLLM_CPU_OMP_THREADS_BIND``, the
first cores this process may use): decode tokens per second at batch 1 and 32 (64-token
prompts, 64 new tokens, minus the time of 1 new token: the prefill), and greedy agreement
(the tokens both systems produce before the first difference, per prompt). bf16 rounding
alone moves this random 24-layer model's greedy tokens (transformers' own bf16 and float32
runs differ from the first token on the batch-1 prompt), and vLLM's CPU delta rule takes
bf16 only, so the agreement is reported, not expected; ``--probe`` holds both systems to
transformers' float32 tokens instead.
"""

from __future__ import annotations

import argparse
import json
import logging
import re
import statistics
import subprocess
import sys
from pathlib import Path

from hybrid_speed import LINEAR, SHAPE
from vllm_side.offline import WORKER_TIMEOUT_S, parse_result
from vllm_side.systems import REPO_DIR, Setup, own_tmpdir, python_and_env
from vllm_side.venv import VenvSpec, ensure_venv

logger = logging.getLogger(__name__)
PROBE_ARCHS = ("qwen3_next_moe", "qwen3_5", "qwen3_5_moe", "nemotron_h", "granitemoehybrid",
               "falcon_h1", "bamba")
MOE = {"num_experts": 32, "moe_intermediate_size": 256, "num_experts_per_tok": 4,
       "shared_expert_intermediate_size": 512, "decoder_sparse_step": 1,
       "mlp_only_layers": []}
PROBE_PROMPT = list(range(100, 108))
BATCHES, PROMPT_LEN, NEW = (1, 32), 64, 64
LOG = "hybrid-vllm.log"  # every worker's stderr, under hybrid-bench/
KV_GIB = 1  # vLLM's VLLM_CPU_KVCACHE_SPACE: 32 x 128 tokens of 6 attention layers fit


def probe_checkpoint(arch: str, root: Path) -> Path:
    """The tiny ``arch`` checkpoint with attention heads of 64 (written once)."""
    from radixlm.tiny_model import build_directory_once

    def write(tmp: Path) -> None:
        import torch
        import transformers

        from radixlm.tiny_families import _redraw
        from radixlm.tiny_hybrids import _spread_routers, hybrid_config
        from radixlm.tiny_model import VOCAB_SIZE, train_tokenizer, write_tokenizer

        tok = train_tokenizer(vocab_size=VOCAB_SIZE)
        config = hybrid_config(arch, tok.get_vocab_size())
        config.head_dim = 64
        if arch == "granitemoehybrid":  # its head_dim is hidden / heads: one head of 64
            config.num_attention_heads = config.num_key_value_heads = 1
        if hasattr(config, "linear_key_head_dim"):  # vLLM's CPU delta rule: multiples of 32
            config.linear_key_head_dim = config.linear_value_head_dim = 64
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        _redraw(model, 0)
        _spread_routers(model)
        model.save_pretrained(tmp)
        write_tokenizer(tmp, VOCAB_SIZE, tok)

    return build_directory_once(root / f"probe-{arch}-head64", write)


def bench_checkpoint(root: Path) -> Path:
    """The benchmark-size Qwen3-Next MoE checkpoint in bf16 (written once)."""
    from radixlm.tiny_model import build_directory_once

    def write(tmp: Path) -> None:
        import torch
        import transformers

        from radixlm.tiny_families import _redraw
        from radixlm.tiny_model import train_tokenizer, write_tokenizer

        tok = train_tokenizer(vocab_size=SHAPE["vocab_size"])
        config = transformers.Qwen3NextConfig(
            **{**SHAPE, "vocab_size": tok.get_vocab_size()}, **LINEAR, **MOE)
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        _redraw(model, 0)
        model.to(torch.bfloat16).save_pretrained(tmp)
        write_tokenizer(tmp, SHAPE["vocab_size"], tok)

    return build_directory_once(root / "qwen3-next-moe", write)


def run_worker(system: str, setup: Setup, spec: dict, log: Path,
               env_extra: dict[str, str] | None = None) -> tuple[dict | None, str]:
    """``hybrid_worker`` under ``system``: its result (None when it failed) and its
    output (vLLM logs to stdout, tracebacks go to stderr: both), also appended to ``log``."""
    spec = {**spec, "system": system, "threads": setup.threads, "kv_tokens": setup.kv_tokens}
    python, env = python_and_env(system, setup, KV_GIB)
    with own_tmpdir({**env, **(env_extra or {})}) as env:
        proc = subprocess.run([python, "-m", "vllm_side.hybrid_worker", json.dumps(spec)],
                              env=env, cwd=REPO_DIR, capture_output=True, text=True,
                              timeout=WORKER_TIMEOUT_S, check=False)
    output = proc.stdout + proc.stderr
    with open(log, "a") as f:
        f.write(f"=== {system} {spec['model']}\n{output}\n")
    if proc.returncode != 0:
        return None, output
    return parse_result(proc.stdout), output


ERROR_LINE = re.compile(r"\b([\w.]*(?:Error|Exception)): (.*)$")
# wrappers around the cause: vLLM's dead engine, its config check, its subprocess relay
WRAPPERS = ("EngineDeadError", "ValidationError", "Engine core initialization failed",
            "Error raised in subprocess")


def root_error(output: str) -> str:
    """The last error line of ``output`` that is not a wrapper around another."""
    errors = [m.group(0) for ln in output.splitlines() if (m := ERROR_LINE.search(ln))]
    causes = [e for e in errors if not any(w in e for w in WRAPPERS)]
    return (causes or errors or ["(no error line)"])[-1]


def reference_tokens(path: Path, prompt: list[int], new: int, threads: int) -> list[int]:
    """transformers' greedy ``new`` tokens in float32: the oracle both systems are held to."""
    import torch
    import transformers

    torch.set_num_threads(threads)
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    out = model.generate(torch.tensor([prompt]), max_new_tokens=new, do_sample=False)
    return out[0, len(prompt):].tolist()


def probe(setup: Setup, root: Path) -> None:
    print("| family | vLLM's CPU build (bf16) | tokens equal to transformers' float32: vLLM, "
          "radixlm (of 8) |\n|---|---|---|")
    for arch in PROBE_ARCHS:
        path = probe_checkpoint(arch, root)
        spec = {"model": str(path), "dtype": "bfloat16", "mode": "probe", "new": 8,
                "prompt": PROBE_PROMPT, "max_len": 256}
        # vLLM's engine in this process: a failure's traceback reaches stderr (from its
        # engine-core process only "EngineCore encountered an issue" does)
        got, err = run_worker("vllm", setup, spec, root / LOG,
                              {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"})
        if got is None:
            print(f"| {arch} | not served: `{root_error(err)}` | |", flush=True)
            continue
        ours, err = run_worker("radixlm", setup, spec, root / LOG)
        ref = reference_tokens(path, PROBE_PROMPT, 8, setup.threads)
        mine = common_prefix(ours["output_ids"], ref) if ours else f"failed: {root_error(err)}"
        print(f"| {arch} | served | {common_prefix(got['output_ids'], ref)}, {mine} |",
              flush=True)


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def speed(setup: Setup, root: Path, rounds: int) -> None:
    path = bench_checkpoint(root)
    spec = {"model": str(path), "dtype": "bfloat16", "mode": "bench", "batches": BATCHES,
            "prompt_len": PROMPT_LEN, "new": NEW, "seed": 0, "vocab": SHAPE["vocab_size"],
            "max_len": PROMPT_LEN + NEW + 8}
    systems = ["radixlm", "vllm"]
    runs: list[dict[str, dict]] = []
    for r in range(rounds):
        figures = {}
        for system in systems if r % 2 == 0 else systems[::-1]:
            got, err = run_worker(system, setup, spec, root / LOG)
            if got is None:
                sys.exit(f"{system} failed: {root_error(err)}\n{err[-3000:]}")
            figures[system] = got
        runs.append(figures)
        print(f"round {r + 1}: " + json.dumps({s: {b: {k: round(v, 3) for k, v in f[b].items()
                                                     if k != "output_ids"} for b in map(
            str, BATCHES)} for s, f in figures.items()}), flush=True)

    def tok_s(f: dict, b: int) -> float:
        return b * (NEW - 1) / (f[str(b)]["seconds"] - f[str(b)]["prefill_seconds"])

    print("\n| decode tok/s | radixlm | vLLM CPU | radixlm / vLLM |\n|---|---|---|---|")
    for b in BATCHES:
        ours = statistics.median(tok_s(f["radixlm"], b) for f in runs)
        theirs = statistics.median(tok_s(f["vllm"], b) for f in runs)
        ratio = statistics.median(tok_s(f["radixlm"], b) / tok_s(f["vllm"], b) for f in runs)
        print(f"| batch {b} | {ours:.1f} | {theirs:.1f} | {ratio:.2f}x |")
    last = runs[-1]
    for b in BATCHES:
        pairs = zip(last["radixlm"][str(b)]["output_ids"], last["vllm"][str(b)]["output_ids"],
                    strict=True)
        same = [common_prefix(a, v) for a, v in pairs]
        print(f"batch {b}: greedy tokens equal before the first difference {same} "
              f"(of {NEW}; {sum(n == NEW for n in same)} of {len(same)} prompts all equal)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--probe", action="store_true", help="which families vLLM serves")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--venv", type=Path, default=None,
                    help="vLLM's venv (default ~/.cache/radixlm/vllm-venv)")
    a = ap.parse_args()
    from radixlm.tiny_model import cache_dir

    python = ensure_venv(VenvSpec(a.venv or cache_dir() / "vllm-venv"))
    setup = Setup(threads=a.threads, kv_tokens=(PROMPT_LEN + NEW + 8) * max(BATCHES) + 1024,
                  vllm_python=str(python))
    root = cache_dir() / "hybrid-bench"
    probe(setup, root) if a.probe else speed(setup, root, a.rounds)


if __name__ == "__main__":
    main()
