"""radixlm's half, under this repository's venv: ``python -m llamacpp_side.radixlm_worker``
with the same spec (JSON) on stdin as ``llama_worker``; one result line on stdout.

- ``bench``: one stream through ``Engine.generate(stream=True)`` (the first chunk's time is
  the prompt's, the chunks after it the decode's); N streams as one batch of N requests
  (``Engine.generate`` with N prompts), the prefix cache flushed before each.
- ``greedy``: each prompt's greedy tokens (``ignore_eos``).

The model is a GGUF file (``Engine(model_path="file.gguf")``) or, with ``dtype`` in the
spec, a Hugging Face directory in that dtype.
"""

from __future__ import annotations

import json
import sys
import time

import radixlm
from llamacpp_side.protocol import result_line


def make_engine(spec: dict, prompt_tokens: int) -> radixlm.Engine:
    kwargs = {"cpu_threads": spec["threads"], "random_seed": 0,
              "max_total_tokens": max(spec.get("kv_tokens", 0), prompt_tokens + 1024)}
    if spec.get("dtype"):
        kwargs["dtype"] = spec["dtype"]
    return radixlm.Engine(model_path=spec["model"], **kwargs)


def greedy_params(new_tokens: int) -> dict:
    return {"max_new_tokens": new_tokens, "temperature": 0, "ignore_eos": True}


def one_stream(eng: radixlm.Engine, prompt: list[int], new_tokens: int) -> dict:
    """The prompt's time (to the first chunk with tokens) and the whole run's."""
    eng.flush_cache()
    t0 = time.perf_counter()
    first, out = None, []
    for chunk in eng.generate(input_ids=prompt, sampling_params=greedy_params(new_tokens),
                              stream=True):
        if chunk["output_ids"] and first is None:
            first = time.perf_counter() - t0
        out += chunk["output_ids"]
    total = time.perf_counter() - t0
    assert first is not None and len(out) == new_tokens, f"{len(out)} of {new_tokens} tokens"
    return {"first_token_s": first, "seconds": total, "prompt_tokens": len(prompt),
            "output_tokens": len(out), "output_ids": [out]}


def streams(eng: radixlm.Engine, prompts: list[list[int]], new_tokens: int) -> dict:
    eng.flush_cache()
    t0 = time.perf_counter()
    outs = eng.generate(input_ids=prompts, sampling_params=greedy_params(new_tokens))
    total = time.perf_counter() - t0
    ids = [list(o["output_ids"]) for o in outs]
    return {"first_token_s": None, "seconds": total,
            "prompt_tokens": sum(map(len, prompts)), "output_tokens": sum(map(len, ids)),
            "output_ids": ids}


def run_bench(spec: dict) -> dict:
    biggest = max([len(spec["single"]["prompt"]) + spec["single"]["decode"]]
                  + [sum(map(len, s["prompts"])) + len(s["prompts"]) * s["decode"]
                     for s in spec["streams"]])
    eng = make_engine(spec, biggest)
    try:
        eng.generate(input_ids=[spec["warmup"]] * 2, sampling_params=greedy_params(4))
        results = {"single": one_stream(eng, spec["single"]["prompt"],
                                        spec["single"]["decode"])}
        for s in spec["streams"]:
            results[f"streams_{len(s['prompts'])}"] = streams(eng, s["prompts"], s["decode"])
    finally:
        eng.shutdown()
    return results


def run_greedy(spec: dict) -> dict:
    eng = make_engine(spec, sum(map(len, spec["prompts"])) + 64)
    try:
        outs = eng.generate(input_ids=spec["prompts"],
                            sampling_params=greedy_params(spec["tokens"]))
    finally:
        eng.shutdown()
    return {"output_ids": [list(o["output_ids"]) for o in outs]}


MODES = {"bench": run_bench, "greedy": run_greedy}


def main() -> int:
    spec = json.loads(sys.stdin.read())
    print(result_line(MODES[spec["mode"]](spec)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
