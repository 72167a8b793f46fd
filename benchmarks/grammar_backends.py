"""The grammar backends side by side: cold compile time and per-token mask time at 4k, 32k
and 128k vocabularies, then constrained / unconstrained throughput on the tiny model.

    .venv/bin/python benchmarks/grammar_backends.py                  # everything
    .venv/bin/python benchmarks/grammar_backends.py --vocab 4000 --no-e2e

Tokenizers: byte-level BPE trained here with `tokenizers` on a generated corpus (nothing is
downloaded; cached under $RADIXLM_CACHE_DIR/bench-tokenizers). Grammars: free-form JSON
(`{"type": "object"}`, OpenAI's json_object), a flat schema with 30 properties, a nested
schema, an array of objects, and an email-like regex. "Compile" is one cold
`backend.compile` and the first `new_matcher()` (a new backend, nothing cached: what the
first request with that grammar waits for); "mask" is the mean time of one
`fill_bitmask` along a seeded random walk of up to 64 tokens through the grammar. A
compile past --compile-limit seconds runs in a child process that is stopped then.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import random
import statistics
import sys
import time
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from radixlm.runtime.config import GRAMMAR_BACKENDS
from radixlm.runtime.constrained import (
    allocate_token_bitmask,
    allowed_ids,
    canonical_spec,
    create_grammar_backend,
)
from radixlm.tiny_model import synthetic_corpus

sys.path.insert(0, str(Path(__file__).parent))
from constrained_throughput import measure, print_rows  # noqa: E402

VOCABS = (4000, 32000, 128000)
GRAMMARS = {
    "json_object": ("json_schema", {"type": "object"}),
    "flat 30 properties": ("json_schema", {
        "type": "object", "required": [f"field_{i}" for i in range(30)],
        "properties": {f"field_{i}": ({"type": "string", "maxLength": 12} if i % 3 == 0 else
                                      {"type": "integer"} if i % 3 == 1 else
                                      {"type": "boolean"}) for i in range(30)}}),
    "nested": ("json_schema", {
        "type": "object", "required": ["user", "order"],
        "properties": {
            "user": {"type": "object", "required": ["id", "name", "address"], "properties": {
                "id": {"type": "integer"}, "name": {"type": "string"},
                "address": {"type": "object", "required": ["city", "zip"], "properties": {
                    "city": {"type": "string"}, "zip": {"type": "string",
                                                        "pattern": "^[0-9]{5}$"}}}}},
            "order": {"type": "object", "required": ["total", "paid"], "properties": {
                "total": {"type": "number"}, "paid": {"type": "boolean"}}}}}),
    "array of objects": ("json_schema", {
        "type": "array", "maxItems": 8, "items": {
            "type": "object", "required": ["sku", "qty", "tag"], "properties": {
                "sku": {"type": "string", "maxLength": 10}, "qty": {"type": "integer"},
                "tag": {"enum": ["new", "used", "refurbished"]}}}}),
    "email regex": ("regex", r"[a-z0-9._%+-]{1,20}@[a-z0-9-]{1,15}\.(com|org|net|io)"),
}


# --- tokenizers ----------------------------------------------------------------------------
def tokenizer(vocab: int) -> PreTrainedTokenizerFast:
    root = Path(os.environ.get("RADIXLM_CACHE_DIR", Path.home() / ".cache" / "radixlm"))
    path = root / "bench-tokenizers" / f"bpe-{vocab}.json"
    if not path.exists():
        t0 = time.perf_counter()
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<|endoftext|>"],
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                      show_progress=False)
        tok.train_from_iterator(synthetic_corpus(), trainer)
        path.parent.mkdir(parents=True, exist_ok=True)
        tok.save(str(path))
        print(f"trained a {tok.get_vocab_size()}-token BPE in {time.perf_counter() - t0:.0f} s",
              file=sys.stderr)
    return PreTrainedTokenizerFast(tokenizer_file=str(path), eos_token="<|endoftext|>")


# --- compile and mask ----------------------------------------------------------------------------
def compile_and_walk(name: str, vocab: int, grammar: str, seed: int = 0) -> tuple[float, float]:
    """(cold compile seconds, mean fill_bitmask seconds) for one backend and grammar."""
    tok = tokenizer(vocab)
    size = len(tok)
    backend = create_grammar_backend(name, tok, size)
    kind, spec = GRAMMARS[grammar]
    t0 = time.perf_counter()
    m = backend.compile(kind, canonical_spec(kind, spec)).new_matcher()  # ready for a request
    compile_s = time.perf_counter() - t0
    rng = random.Random(seed)
    bitmask = allocate_token_bitmask(1, size)
    fills = []
    for _ in range(64):
        t0 = time.perf_counter()
        m.fill_bitmask(bitmask, 0)
        fills.append(time.perf_counter() - t0)
        allowed = [t for t in allowed_ids(bitmask[0], size) if t != tok.eos_token_id]
        if not allowed or m.is_terminated():
            break
        short = [t for t in allowed if len(tok.decode([t])) <= 2] or allowed  # finish sooner
        assert m.accept_token(rng.choice(short))
    return compile_s, statistics.mean(fills)


def _child(name: str, vocab: int, grammar: str, out: multiprocessing.Queue) -> None:
    torch.set_num_threads(1)
    try:
        out.put(compile_and_walk(name, vocab, grammar))
    except ValueError as e:
        out.put(str(e))


def timed_cell(name: str, vocab: int, grammar: str, limit: float) -> str:
    ctx = multiprocessing.get_context("fork")
    out: multiprocessing.Queue = ctx.Queue()
    proc = ctx.Process(target=_child, args=(name, vocab, grammar, out))
    proc.start()
    proc.join(limit)
    if proc.is_alive():
        proc.kill()
        proc.join()
        return f"> {limit:.0f} s | -"
    result = out.get()
    if isinstance(result, str):
        return f"refused ({result[:40]}) | -"
    compile_s, fill_s = result
    return f"{compile_s * 1e3:.1f} ms | {fill_s * 1e6:.1f} us"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--vocab", type=int, nargs="+", default=list(VOCABS))
    ap.add_argument("--grammar-backend", nargs="+", default=list(GRAMMAR_BACKENDS))
    ap.add_argument("--compile-limit", type=float, default=60.0)
    ap.add_argument("--no-e2e", action="store_true")
    args = ap.parse_args()
    for vocab in args.vocab:
        tokenizer(vocab)  # train once, before anything is timed
    print("| vocabulary | grammar | " + " | ".join(
        f"{b} compile | {b} mask/token" for b in args.grammar_backend) + " |")
    print("|---|---|" + "---|---|" * len(args.grammar_backend))
    for vocab in args.vocab:
        for grammar in GRAMMARS:
            cells = [timed_cell(b, vocab, grammar, args.compile_limit)
                     for b in args.grammar_backend]
            print(f"| {len(tokenizer(vocab))} | {grammar} | " + " | ".join(cells) + " |",
                  flush=True)
    if not args.no_e2e:
        print("\nend to end on the tiny model (vocabulary 2,000), 32 requests:")
        print_rows({b: measure(b) for b in args.grammar_backend})


if __name__ == "__main__":
    main()
