"""Hierarchical caching (``--enable-hierarchical-cache``, file backend): time to first
token of a prompt whose prefix left the KV pool, computed again vs loaded from storage.

- revisit: a document of ``--lengths`` tokens (plus a 32-token question) is read, then three
  other documents of the same length push it out of a pool of ``max(4096, 2 x length)``
  tokens, then it is asked again (a new question): without the tier it is computed from
  scratch, with it its pages come back from ``--hicache-storage-dir``.
- restart: a fresh Engine's first request for a document an earlier Engine (same
  directory) served, with and without the tier.

Time to first token is the wall time of a one-token request on an otherwise idle Engine
(the prefill). The tier runs ``write_through`` with ``--prefetch-policy`` (default: the
server's, ``auto``); the
storage directory is a fresh temporary one per run (in the page cache: what a local SSD
with warm pages gives; a cold disk reads slower).

    .venv/bin/python benchmarks/hicache.py --preset small
    .venv/bin/python benchmarks/hicache.py --preset small --lengths 1536 4000 16000 \
        --context-length 16384 --rounds 3
"""

from __future__ import annotations

import argparse
import random
import shutil
import statistics
import tempfile
import time
from typing import Any

import radixlm
from radixlm.runtime.model_config import ModelConfig
from radixlm.tiny_model import add_model_args, resolve_model

QUESTION = 32


def _ids(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(10, vocab) for _ in range(n)]


def _ttft(eng: radixlm.Engine, ids: list[int]) -> tuple[float, dict[str, Any]]:
    t0 = time.perf_counter()
    out = eng.generate(input_ids=ids, sampling_params={"max_new_tokens": 1, "temperature": 0})
    return time.perf_counter() - t0, out["meta_info"]


def _engine(model: str, pool: int, tier_dir: str | None, args: argparse.Namespace
            ) -> radixlm.Engine:
    kw: dict[str, Any] = {"model_path": model, "max_total_tokens": pool, "dtype": args.dtype,
                          "random_seed": 0, "chunked_prefill_size": args.chunk,
                          "context_length": args.context_length}
    if tier_dir is not None:
        kw.update(enable_hierarchical_cache=True, hicache_storage_backend="file",
                  hicache_storage_dir=tier_dir)
        if args.prefetch_policy:
            kw["hicache_storage_prefetch_policy"] = args.prefetch_policy
    return radixlm.Engine(**kw)


def revisit(model: str, length: int, tier: bool, args: argparse.Namespace, vocab: int
            ) -> tuple[float, dict[str, Any]]:
    """TTFT of the revisit, and its meta_info."""
    rng = random.Random(length)
    docs = [_ids(rng, length, vocab) for _ in range(4)]
    tier_dir = tempfile.mkdtemp(prefix="hicache-bench-") if tier else None
    eng = _engine(model, max(4096, 2 * length), tier_dir, args)
    try:
        for doc in docs:
            _ttft(eng, doc + _ids(rng, QUESTION, vocab))
        if tier:
            eng.scheduler.cache.hicache.tier.flush()  # as an idle server would have
        return _ttft(eng, docs[0] + _ids(rng, QUESTION, vocab))
    finally:
        eng.shutdown()
        if tier_dir:
            shutil.rmtree(tier_dir, ignore_errors=True)


def restart(model: str, length: int, tier: bool, args: argparse.Namespace, vocab: int
            ) -> tuple[float, dict[str, Any]]:
    """TTFT of a fresh Engine's first request for a document an earlier Engine served."""
    rng = random.Random(length + 1)
    doc = _ids(rng, length, vocab)
    tier_dir = tempfile.mkdtemp(prefix="hicache-bench-") if tier else None
    pool = max(4096, 2 * length)
    try:
        first = _engine(model, pool, tier_dir, args)
        _ttft(first, doc + _ids(rng, QUESTION, vocab))
        first.shutdown()  # writes what is queued
        again = _engine(model, pool, tier_dir, args)
        try:
            return _ttft(again, doc + _ids(rng, QUESTION, vocab))
        finally:
            again.shutdown()
    finally:
        if tier_dir:
            shutil.rmtree(tier_dir, ignore_errors=True)


def _row(name: str, length: int, runs: dict[bool, list[tuple[float, dict]]]) -> str:
    off = statistics.median(t for t, _ in runs[False])
    on = statistics.median(t for t, _ in runs[True])
    meta = runs[True][-1][1]
    details = meta.get("cached_tokens_details", {})
    return (f"{name:8s} {length:6d}  {off * 1e3:9.1f}  {on * 1e3:9.1f}  {off / on:6.1f}x  "
            f"cached {runs[False][-1][1]['cached_tokens']:5d} / {meta['cached_tokens']:5d} "
            f"(storage {details.get('storage', 0)})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_args(parser)
    parser.add_argument("--lengths", type=int, nargs="+", default=[1536, 4000],
                        help="document tokens (plus a 32-token question: the small preset's "
                             "context is 4096; longer ones need --context-length)")
    parser.add_argument("--context-length", type=int, default=None,
                        help="override the model's (RoPE goes on past it)")
    parser.add_argument("--rounds", type=int, default=1, help="median of this many")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--chunk", type=int, default=2048, help="--chunked-prefill-size")
    parser.add_argument("--skip-restart", action="store_true")
    parser.add_argument("--prefetch-policy", default=None,
                        help="--hicache-storage-prefetch-policy (default: the server's)")
    args = parser.parse_args()
    model = resolve_model(args.model_path, args.preset)
    vocab = ModelConfig.from_hf(model).vocab_size
    print(f"model {model}, dtype {args.dtype}; TTFT in ms, median of {args.rounds}")
    print(f"{'case':8s} {'tokens':>6s}  {'computed':>9s}  {'storage':>9s}  {'speedup':>7s}  "
          "cached tokens without / with the tier")
    cases = [("revisit", revisit)] + ([] if args.skip_restart else [("restart", restart)])
    for name, fn in cases:
        for length in args.lengths:
            runs: dict[bool, list[tuple[float, dict]]] = {False: [], True: []}
            for _ in range(args.rounds):
                for tier in (False, True):
                    runs[tier].append(fn(model, length, tier, args, vocab))
            print(_row(name, length, runs), flush=True)


if __name__ == "__main__":
    main()
