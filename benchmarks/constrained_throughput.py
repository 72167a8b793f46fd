"""JSON-schema constrained decoding vs unconstrained, and what jump-forward saves.

A schema with long fixed keys, N requests, temperature 0.7 with per-request seeds.
Prints output tok/s with and without the constraint (the unconstrained run generates
the same number of tokens per request, EOS ignored), the grammar overhead per
constrained token (mask fill + automaton advance + jump-forward, in microseconds), the
share of output tokens produced by jump-forward, and model forwards with jump-forward
on vs off.

    .venv/bin/python benchmarks/constrained_throughput.py [--grammar-backend xgrammar ...]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import jsonschema

import radixlm
from radixlm.runtime.managers.scheduler.output_processor import OutputProcessor
from radixlm.tiny_model import add_model_args, resolve_model

SCHEMA = {
    "type": "object",
    "properties": {
        "customer_identification_number": {"type": "string", "pattern": "^[0-9]{1,6}$"},
        "preferred_contact_method_for_support": {"enum": ["email", "phone", "post"]},
        "has_accepted_the_terms_and_conditions": {"type": "boolean"},
        "number_of_previous_support_tickets": {"type": "string", "pattern": "^[0-9]{1,3}$"},
    },
    "required": ["customer_identification_number", "preferred_contact_method_for_support",
                 "has_accepted_the_terms_and_conditions", "number_of_previous_support_tickets"],
}


class GrammarTimer:
    """Wall time inside the output processor's grammar hooks."""

    def __init__(self) -> None:
        self.seconds = 0.0

    def install(self) -> None:
        timer = self
        for name in ("_take_bitmask", "_advance_grammars"):
            orig = getattr(OutputProcessor, name)

            def timed(self, *a, _orig=orig, **kw):
                t0 = time.perf_counter()
                try:
                    return _orig(self, *a, **kw)
                finally:
                    timer.seconds += time.perf_counter() - t0

            setattr(OutputProcessor, name, timed)


def run(eng, prompts, params) -> tuple[float, list[dict], dict]:
    eng.flush_cache()
    before = eng.get_server_info()
    t0 = time.perf_counter()
    outs = eng.generate(prompts, params)
    dt = time.perf_counter() - t0
    after = eng.get_server_info()
    delta = {k: after[k] - before[k] for k in ("forward_steps", "jump_forward_tokens",
                                               "generation_tokens")}
    return dt, outs, delta


def measure(backend: str, requests: int = 32, max_new_tokens: int = 256, rounds: int = 3,
            model: str | None = None) -> dict[str, dict]:
    """Constrained vs unconstrained on the tiny model with one grammar backend, jump-forward
    on and off: one row each."""
    timer = GrammarTimer()
    timer.install()
    prompts = [f"Support ticket {i}: the customer wrote in. Record:" for i in range(requests)]
    base = {"max_new_tokens": max_new_tokens, "temperature": 0.7}
    constrained = [{**base, "seed": i, "json_schema": SCHEMA} for i in range(requests)]
    eng_jump = radixlm.Engine(model, random_seed=0, grammar_backend=backend)
    eng_nojump = radixlm.Engine(model, random_seed=0, disable_jump_forward=True,
                                grammar_backend=backend)
    for e in (eng_jump, eng_nojump):
        run(e, prompts[:2], constrained[:2])  # warm-up (and grammar compile)
    rows = {}
    for name, eng in (("jump-forward on", eng_jump), ("jump-forward off", eng_nojump)):
        times, grammar_s = [], []
        for _ in range(rounds):
            timer.seconds = 0.0
            dt, outs, delta = run(eng, prompts, constrained)
            times.append(dt)
            grammar_s.append(timer.seconds)
        finished = [o for o in outs if o["meta_info"]["finish_reason"]["type"] == "stop"]
        for o in finished:
            jsonschema.validate(json.loads(o["text"]), SCHEMA)
        lens = [o["meta_info"]["completion_tokens"] for o in outs]
        free = [{**base, "seed": i, "max_new_tokens": n, "ignore_eos": True}
                for i, n in enumerate(lens)]
        free_t = statistics.median(run(eng, prompts, free)[0] for _ in range(rounds))
        sampled = delta["generation_tokens"]
        rows[name] = dict(
            tokens=sum(lens), t=statistics.median(times), t_free=free_t,
            forwards=delta["forward_steps"], jump=delta["jump_forward_tokens"],
            mask_us=1e6 * statistics.median(grammar_s) / max(sampled, 1),
            valid=f"{len(finished)}/{len(outs)}")
    for e in (eng_jump, eng_nojump):
        e.shutdown()
    return rows


def print_rows(rows: dict[str, dict[str, dict]]) -> None:
    print("| backend | run | output tokens | constrained tok/s | unconstrained tok/s | ratio | "
          "grammar us/token | jump-forward share | model forwards | valid |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for backend, runs in rows.items():
        for name, r in runs.items():
            c, u = r["tokens"] / r["t"], r["tokens"] / r["t_free"]
            print(f"| {backend} | {name} | {r['tokens']} | {c:.0f} | {u:.0f} | {c / u:.2f} | "
                  f"{r['mask_us']:.0f} | {100 * r['jump'] / r['tokens']:.1f}% | "
                  f"{r['forwards']} | {r['valid']} |")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--grammar-backend", nargs="+", default=["xgrammar"])
    add_model_args(ap)
    args = ap.parse_args()
    model = resolve_model(args.model_path, args.preset)
    rows = {b: measure(b, args.requests, args.max_new_tokens, args.rounds, model)
            for b in args.grammar_backend}
    print(f"{args.requests} requests, schema with 4 long fixed keys, temperature 0.7, "
          f"median of {args.rounds} rounds")
    print_rows(rows)
    for backend, runs in rows.items():
        on, off = runs["jump-forward on"], runs["jump-forward off"]
        cut = 100 * (1 - on["forwards"] / off["forwards"])
        print(f"{backend}: jump-forward cuts model forwards by {cut:.1f}% (target >= 30%)")


if __name__ == "__main__":
    main()
