"""One system, one dtype, one round: ``python -m vllm_side.worker SPEC_JSON``.

Runs under radixlm's Python (system ``radixlm``) or under vLLM's venv (system ``vllm``):
loads the model, runs a short warm-up generate, then times each workload's generate call
alone (prefix cache emptied before each). Prints one line, ``RESULT_PREFIX`` + JSON, on
stdout: per workload the seconds, output tokens, output token ids and (JSON workload) the
texts. No pickle crosses the process boundary.

The spec: ``system``, ``model`` (a checkpoint directory), ``dtype``, ``threads``,
``workloads`` (names), ``vocab``, ``seed``, ``kv_tokens`` (radixlm's pool), ``kv_gib``
(vLLM's ``VLLM_CPU_KVCACHE_SPACE``, set by the parent), and optionally ``profile_dir``
(a torch profiler trace of the timed part, vLLM only).
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable

from vllm_side.workloads import SCHEMA, Request, make_workload, warmup_requests

RESULT_PREFIX = "VLLM_SIDE_RESULT "
Outputs = list[tuple[list[int], str]]  # per request: output token ids, text
Generate = Callable[[list[Request]], Outputs]


def radixlm_generate(spec: dict) -> tuple[Generate, Callable[[], None], Callable[[], None]]:
    """``generate``, ``flush`` and ``close`` over a radixlm.Engine."""
    import radixlm

    eng = radixlm.Engine(model_path=spec["model"], dtype=spec["dtype"], random_seed=0,
                         cpu_threads=spec["threads"], max_total_tokens=spec["kv_tokens"],
                         grammar_backend="xgrammar")
    schema = json.dumps(SCHEMA)

    def generate(reqs: list[Request]) -> Outputs:
        sps = [{"max_new_tokens": r.max_tokens, "temperature": 0,
                **({"json_schema": schema} if r.json_schema else {"ignore_eos": True})}
               for r in reqs]
        outs = eng.generate(input_ids=[r.prompt_ids for r in reqs], sampling_params=sps)
        return [(list(o["output_ids"]), o["text"]) for o in outs]

    return generate, eng.flush_cache, eng.shutdown


def vllm_generate(spec: dict) -> tuple[Generate, Callable[[], None], Callable[[], None]]:
    """``generate``, ``flush`` and ``close`` over ``vllm.LLM`` (prefix caching on,
    xgrammar for structured outputs, vLLM's other defaults)."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.sampling_params import StructuredOutputsParams

    llm = LLM(model=spec["model"], dtype=spec["dtype"], seed=0, enable_prefix_caching=True,
              structured_outputs_config={"backend": "xgrammar"},
              **({"profiler_config": {
                  "profiler": "torch", "torch_profiler_dir": spec["profile_dir"],
                  "torch_profiler_with_stack": False, "torch_profiler_record_shapes": True}}
                 if spec.get("profile_dir") else {}))

    def params(r: Request) -> SamplingParams:
        if r.json_schema:
            return SamplingParams(temperature=0, max_tokens=r.max_tokens,
                                  structured_outputs=StructuredOutputsParams(json=SCHEMA))
        return SamplingParams(temperature=0, max_tokens=r.max_tokens, ignore_eos=True)

    def generate(reqs: list[Request]) -> Outputs:
        outs = llm.generate([TokensPrompt(prompt_token_ids=r.prompt_ids) for r in reqs],
                            [params(r) for r in reqs], use_tqdm=False)
        return [(list(o.outputs[0].token_ids), o.outputs[0].text) for o in outs]

    generate.llm = llm  # the profiler hooks (run_workloads)
    # no close: vLLM 0.32's LLM has no shutdown method; its engine processes are stopped
    # when this process exits
    return generate, llm.reset_prefix_cache, lambda: None


def run_workloads(spec: dict, generate: Generate, flush: Callable[[], None]) -> dict:
    """Warm up, then time each workload's generate alone."""
    generate(warmup_requests(spec["vocab"]))
    results = {}
    llm = getattr(generate, "llm", None)
    for name in spec["workloads"]:
        reqs = make_workload(name, spec["vocab"], spec["seed"])
        flush()
        if spec.get("profile_dir") and llm is not None:
            llm.start_profile()
        t0 = time.perf_counter()
        outs = generate(reqs)
        seconds = time.perf_counter() - t0
        if spec.get("profile_dir") and llm is not None:
            llm.stop_profile()
        results[name] = {
            "seconds": seconds,
            "output_tokens": sum(len(ids) for ids, _ in outs),
            "output_ids": [ids for ids, _ in outs],
            "texts": [text for _, text in outs] if any(r.json_schema for r in reqs) else [],
        }
    return results


def main(argv: list[str]) -> int:
    spec = json.loads(argv[0])
    make = {"radixlm": radixlm_generate, "vllm": vllm_generate}[spec["system"]]
    t0 = time.perf_counter()
    generate, flush, close = make(spec)
    load_s = time.perf_counter() - t0
    try:
        results = run_workloads(spec, generate, flush)
    finally:
        close()
    print(RESULT_PREFIX + json.dumps({"load_seconds": load_s, "workloads": results}),
          flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
