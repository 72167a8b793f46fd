"""Engine smoke test on CUDA: greedy tokens with the Triton kernels vs the CPU engine.

    python benchmarks/gpu_smoke.py

Runs the built-in tiny model in float32 on the CPU (torch kernels) and on the GPU
(Triton kernels, TF32 off), 16 greedy tokens per prompt, and prints PASS/FAIL per
prompt. Float32 sums in a different order can flip a near-tie, so the run passes if at
least 90% of the prompts match exactly; exits 1 otherwise (2 without CUDA).
"""

from __future__ import annotations

import sys

import torch

import radixlm

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


def generate(device: str, backend: str) -> list[list[int]]:
    with radixlm.Engine(
        model_path=None, device=device, attention_backend=backend, dtype="float32"
    ) as eng:
        outs = eng.generate(PROMPTS, SAMPLING)
    return [list(out["output_ids"]) for out in outs]


def main() -> int:
    if not torch.cuda.is_available():
        print("no CUDA device")
        return 2
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    cpu = generate("cpu", "torch")
    gpu = generate("cuda", "triton")
    matched = 0
    for i, (prompt, want, got) in enumerate(zip(PROMPTS, cpu, gpu, strict=True)):
        if want == got:
            matched += 1
            print(f"PASS {i:2} {prompt!r}")
            continue
        first = next((j for j, (a, b) in enumerate(zip(want, got, strict=False)) if a != b), None)
        first = min(len(want), len(got)) if first is None else first
        print(
            f"FAIL {i:2} {prompt!r}: first difference at token {first}\n"
            f"     cpu {want}\n     gpu {got}"
        )
    ok = matched >= MIN_MATCH * len(PROMPTS)
    print(
        f"{matched}/{len(PROMPTS)} prompts identical (need {MIN_MATCH:.0%}): "
        f"{'PASS' if ok else 'FAIL'}"
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
