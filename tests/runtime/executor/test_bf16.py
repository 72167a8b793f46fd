"""A bfloat16 model on the CPU, through the ModelRunner's own path (prepacked bf16 linears
where the CPU has bf16 instructions, the paged kernel in decode and short extend chunks,
torch's fused bf16 attention for longer chunks, a mixed batch over a cached prefix): its
logits are as close to the float32 model's as transformers' own bf16 logits are. Rounding
differs between two bf16 implementations, so this compares distances, not tokens."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from radixlm.kernels import cpu_paged, fma_linear, shared_prefix
from radixlm.runtime.config import ServerArgs
from radixlm.runtime.executor.model_runner import ModelRunner
from radixlm.runtime.executor.worker_batch import ModelWorkerBatch
from radixlm.runtime.model_config import cpu_has_bf16

POOL = 512
A, B = list(range(7, 27)), list(range(300, 312))  # 20 tokens (padded pass), 12 (kernel)
# the full sequences and, per step, which of their positions each logits row is
SEQS = [A + [40, 42], B + [41, 43, 44], A[:12] + [1500, 1501, 1502, 1503, 1504]]
STEPS = [
    (ModelWorkerBatch(False, [0, 1], [0, 0], [20, 12], A + B, [(0, 20), (11, 12)]),
     [(0, p) for p in range(20)] + [(1, 11)]),
    (ModelWorkerBatch(True, [0, 1], [20, 12], [1, 1], [40, 41], [(0, 1), (0, 1)]),
     [(0, 20), (1, 12)]),
    (ModelWorkerBatch(True, [0, 1], [21, 13], [1, 1], [42, 43], [(0, 1), (0, 1)]),
     [(0, 21), (1, 13)]),
    (ModelWorkerBatch(False, [2, 1], [12, 14], [5, 1], SEQS[2][12:] + [44], [(0, 5), (0, 1)]),
     [(2, p) for p in range(12, 17)] + [(1, 14)]),
]


def _req_to_token() -> torch.Tensor:
    """Rows 0 and 1 on shuffled slots; row 2 starts with row 0's first 12 slots."""
    slots = torch.randperm(POOL, generator=torch.Generator().manual_seed(0))
    table = torch.zeros(3, 64, dtype=torch.int64)
    table[0], table[1] = slots[:64], slots[64:128]
    table[2, :12] = table[0, :12]
    table[2, 12:] = slots[128:180]
    return table


def _hf_rows(path, dtype: torch.dtype) -> torch.Tensor:
    """transformers' logits for every row the steps produce, from whole sequences."""
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
    with torch.no_grad():
        full = [model(torch.tensor([s])).logits[0].float() for s in SEQS]
    return torch.stack([full[s][p] for _, rows in STEPS for s, p in rows])


def _distance(x: torch.Tensor, ref: torch.Tensor) -> float:
    return ((x - ref).norm() / ref.norm()).item()


@pytest.mark.parametrize("model", ["tiny_llama_dir", "tiny_qwen2_dir"])
def test_bf16_logits_are_as_close_to_float32_as_transformers_bf16(model, request,
                                                                  monkeypatch):
    path = str(request.getfixturevalue(model))
    # extend rows past 16 take the padded passes (CPUs with bf16 instructions; without them
    # the limit is float32's): here on every CPU, so that both extend paths run
    monkeypatch.setattr(shared_prefix, "KERNEL_MAX_EXTEND_ROWS_BF16", 16)
    runner = ModelRunner(ServerArgs(model_path=path, max_total_tokens=POOL, device="cpu",
                                    dtype="bfloat16"), path)
    assert runner.dtype == torch.bfloat16
    assert runner.paged_kernel == cpu_paged.available()
    # oneDNN's bf16 copies, or on an AVX2 build fma_linear's bf16 panels
    avx2_panels = fma_linear.supports(torch.zeros(1, 1, dtype=torch.bfloat16))
    assert (runner.prepacked_layers > 0) == (cpu_has_bf16() or avx2_panels)
    table = _req_to_token()
    ours = torch.cat([runner.forward(batch, table).float() for batch, _ in STEPS])
    assert 12 <= shared_prefix.KERNEL_MAX_EXTEND_ROWS_BF16 < 20  # both extend paths ran
    ref32 = _hf_rows(path, torch.float32)
    hf16 = _hf_rows(path, torch.bfloat16)
    ours_d, hf_d = _distance(ours, ref32), _distance(hf16, ref32)
    assert 0 < hf_d < 0.05, hf_d  # bf16 is not float32, yet close to it
    assert ours_d < 1.5 * hf_d, (ours_d, hf_d)  # measured: 0.025 vs 0.026, 0.030 vs 0.030
