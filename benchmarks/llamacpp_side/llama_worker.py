"""llama.cpp's half, under the llama.cpp venv's Python: ``python -m llamacpp_side.llama_worker``
with a spec (JSON) on stdin; one line, ``RESULT_PREFIX`` + JSON, on stdout.

Through the binding's C API (``llama_cpp``), as llama.cpp's own tools drive it:

- ``quantize``: ``llama_model_quantize`` (llama-quantize's code) from ``src`` to ``out``
  in ``ftype`` (``Q8_0``, ``Q4_K_M``), default parameters.
- ``bench``: greedy decoding of token-id prompts, timed. One stream: the prompt in one
  batch, then one token a step. N streams (``streams``): one context with N sequences,
  the prompts packed into batches of ``n_batch`` tokens across sequences, then one batch of
  N tokens a step: what llama-server does with N parallel slots whose requests arrive
  together (its continuous batching), without the HTTP.
- ``greedy``: each prompt's greedy tokens and the top-1 minus top-2 logit margin at each.
- ``info``: the binding's version and llama.cpp's ``llama_print_system_info``.

Only numpy and the binding: this venv has no radixlm and no torch.
"""

from __future__ import annotations

import ctypes
import json
import sys
import time
from collections.abc import Sequence

import llama_cpp as lc
import numpy as np

from llamacpp_side.protocol import result_line

FTYPES = {"Q8_0": lc.LLAMA_FTYPE_MOSTLY_Q8_0, "Q4_K_M": lc.LLAMA_FTYPE_MOSTLY_Q4_K_M,
          "Q4_0": lc.LLAMA_FTYPE_MOSTLY_Q4_0, "Q4_K_S": lc.LLAMA_FTYPE_MOSTLY_Q4_K_S,
          "Q5_K_M": lc.LLAMA_FTYPE_MOSTLY_Q5_K_M, "Q6_K": lc.LLAMA_FTYPE_MOSTLY_Q6_K}
N_BATCH, N_UBATCH = 2048, 512  # llama-server's defaults
Item = tuple[int, int, int, bool]  # token, position, sequence, wants logits


class Context:
    """A model and one context (``n_seq`` sequences) through the binding's C API."""

    def __init__(self, model_path: str, threads: int, n_ctx: int, n_seq: int,
                 kv_unified: bool) -> None:
        lc.llama_backend_init()
        self.model = lc.llama_model_load_from_file(model_path.encode(),
                                                   lc.llama_model_default_params())
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {model_path}")
        params = lc.llama_context_default_params()
        params.n_ctx, params.n_seq_max = n_ctx, n_seq
        params.n_batch, params.n_ubatch = N_BATCH, N_UBATCH
        params.n_threads = params.n_threads_batch = threads
        params.kv_unified = kv_unified
        self.ctx = lc.llama_init_from_model(self.model, params)
        if not self.ctx:
            raise RuntimeError(f"llama.cpp could not make a context (n_ctx {n_ctx})")
        self.n_vocab = lc.llama_vocab_n_tokens(lc.llama_model_get_vocab(self.model))
        self.batch = lc.llama_batch_init(N_BATCH, 0, 1)

    def clear(self) -> None:
        lc.llama_memory_clear(lc.llama_get_memory(self.ctx), True)

    def decode(self, items: Sequence[Item]) -> np.ndarray:
        """One ``llama_decode`` of ``items``; the logits of those that want them, in order
        ([rows, vocab], a copy)."""
        assert 0 < len(items) <= N_BATCH, f"batch of {len(items)} tokens"
        b = self.batch
        for i, (token, pos, seq, logits) in enumerate(items):
            b.token[i], b.pos[i], b.n_seq_id[i], b.logits[i] = token, pos, 1, logits
            b.seq_id[i][0] = seq
        b.n_tokens = len(items)
        rc = lc.llama_decode(self.ctx, b)
        if rc != 0:
            raise RuntimeError(f"llama_decode returned {rc}")
        rows = sum(1 for it in items if it[3])
        ptr = ctypes.cast(lc.llama_get_logits(self.ctx), ctypes.POINTER(ctypes.c_float))
        return np.ctypeslib.as_array(ptr, shape=(rows, self.n_vocab)).copy()

    def close(self) -> None:
        lc.llama_batch_free(self.batch)
        lc.llama_free(self.ctx)
        lc.llama_model_free(self.model)


def prefill(ctx: Context, prompts: Sequence[Sequence[int]]) -> np.ndarray:
    """Every prompt (sequence i) packed into batches of N_BATCH tokens; each prompt's last
    logits ([len(prompts), vocab])."""
    items = [(t, j, i, j == len(p) - 1) for i, p in enumerate(prompts) for j, t in enumerate(p)]
    rows = [ctx.decode(items[k:k + N_BATCH]) for k in range(0, len(items), N_BATCH)]
    return np.concatenate(rows)


def generate(ctx: Context, prompts: Sequence[Sequence[int]], new_tokens: int
             ) -> tuple[list[list[int]], float, float]:
    """Greedy ``new_tokens`` for every prompt at once; (outputs, seconds to the first
    tokens, seconds in all)."""
    ctx.clear()
    t0 = time.perf_counter()
    outs = [[int(t)] for t in prefill(ctx, prompts).argmax(axis=1)]
    first = time.perf_counter() - t0
    for step in range(1, new_tokens):
        items = [(out[-1], len(p) + step - 1, i, True)
                 for i, (p, out) in enumerate(zip(prompts, outs))]
        for out, t in zip(outs, ctx.decode(items).argmax(axis=1)):
            out.append(int(t))
    return outs, first, time.perf_counter() - t0


def run_bench(spec: dict) -> dict:
    """``single`` (prompt, decode) and each of ``streams`` (prompts, decode), timed after
    ``warmup`` (a prompt) ran once in each context."""
    results: dict = {}
    jobs = [("single", [spec["single"]["prompt"]], spec["single"]["decode"])]
    jobs += [(f"streams_{len(s['prompts'])}", s["prompts"], s["decode"])
             for s in spec["streams"]]
    for name, prompts, new_tokens in jobs:
        n_ctx = len(prompts) * (max(map(len, prompts)) + new_tokens + 16)
        ctx = Context(spec["model"], spec["threads"], n_ctx, len(prompts),
                      spec.get("kv_unified", False))
        try:
            generate(ctx, [spec["warmup"]] * len(prompts), 4)
            outs, first, total = generate(ctx, prompts, new_tokens)
        finally:
            ctx.close()
        results[name] = {"first_token_s": first, "seconds": total,
                         "prompt_tokens": sum(map(len, prompts)),
                         "output_tokens": sum(map(len, outs)), "output_ids": outs}
    return results


def run_greedy(spec: dict) -> dict:
    """Each prompt alone: greedy tokens, the top-1 minus top-2 logit at each step and the
    tokens whose logit is within ``near`` of the top one (the top one included)."""
    prompts, n, near = spec["prompts"], spec["tokens"], spec.get("near", 0.0)
    ctx = Context(spec["model"], spec["threads"], max(map(len, prompts)) + n + 16, 1, False)
    result: dict[str, list] = {"output_ids": [], "margins": [], "near": []}
    try:
        for prompt in prompts:
            ctx.clear()
            logits = prefill(ctx, [prompt])[0]
            out, margin, close = [], [], []
            for step in range(n):
                top2 = np.partition(logits, -2)[-2:]
                out.append(int(logits.argmax()))
                margin.append(float(top2[1] - top2[0]))
                close.append(np.flatnonzero(logits >= top2[1] - near).tolist())
                if step + 1 < n:
                    logits = ctx.decode([(out[-1], len(prompt) + step, 0, True)])[0]
            for key, value in zip(("output_ids", "margins", "near"), (out, margin, close)):
                result[key].append(value)
    finally:
        ctx.close()
    return result


def run_quantize(spec: dict) -> dict:
    params = lc.llama_model_quantize_default_params()
    params.nthread, params.ftype = spec["threads"], FTYPES[spec["ftype"]]
    rc = lc.llama_model_quantize(spec["src"].encode(), spec["out"].encode(),
                                 ctypes.byref(params))
    if rc != 0:
        raise RuntimeError(f"llama_model_quantize returned {rc}")
    return {"out": spec["out"]}


def run_info(spec: dict) -> dict:
    return {"version": lc.__version__, "system_info": lc.llama_print_system_info().decode()}


MODES = {"bench": run_bench, "greedy": run_greedy, "quantize": run_quantize, "info": run_info}


def main() -> int:
    spec = json.loads(sys.stdin.read())
    result = MODES[spec["mode"]](spec)
    print(result_line(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
