"""Few-shot programs through the DSL vs the same prompts as independent requests.

64 programs share a ~1,000-token few-shot prefix. Side A runs them with
``run_batch`` on an in-process Engine with the radix cache (the traced prefix is cached
once, then every program reuses it). Side B sends the identical prompts as independent
requests to an Engine started with ``--disable-radix-cache``. Prints programs/s for both,
the ratio and the cache hit rate (recorded in ``docs/benchmarks.md``).

    python benchmarks/dsl_fewshot.py [--num-programs 64] [--max-tokens 16] [--output PATH]
"""

from __future__ import annotations

import argparse
import platform
import sys
import time
from pathlib import Path

import torch

import radixlm as sgl
from radixlm.tiny_model import add_model_args, resolve_model

EXAMPLES = [
    ("The cat sat on the mat all afternoon.", "positive"),
    ("The train was late again and the coffee was cold.", "negative"),
    ("She finally finished the marathon she trained for.", "positive"),
    ("The package arrived broken and support never replied.", "negative"),
]


def fewshot_prefix(target_tokens: int, tokenizer) -> str:
    text, i = "Classify the sentiment of each review.\n\n", 0
    while len(tokenizer.encode(text, add_special_tokens=False)) < target_tokens:
        review, label = EXAMPLES[i % len(EXAMPLES)]
        text += f"Review {i}: {review}\nSentiment: {label}\n\n"
        i += 1
    return text


def build_program(prefix: str, max_tokens: int) -> sgl.SglFunction:
    @sgl.function
    def classify(s, review):
        s += prefix
        s += "Review: " + review + "\nSentiment:" + sgl.gen("label", max_tokens=max_tokens)

    return classify


def run_dsl(prefix: str, reviews: list[str], max_tokens: int, model: str) -> tuple[float, dict]:
    engine = sgl.Engine(model_path=model, max_total_tokens=131072, random_seed=0)
    program = build_program(prefix, max_tokens)
    program.run(review="warm-up", backend=engine, temperature=0)  # compile/allocate paths
    engine.flush_cache()
    t0 = time.perf_counter()
    states = program.run_batch(
        [{"review": r} for r in reviews], backend=engine, temperature=0, ignore_eos=True
    )
    elapsed = time.perf_counter() - t0
    info = engine.get_server_info()
    cached = sum(s.get_meta_info("label")["cached_tokens"] for s in states)
    prompt = sum(s.get_meta_info("label")["prompt_tokens"] for s in states)
    engine.shutdown()
    return elapsed, {"hit_rate": info["cache_hit_rate"], "cached": cached, "prompt": prompt}


def run_independent(prefix: str, reviews: list[str], max_tokens: int, model: str) -> float:
    engine = sgl.Engine(model_path=model, max_total_tokens=131072, random_seed=0,
                        disable_radix_cache=True)
    prompts = [prefix + "Review: " + r + "\nSentiment:" for r in reviews]
    params = {"max_new_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    engine.generate(prompts[0], params)  # warm-up
    t0 = time.perf_counter()
    engine.generate(prompts, params)
    elapsed = time.perf_counter() - t0
    engine.shutdown()
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-programs", type=int, default=64)
    parser.add_argument("--prefix-tokens", type=int, default=1000)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument(
        "--output", default=None, help="also write the table (markdown) to this file"
    )
    add_model_args(parser)
    args = parser.parse_args()
    model = resolve_model(args.model_path, args.preset)
    probe = sgl.Engine(model_path=model, max_total_tokens=4096)
    prefix = fewshot_prefix(args.prefix_tokens, probe.tokenizer)
    n_prefix = len(probe.tokenizer.encode(prefix, add_special_tokens=False))
    probe.shutdown()
    reviews = [
        f"Review number {i}: the product did {'not ' * (i % 2)}work."
        for i in range(args.num_programs)
    ]
    t_dsl, stats = run_dsl(prefix, reviews, args.max_tokens, model)
    t_ind = run_independent(prefix, reviews, args.max_tokens, model)
    n = args.num_programs
    rows = [
        ("DSL run_batch, radix cache on", t_dsl, n / t_dsl, f"{stats['hit_rate']:.1%}"),
        ("independent requests, radix cache off", t_ind, n / t_ind, "0.0%"),
    ]
    table = ["| setup | wall s | programs/s | cache hit rate |", "|---|---:|---:|---:|"]
    table += [f"| {name} | {t:.2f} | {tp:.1f} | {hr} |" for name, t, tp, hr in rows]
    summary = (
        f"throughput ratio (DSL / independent): **{t_ind / t_dsl:.2f}x**; "
        f"{stats['cached']} of {stats['prompt']} prompt tokens of the batch were "
        f"served from the cache"
    )
    print("\n".join(table))
    print(summary)
    device = "cuda" if torch.cuda.is_available() else f"cpu ({platform.processor() or 'cpu'})"
    doc = (
        "# DSL few-shot benchmark\n\n"
        f"{n} few-shot programs sharing a {n_prefix}-token prefix, {args.max_tokens} output "
        "tokens each, on the built-in tiny model, device: " + device + ".\n\n"
        "Side A runs them through the DSL (`run_batch`, local Engine backend, radix cache "
        "on: the traced prefix is cached once before the batch). Side B sends the same "
        "prompts as independent requests to an Engine with `disable_radix_cache=True`.\n\n"
        + "\n".join(table)
        + "\n\n"
        + summary
        + "\n\n"
        "Command:\n\n```\n"
        + " ".join(["python", "benchmarks/dsl_fewshot.py", *sys.argv[1:]])
        + "\n```\n"
    )
    if args.output:
        Path(args.output).write_text(doc, encoding="utf-8")
        print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
