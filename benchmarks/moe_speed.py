"""Mixture-of-experts decode speed against the dense model of the same active size, on the
CPU, through radixlm's Engine.

    python benchmarks/moe_speed.py [--inter 1024] [--experts 8] [--top-k 2]
        [--batches 1,8,32] [--dtypes float32,bfloat16] [--rounds 3] [--threads 2]

Two random checkpoints written with transformers' own config and model classes: a Mixtral
(hidden 768, 12 layers, 12 heads / 4 KV heads of 64, 32k vocabulary: the small preset's
attention) with ``--experts`` experts of ``--inter`` rows, ``--top-k`` per token, and a
dense Llama with the same attention and an MLP of ``top_k * inter`` rows: the same active
parameters per token. Per dtype both engines live in one process (``cpu_threads``
``--threads``) and run alternately, round by round, each batch size: ``B`` fresh prompts of
16 random tokens, greedy, ``ignore_eos``, once with 1 new token and once with ``--new``;
decode tok/s = ``B * (new - 1)`` over the difference of the two times (prefill cancels).
Prints the median over ``--rounds`` and MoE / dense with the per-round ratios' range.

``--step-cpu``: instead, one decode step of each model's ``ModelRunner`` (``B`` sequences of
64 cached tokens) on 1 thread, timed in the thread's CPU time (``time.thread_time``: what a
busy shared machine's preemption does not inflate), alternating, with a third variant: the
MoE with its experts' prepacked copies dropped (``moe_unpacked``: torch's matmul).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch
import transformers

import radixlm
from radixlm.runtime.config import ServerArgs
from radixlm.runtime.executor.layers.moe import FusedExperts
from radixlm.runtime.executor.model_runner import ModelRunner
from radixlm.runtime.executor.worker_batch import ModelWorkerBatch
from radixlm.tiny_model import write_tokenizer

SHAPE = {"hidden_size": 768, "num_hidden_layers": 12, "num_attention_heads": 12,
         "num_key_value_heads": 4, "head_dim": 64, "max_position_embeddings": 4096,
         "rms_norm_eps": 1e-5, "bos_token_id": 0, "eos_token_id": 0, "pad_token_id": 0,
         "tie_word_embeddings": False}
PROMPT = 16


def write_models(root: Path, inter: int, experts: int, top_k: int) -> dict[str, str]:
    """The MoE and the dense checkpoint (float32, transformers' own random init)."""
    tok = write_tokenizer(root / "tok", 32000)
    vocab = tok.get_vocab_size()
    configs = {
        "moe": transformers.MixtralConfig(**SHAPE, vocab_size=vocab, intermediate_size=inter,
                                          num_local_experts=experts,
                                          num_experts_per_tok=top_k),
        "dense": transformers.LlamaConfig(**SHAPE, vocab_size=vocab,
                                          intermediate_size=top_k * inter),
    }
    paths = {}
    for name, config in configs.items():
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        model.save_pretrained(root / name)
        write_tokenizer(root / name, 32000, tok)
        paths[name] = str(root / name)
        del model
    return paths


def decode_rate(eng: radixlm.Engine, batch: int, new: int, gen: torch.Generator) -> float:
    """Decode tok/s of ``batch`` fresh prompts: (``new`` - 1) tokens each, prefill removed."""
    def timed(max_new: int) -> float:
        ids = torch.randint(100, 30000, (batch, PROMPT), generator=gen).tolist()
        t0 = time.perf_counter()
        eng.generate(input_ids=ids, sampling_params={"max_new_tokens": max_new,
                                                     "temperature": 0, "ignore_eos": True})
        return time.perf_counter() - t0

    first, full = timed(1), timed(new)
    return batch * (new - 1) / max(full - first, 1e-9)


def run_dtype(paths: dict[str, str], dtype: str, batches: list[int], rounds: int, new: int,
              threads: int) -> dict[tuple[str, int], list[float]]:
    engines = {name: radixlm.Engine(model_path=path, dtype=dtype, cpu_threads=threads,
                                    max_total_tokens=max(batches) * (PROMPT + new) + 256)
               for name, path in paths.items()}
    rates: dict[tuple[str, int], list[float]] = {}
    gen = torch.Generator().manual_seed(0)
    try:
        for eng in engines.values():  # warm-up: oneDNN kernels, allocator
            decode_rate(eng, max(batches), 4, gen)
        for _ in range(rounds):
            for b in batches:
                for name, eng in engines.items():
                    rates.setdefault((name, b), []).append(decode_rate(eng, b, new, gen))
    finally:
        for eng in engines.values():
            eng.shutdown()
    return rates


def step_cpu_times(paths: dict[str, str], dtype: str, batches: list[int],
                   rounds: int) -> dict[tuple[str, int], list[float]]:
    """Per (variant, batch): the CPU seconds of one decode step, ``rounds`` rounds."""
    torch.set_num_threads(1)
    ctx = 64
    runners = {name: ModelRunner(ServerArgs(model_path=path, device="cpu", dtype=dtype,
                                            cpu_threads=1,
                                            max_total_tokens=max(batches) * (ctx + 1) + 64),
                                 path) for name, path in paths.items()}
    experts = [m for m in runners["moe"].model.modules() if isinstance(m, FusedExperts)]
    times: dict[tuple[str, int], list[float]] = {}
    for b in batches:
        req_to_token = torch.randperm(b * (ctx + 1)).view(b, ctx + 1)
        batch = ModelWorkerBatch(
            is_decode=True, req_pool_indices=list(range(b)), prefix_lens=[ctx] * b,
            extend_lens=[1] * b, input_ids=list(range(100, 100 + b)),
            logit_ranges=[(0, 1)] * b)
        for r in range(rounds + 1):  # round 0 warms up
            for variant, name in (("dense", "dense"), ("moe", "moe"), ("moe_unpacked", "moe")):
                for m in experts:
                    if variant == "moe_unpacked":
                        m.drop_packed()
                    elif m.packed is None:
                        m.prepack()
                with torch.inference_mode():
                    runners[name].forward(batch, req_to_token)
                    t0 = time.thread_time()
                    runners[name].forward(batch, req_to_token)
                    if r:
                        times.setdefault((variant, b), []).append(time.thread_time() - t0)
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--inter", type=int, default=1024, help="one expert's intermediate size")
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--new", type=int, default=32, help="tokens per request in the timed run")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--step-cpu", action="store_true",
                    help="one decode step's CPU time on 1 thread instead (see the doc)")
    a = ap.parse_args()
    batches = [int(b) for b in a.batches.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        paths = write_models(Path(tmp), a.inter, a.experts, a.top_k)
        what = ("decode step CPU ms, 1 thread" if a.step_cpu else
                f"decode tok/s, {a.threads} threads")
        print(f"MoE: {a.experts} experts x {a.inter}, top-{a.top_k}; dense: "
              f"{a.top_k * a.inter}; hidden 768, 12 layers; {what}; median of {a.rounds} "
              f"alternating rounds\n")
        if a.step_cpu:
            print("| dtype | batch | MoE ms | dense ms | experts unpacked ms | dense / MoE "
                  "(min..max) | dense / unpacked |")
            print("|---|---|---|---|---|---|---|")
        else:
            print("| dtype | batch | MoE tok/s | dense tok/s | MoE / dense (min..max) |")
            print("|---|---|---|---|---|")
        for dtype in a.dtypes.split(","):
            if a.step_cpu:
                print_steps(step_cpu_times(paths, dtype, batches, a.rounds), dtype, batches)
                continue
            rates = run_dtype(paths, dtype, batches, a.rounds, a.new, a.threads)
            for b in batches:
                moe, dense = rates[("moe", b)], rates[("dense", b)]
                print(f"| {dtype} | {b} | {statistics.median(moe):.1f} | "
                      f"{statistics.median(dense):.1f} | {_ratio(moe, dense)} |", flush=True)


def _ratio(num: list[float], den: list[float]) -> str:
    """Median (min..max) of the per-round ratios."""
    r = [a / b for a, b in zip(num, den, strict=True)]
    return f"{statistics.median(r):.2f} ({min(r):.2f}..{max(r):.2f})"


def print_steps(times: dict[tuple[str, int], list[float]], dtype: str,
                batches: list[int]) -> None:
    for b in batches:
        moe, dense, unpacked = (times[(v, b)] for v in ("moe", "dense", "moe_unpacked"))
        print(f"| {dtype} | {b} | {statistics.median(moe) * 1e3:.1f} | "
              f"{statistics.median(dense) * 1e3:.1f} | {statistics.median(unpacked) * 1e3:.1f} "
              f"| {_ratio(dense, moe)} | {_ratio(dense, unpacked)} |", flush=True)


if __name__ == "__main__":
    main()
