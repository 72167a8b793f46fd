"""Engine smoke test on CUDA: greedy tokens with the Triton kernels against a reference.

    python benchmarks/gpu_smoke.py                       # tiny model, float32, vs the CPU
    python benchmarks/gpu_smoke.py --preset small --dtype bfloat16 --against transformers
    python benchmarks/gpu_smoke.py --family mixtral      # a tiny family checkpoint (MoE)

Default: the built-in tiny model in float32 on the CPU (torch kernels) and on the GPU
(Triton kernels, TF32 off; decode replayed from CUDA graphs, and once more with
``--disable-cuda-graph``, which must give the same tokens; the decode rate of both is
printed). ``--family ARCH``: the tiny ``radixlm.tiny_families`` checkpoint of ARCH instead
(``mixtral``: experts in the fused-MoE kernel, decoded from CUDA graphs, against the CPU's
grouped experts). ``--against transformers``: transformers' own forward on the
GPU in the same dtype is the reference. 16 greedy tokens per prompt, PASS/FAIL per
prompt. Sums in a different order can flip a near-tie, so the run passes if at least
``--min-match`` of the prompts match exactly (90%; bfloat16 rounds more: 75% there); exits
1 otherwise (2 without CUDA). Part of ``make gpu-check``.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import radixlm
from radixlm.tiny_families import FAMILIES, make_family_model
from radixlm.tiny_model import add_model_args, resolve_model

PROMPTS = [
    "The quick brown fox",
    "Once upon a time",
    "Hello, my name is",
    "In the beginning",
    "1, 2, 3, 4,",
    "The capital of France is",
    "def fibonacci(n):",
    "A long time ago in a galaxy far, far away",
    "To be or not to be",
    "The weather today is",
    "Shared prefix: the following story is about a cat.",
    "Shared prefix: the following story is about a dog.",
]
SAMPLING = {"max_new_tokens": 16, "temperature": 0}
MIN_MATCH = 0.9


def generate(model: str, device: str, backend: str, dtype: str,
             **kw) -> tuple[list[list[int]], float]:
    """Greedy ids per prompt, and the decode rate (tokens/s) of a second, timed run."""
    with radixlm.Engine(model_path=model, device=device, attention_backend=backend,
                        dtype=dtype, **kw) as eng:
        outs = eng.generate(PROMPTS, SAMPLING)
        t0 = time.perf_counter()
        timed = eng.generate(PROMPTS * 4, {**SAMPLING, "max_new_tokens": 64,
                                           "ignore_eos": True})
        rate = sum(len(o["output_ids"]) for o in timed) / (time.perf_counter() - t0)
    return [list(out["output_ids"]) for out in outs], rate


def compare(label: str, ref: list[list[int]], got: list[list[int]]) -> int:
    matched = 0
    for i, (prompt, want, out) in enumerate(zip(PROMPTS, ref, got, strict=True)):
        if want == out:
            matched += 1
            print(f"PASS {i:2} {prompt!r}")
            continue
        first = next((j for j, (a, b) in enumerate(zip(want, out, strict=False)) if a != b),
                     None)
        first = min(len(want), len(out)) if first is None else first
        print(f"FAIL {i:2} {prompt!r}: first difference at token {first}\n"
              f"     {label} {want}\n     gpu {out}")
    return matched


def generate_hf(model: str, dtype: str) -> list[list[int]]:
    hf = AutoModelForCausalLM.from_pretrained(model, dtype=getattr(torch, dtype)).cuda().eval()
    tok = AutoTokenizer.from_pretrained(model)
    outs = []
    with torch.no_grad():
        for prompt in PROMPTS:
            ids = torch.tensor([tok.encode(prompt, add_special_tokens=False)]).cuda()
            gen = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                              max_new_tokens=SAMPLING["max_new_tokens"], pad_token_id=0)
            outs.append(gen[0, ids.shape[1]:].tolist())
    return outs


def main() -> int:
    ap = argparse.ArgumentParser()
    add_model_args(ap)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--against", choices=["cpu", "transformers"], default="cpu")
    ap.add_argument("--min-match", type=float, default=None)
    ap.add_argument("--family", choices=sorted(FAMILIES), default=None,
                    help="the tiny checkpoint of this family (written to a temporary dir)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device")
        return 2
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    if args.family:
        with tempfile.TemporaryDirectory() as tmp:
            return run(args, str(make_family_model(tmp, args.family)))
    return run(args, resolve_model(args.model_path, args.preset))


def run(args: argparse.Namespace, model: str) -> int:
    min_match = args.min_match or (MIN_MATCH if args.dtype == "float32" else 0.75)
    ref = (generate(model, "cpu", "torch", args.dtype)[0] if args.against == "cpu"
           else generate_hf(model, args.dtype))
    gpu, rate = generate(model, "cuda", "triton", args.dtype)  # decode from CUDA graphs
    eager, eager_rate = generate(model, "cuda", "triton", args.dtype, disable_cuda_graph=True)
    need = min_match * len(PROMPTS)
    matched = compare(args.against, ref, gpu)
    same = compare("eager", eager, gpu)
    ok = matched >= need and same >= need
    print(f"{model} {args.dtype}, against {args.against}: {matched}/{len(PROMPTS)} prompts "
          f"identical; CUDA graphs against eager: {same}/{len(PROMPTS)} (need "
          f"{min_match:.0%}): {'PASS' if ok else 'FAIL'}")
    print(f"decode, 48 requests x 64 tokens: CUDA graphs {rate:.0f} tok/s, eager "
          f"{eager_rate:.0f} tok/s ({rate / eager_rate:.2f}x)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
