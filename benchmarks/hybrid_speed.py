"""A hybrid model's speed against attention-only layers of the same size, side by side.

    .venv/bin/python benchmarks/hybrid_speed.py [--rounds 2] [--threads 2] [--long 8192]
        [--only prefill]

Two random checkpoints written once by transformers' own config classes under
``~/.cache/radixlm/hybrid-bench/``: a Qwen3.5-shaped one (hidden 1,024, 24 layers, three
Gated DeltaNet layers to one gated-attention layer; 16 attention heads of 64 with 4 KV heads;
linear layers of 8 key and 16 value heads of 64, a conv of 4 taps; intermediate 3,072;
32k vocabulary) and a Qwen3 one of the same hidden size, depth, heads and MLP, every layer
attention. Each runs in ``radixlm.Engine`` (bf16, greedy, EOS ignored, the cache flushed
before each request), one after the other, alternating round by round:

- decode tokens per second at batch 1 and at 32 (64-token prompts, 64 new tokens, minus the
  time of a 1-token request on the same prompts: the prefill);
- a ``--long``-token prompt's prefill (one output token): prompt tokens per second.

Medians of ``--rounds``; the ratio hybrid / attention-only per round, then its median.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

SHAPE = {"hidden_size": 1024, "intermediate_size": 3072, "num_hidden_layers": 24,
         "num_attention_heads": 16, "num_key_value_heads": 4, "head_dim": 64,
         "max_position_embeddings": 16384, "rms_norm_eps": 1e-6, "vocab_size": 32000,
         "bos_token_id": 0, "eos_token_id": 0, "pad_token_id": 0}
LINEAR = {"linear_num_key_heads": 8, "linear_num_value_heads": 16, "linear_key_head_dim": 64,
          "linear_value_head_dim": 64, "linear_conv_kernel_dim": 4,
          "layer_types": ["linear_attention", "linear_attention", "linear_attention",
                          "full_attention"] * 6,
          "rope_parameters": {"rope_type": "default", "rope_theta": 10000000.0,
                              "partial_rotary_factor": 0.25}}
MODELS = {"hybrid (Qwen3.5-shaped)": ("Qwen3_5TextConfig", LINEAR),
          "attention only (Qwen3)": ("Qwen3Config", {"rope_parameters": {
              "rope_type": "default", "rope_theta": 10000000.0}})}


def checkpoint(name: str, root: Path) -> Path:
    """Write (once) the random checkpoint of ``name``, bf16, with the built-in tokenizer."""
    import torch
    import transformers

    from radixlm.tiny_model import train_tokenizer, write_tokenizer

    out = root / name.split()[0]
    if (out / "config.json").exists():
        return out
    cls, special = MODELS[name]
    tok = train_tokenizer(vocab_size=SHAPE["vocab_size"])  # the small preset's 32k
    config = getattr(transformers, cls)(**{**SHAPE, "vocab_size": tok.get_vocab_size()},
                                        **special)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    tmp = out.with_name(out.name + ".tmp")
    model.save_pretrained(tmp)
    write_tokenizer(tmp, SHAPE["vocab_size"], tok)
    tmp.rename(out)
    return out


def measure(engine, long_len: int, vocab: int, only: str | None) -> dict[str, float]:
    """The three figures of one engine (see the module docstring), or those of ``only``."""
    import random

    rng = random.Random(0)

    def ids(n: int) -> list[int]:
        return [rng.randrange(100, vocab - 1) for _ in range(n)]

    def run(prompts: list[list[int]], new: int) -> float:
        engine.flush_cache()
        t0 = time.perf_counter()
        engine.generate(input_ids=prompts, sampling_params={
            "max_new_tokens": new, "temperature": 0, "ignore_eos": True})
        return time.perf_counter() - t0

    out = {}
    for batch in (1, 32) if only in (None, "decode") else ():
        prompts = [ids(64) for _ in range(batch)]
        run(prompts, 2)  # warm
        out[f"decode tok/s, batch {batch}"] = batch * 63 / (run(prompts, 64) - run(prompts, 1))
    if only == "decode":
        return out
    if only == "prefill":
        run([ids(64)], 2)  # warm, as the decode figures warm it otherwise
    long = [ids(long_len)]
    out[f"prefill tok/s, {long_len} tokens"] = long_len / run(long, 1)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--long", type=int, default=8192, help="the long prompt's tokens")
    ap.add_argument("--only", choices=["decode", "prefill"], default=None,
                    help="measure only the decode figures or only the long prefill")
    ap.add_argument("--out", type=Path, default=None, help="every figure as JSON")
    a = ap.parse_args()
    import radixlm  # noqa: I001 - before torch: radixlm sets OpenMP's wait policy
    from radixlm.tiny_model import cache_dir

    root = cache_dir() / "hybrid-bench"
    root.mkdir(parents=True, exist_ok=True)
    paths = {name: checkpoint(name, root) for name in MODELS}
    rounds: list[dict[str, dict[str, float]]] = []
    for r in range(a.rounds):
        order = list(MODELS) if r % 2 == 0 else list(MODELS)[::-1]
        figures = {}
        for name in order:
            engine = radixlm.Engine(model_path=str(paths[name]), dtype="bfloat16",
                                    cpu_threads=a.threads, max_total_tokens=a.long + 4096)
            try:
                figures[name] = measure(engine, a.long, engine.tokenizer.vocab_size, a.only)
            finally:
                engine.shutdown()
        rounds.append(figures)
        print(f"round {r + 1}: {json.dumps(figures)}", flush=True)
    hybrid, attn = list(MODELS)
    print(f"\n| metric | {hybrid} | {attn} | ratio |\n|---|---|---|---|")
    for metric in rounds[0][hybrid]:
        h = statistics.median(f[hybrid][metric] for f in rounds)
        t = statistics.median(f[attn][metric] for f in rounds)
        ratio = statistics.median(f[hybrid][metric] / f[attn][metric] for f in rounds)
        print(f"| {metric} | {h:.1f} | {t:.1f} | {ratio:.2f}x |")
    if a.out:
        a.out.write_text(json.dumps(rounds, indent=1) + "\n")


if __name__ == "__main__":
    main()
