"""Radix-cache eviction policies, lru against lfu (``--radix-eviction-policy``), on a KV
pool small enough that the cache must evict, side by side in one process, alternating:

- shared-prefix: 4 hot system prompts (256 tokens) asked 16-token questions, interleaved
  with one-off 320-token prompts (a scan that pushes hot prefixes out of an LRU cache);
- multi-turn: 12 conversations of 6 turns, interleaved at random; each turn resends the
  whole history plus 32 new user tokens and adds 16 output tokens.

Requests arrive in waves of ``--wave`` (one batched ``Engine.generate`` per wave, so
requests of a wave run together and compete for the pool). Greedy, EOS ignored.

    .venv/bin/python benchmarks/eviction_policy.py
    .venv/bin/python benchmarks/eviction_policy.py --pool 2048 --rounds 5 --preset small

Prints, per workload and policy: prompt-token cache hit rate (cached / prompt tokens,
exact and the same every round) and throughput (prompt + output tokens per second,
median of rounds).
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

import radixlm
from radixlm.tiny_model import add_model_args, resolve_model

Request = tuple[list[int], int]  # prompt ids, output tokens
POLICIES = ("lru", "lfu")


def shared_prefix(vocab: int, seed: int = 0) -> list[list[Request]]:
    """One list per wave; no dependencies between waves."""
    rng = random.Random(seed)

    def ids(n: int) -> list[int]:
        return [rng.randrange(10, vocab) for _ in range(n)]

    hot = [ids(256) for _ in range(4)]
    reqs = [(rng.choice(hot) + ids(16), 16) if rng.random() < 0.5 else (ids(320), 16)
            for _ in range(96)]
    return [reqs[i: i + 4] for i in range(0, len(reqs), 4)]


def multi_turn(vocab: int, seed: int = 0, conversations: int = 12, turns: int = 6
               ) -> list[tuple[int, list[int]]]:
    """``(conversation, new user tokens)`` in arrival order (a conversation's turns keep
    their order); the history is built as outputs come back."""
    rng = random.Random(seed)
    order = [c for c in range(conversations) for _ in range(turns)]
    rng.shuffle(order)
    return [(c, [rng.randrange(10, vocab) for _ in range(32)]) for c in order]


def _generate(eng: radixlm.Engine, reqs: list[Request]) -> tuple[list[dict], int]:
    sps = [{"max_new_tokens": o, "temperature": 0, "ignore_eos": True} for _, o in reqs]
    outs = eng.generate(input_ids=[p for p, _ in reqs], sampling_params=sps)
    outs = outs if isinstance(outs, list) else [outs]
    return outs, sum(len(p) + o for p, o in reqs)


def run_shared_prefix(eng: radixlm.Engine, waves: list[list[Request]]) -> int:
    """Tokens processed (prompt + output)."""
    return sum(_generate(eng, wave)[1] for wave in waves)


def run_multi_turn(eng: radixlm.Engine, arrivals: list[tuple[int, list[int]]], wave: int
                   ) -> int:
    """Tokens processed; a wave holds at most one turn of each conversation."""
    history: dict[int, list[int]] = {}
    tokens = i = 0
    while i < len(arrivals):
        batch, seen = [], set()
        while i < len(arrivals) and len(batch) < wave and arrivals[i][0] not in seen:
            conv, new = arrivals[i]
            seen.add(conv)
            batch.append((conv, history.get(conv, []) + new))
            i += 1
        outs, n = _generate(eng, [(prompt, 16) for _, prompt in batch])
        tokens += n
        for (conv, prompt), out in zip(batch, outs):
            history[conv] = prompt + out["output_ids"]
    return tokens


def measure(eng: radixlm.Engine, name: str, vocab: int, wave: int) -> tuple[float, float]:
    """(tokens/s, cache hit rate) of one pass over the workload from a flushed cache."""
    eng.flush_cache()
    before = eng.get_server_info()
    t0 = time.perf_counter()
    if name == "shared-prefix":
        tokens = run_shared_prefix(eng, shared_prefix(vocab))
    else:
        tokens = run_multi_turn(eng, multi_turn(vocab), wave)
    dt = time.perf_counter() - t0
    after = eng.get_server_info()
    cached = after["cached_tokens"] - before["cached_tokens"]
    prompt = after["prompt_tokens"] - before["prompt_tokens"]
    return tokens / dt, cached / max(prompt, 1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workload", nargs="+", default=["shared-prefix", "multi-turn"])
    ap.add_argument("--pool", type=int, default=1536, help="KV pool size in tokens")
    ap.add_argument("--wave", type=int, default=4, help="requests per batched generate")
    ap.add_argument("--rounds", type=int, default=3)
    add_model_args(ap)
    args = ap.parse_args()
    path = resolve_model(args.model_path, args.preset)
    threads = torch.get_num_threads()
    engines = {p: radixlm.Engine(model_path=path, random_seed=0, cpu_threads=threads,
                                 max_total_tokens=args.pool, radix_eviction_policy=p)
               for p in POLICIES}
    vocab = engines["lru"].model_config.vocab_size
    print(f"model {path}; KV pool {args.pool} tokens; waves of {args.wave}; {threads} torch "
          f"threads; throughput: median of {args.rounds} alternating rounds")
    print("| workload | policy | cache hit rate | throughput (tokens/s) |")
    print("|---|---|---|---|")
    for name in args.workload:
        rates: dict[str, list[float]] = {p: [] for p in POLICIES}
        hits: dict[str, set[float]] = {p: set() for p in POLICIES}
        for _ in range(args.rounds):
            for p in POLICIES:
                rate, hit = measure(engines[p], name, vocab, args.wave)
                rates[p].append(rate)
                hits[p].add(round(hit, 6))
        for p in POLICIES:
            hit = ", ".join(f"{h:.1%}" for h in sorted(hits[p]))
            print(f"| {name} | {p} | {hit} | {statistics.median(rates[p]):.0f} |")
    for eng in engines.values():
        eng.shutdown()


if __name__ == "__main__":
    main()
