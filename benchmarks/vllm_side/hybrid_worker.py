"""One system on one hybrid checkpoint: ``python -m vllm_side.hybrid_worker SPEC_JSON``.

Runs under radixlm's Python (system ``radixlm``) or vLLM's venv (system ``vllm``), as
``worker.py`` does, and prints one ``RESULT_PREFIX`` + JSON line on stdout. The spec:
``system``, ``model``, ``dtype``, ``threads``, ``kv_tokens`` (radixlm's pool), ``mode``:

- ``probe``: load, then greedy ``new`` tokens on ``prompt`` (ids); the result holds the
  output ids (a failure to load or generate is the process's exit status and stderr);
- ``bench``: for each batch in ``batches``, ``batch`` prompts of ``prompt_len`` random ids
  (``seed``), a 2-token warm-up, then the seconds of ``new`` and of 1 new token (the
  prefill), each with the cache emptied first; the result holds both times and the
  ``new``-token outputs' ids.

Greedy, EOS ignored, no prefix caching hit (radixlm flushes its cache before each call;
vLLM runs with prefix caching off). No pickle crosses the process boundary.
"""

from __future__ import annotations

import json
import random
import sys
import time
from collections.abc import Callable

from vllm_side.worker import RESULT_PREFIX

Generate = Callable[[list[list[int]], int], list[list[int]]]  # prompts, new -> output ids


def radixlm_generate(spec: dict) -> Generate:
    import radixlm

    eng = radixlm.Engine(model_path=spec["model"], dtype=spec["dtype"], random_seed=0,
                         cpu_threads=spec["threads"], max_total_tokens=spec["kv_tokens"])

    def generate(prompts: list[list[int]], new: int) -> list[list[int]]:
        eng.flush_cache()
        outs = eng.generate(input_ids=prompts, sampling_params={
            "max_new_tokens": new, "temperature": 0, "ignore_eos": True})
        return [list(o["output_ids"]) for o in outs]

    return generate


def vllm_generate(spec: dict) -> Generate:
    """``vllm.LLM`` on the CPU: eager (no compile step to time), prefix caching off, at
    most ``max_len`` tokens a sequence; ``gpu_memory_utilization`` is the share of RAM its
    CPU backend may reserve."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(model=spec["model"], dtype=spec["dtype"], seed=0, enforce_eager=True,
              enable_prefix_caching=False, gpu_memory_utilization=0.3,
              max_model_len=spec["max_len"], max_num_seqs=max(spec.get("batches", [1])))

    def generate(prompts: list[list[int]], new: int) -> list[list[int]]:
        params = SamplingParams(temperature=0, max_tokens=new, ignore_eos=True)
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params,
                            use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]

    return generate


def bench(spec: dict, generate: Generate) -> dict:
    """Per batch size: the seconds of ``new`` tokens and of 1, and the outputs' ids."""
    rng = random.Random(spec["seed"])
    out = {}
    for batch in spec["batches"]:
        prompts = [[rng.randrange(100, spec["vocab"] - 1) for _ in range(spec["prompt_len"])]
                   for _ in range(batch)]
        generate(prompts, 2)  # warm
        t0 = time.perf_counter()
        ids = generate(prompts, spec["new"])
        t1 = time.perf_counter()
        generate(prompts, 1)
        t2 = time.perf_counter()
        out[str(batch)] = {"seconds": t1 - t0, "prefill_seconds": t2 - t1, "output_ids": ids}
    return out


def main(argv: list[str]) -> int:
    spec = json.loads(argv[0])
    make = {"radixlm": radixlm_generate, "vllm": vllm_generate}[spec["system"]]
    t0 = time.perf_counter()
    generate = make(spec)
    load_s = time.perf_counter() - t0
    if spec["mode"] == "probe":
        result = {"output_ids": generate([spec["prompt"]], spec["new"])[0]}
    else:
        result = bench(spec, generate)
    print(RESULT_PREFIX + json.dumps({"load_seconds": load_s, **result}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
