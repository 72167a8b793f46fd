"""How often radixlm's greedy tokens in bfloat16 match transformers' in bfloat16.

    .venv/bin/python benchmarks/bf16_match.py [--preset small] [--prompts 16]
        [--prompt-len 64] [--output-len 64] [--dtype bfloat16]

Both generate greedily from the same random token ids (EOS ignored), radixlm through an
Engine (one batch: the paged kernel, prepacked bf16 linears), transformers with
``generate`` (one static batch). Two bf16 implementations round differently (where they
fuse, the order of sums, float32 or bf16 for the norm's weight product), so on a model
with random weights, whose top logits are close, sequences diverge after a while; once
one token differs, the rest continue from different text. Reports, per prompt, the tokens
that match up to the first difference, and over all positions the fraction equal. Also
radixlm's first difference against transformers in float32, bf16's distance from the
float32 model on each side; and, teacher-forced on transformers' sequences (the same
context for both), how often radixlm's greedy token equals transformers', against how
often float32 transformers' does. ``--dtype float32``: both in float32 (should match
fully).
"""

from __future__ import annotations

import argparse
import statistics

import torch
from transformers import AutoModelForCausalLM

import radixlm
from radixlm.tiny_model import add_model_args, resolve_model


def prompts(vocab: int, n: int, length: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(10, vocab, (n, length), generator=g).tolist()


def hf_generate(path: str, dtype: torch.dtype, ids: list[list[int]], out_len: int
                ) -> list[list[int]]:
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
    x = torch.tensor(ids)
    with torch.no_grad():
        out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=out_len,
                             min_new_tokens=out_len, do_sample=False, pad_token_id=0)
    return out[:, x.shape[1]:].tolist()


def engine_generate(path: str, dtype: str, ids: list[list[int]], out_len: int,
                    threads: int) -> list[list[int]]:
    eng = radixlm.Engine(model_path=path, dtype=dtype, random_seed=0, cpu_threads=threads)
    try:
        outs = eng.generate(input_ids=ids, sampling_params={
            "max_new_tokens": out_len, "temperature": 0, "ignore_eos": True})
    finally:
        eng.shutdown()
    return [o["output_ids"] for o in outs]


def engine_top1(path: str, dtype: str, seqs: list[list[int]], start: int, threads: int
                ) -> list[list[int]]:
    """radixlm's greedy choice at each position from ``start`` on, given the tokens before
    it (teacher-forced: one prefill of each whole sequence, its prompt top-1 logprobs)."""
    eng = radixlm.Engine(model_path=path, dtype=dtype, random_seed=0, cpu_threads=threads)
    try:
        outs = eng.generate(input_ids=seqs, sampling_params={"max_new_tokens": 1},
                            return_logprob=True, logprob_start_len=start, top_logprobs_num=1)
    finally:
        eng.shutdown()
    return [[top[0][1] for top in o["meta_info"]["input_top_logprobs"]] for o in outs]


def hf_top1(path: str, dtype: torch.dtype, seqs: list[list[int]], start: int
            ) -> list[list[int]]:
    """transformers' greedy choice at each position from ``start`` on (teacher-forced)."""
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
    with torch.no_grad():
        return model(torch.tensor(seqs)).logits[:, start - 1: -1].argmax(-1).tolist()


def same_fraction(a: list[list[int]], b: list[list[int]]) -> float:
    return sum(x == y for r, s in zip(a, b) for x, y in zip(r, s)) / sum(map(len, b))


def prefix_match(a: list[int], b: list[int]) -> int:
    """Tokens equal before the first difference."""
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def report(name: str, ours: list[list[int]], ref: list[list[int]]) -> None:
    firsts = [prefix_match(a, b) for a, b in zip(ours, ref)]
    total = sum(len(b) for b in ref)
    same = sum(x == y for a, b in zip(ours, ref) for x, y in zip(a, b))
    full = sum(f == len(b) for f, b in zip(firsts, ref))
    print(f"| {name} | {sum(firsts) / total:.1%} | {same / total:.1%} | {full}/{len(ref)} | "
          f"{statistics.median(firsts):.0f} | {min(firsts)} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    ap.add_argument("--threads", type=int, default=2)
    add_model_args(ap)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    path = resolve_model(a.model_path, a.preset)
    vocab = AutoModelForCausalLM.from_pretrained(path).config.vocab_size
    ids = prompts(vocab, a.prompts, a.prompt_len)
    ours = engine_generate(path, a.dtype, ids, a.output_len, a.threads)
    ref = hf_generate(path, getattr(torch, a.dtype), ids, a.output_len)
    print(f"{path}: {a.prompts} prompts x {a.prompt_len} random tokens, {a.output_len} "
          f"greedy tokens each, {a.dtype}")
    print("| radixlm against | tokens before the first difference | positions equal | "
          "prompts equal throughout | median first difference | earliest |")
    print("|---|---|---|---|---|---|")
    report(f"transformers {a.dtype}", ours, ref)
    if a.dtype != "float32":  # how far each bf16 run is from the float32 model
        ref32 = hf_generate(path, torch.float32, ids, a.output_len)
        report("transformers float32", ours, ref32)
        firsts = [prefix_match(x, y) for x, y in zip(ref, ref32)]
        print(f"(transformers {a.dtype} against transformers float32: "
              f"{sum(firsts) / sum(map(len, ref32)):.1%} of tokens before the first "
              "difference)")
    # the same context for both: each position's greedy choice after transformers' tokens
    seqs = [p + o for p, o in zip(ids, ref)]
    ours_tf = engine_top1(path, a.dtype, seqs, a.prompt_len, a.threads)
    f32 = hf_top1(path, torch.float32, seqs, a.prompt_len) if a.dtype != "float32" else None
    print(f"Teacher-forced on transformers' {a.dtype} sequences, the greedy token at each "
          f"position: radixlm {a.dtype} picks transformers' in {same_fraction(ours_tf, ref):.1%}"
          " of positions" + (f"; transformers float32 in {same_fraction(f32, ref):.1%}"
                             if f32 is not None else ""))


if __name__ == "__main__":
    main()
