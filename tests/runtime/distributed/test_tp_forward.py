"""The model forward split over ranks (gloo, CPU) against one rank: the logits of every step
of a prefill / decode / cached-prefix sequence agree within 1e-4 (float32), and each rank
holds about 1/tp_size of the weights.

This process is rank 0 (``ModelRunner`` with ``tp_size`` > 1 broadcasts each step); the
other ranks are the real follower processes of ``managers/tp_ranks.py``.
"""

from __future__ import annotations

import pytest
import torch

from radixlm.runtime.config import ServerArgs
from radixlm.runtime.executor.model_runner import ModelRunner
from radixlm.runtime.executor.worker_batch import ModelWorkerBatch
from radixlm.runtime.managers.scheduler.tp_ranks import start_tp_ranks

POOL = 512


def _steps() -> list[ModelWorkerBatch]:
    """Two prompts prefilled together, two decode steps, then a third prompt whose first
    12 tokens are the first prompt's (read from the pool) in a mixed batch."""
    a, b = list(range(7, 27)), list(range(300, 312))
    return [
        ModelWorkerBatch(False, [0, 1], [0, 0], [20, 12], a + b, [(0, 20), (11, 12)]),
        ModelWorkerBatch(True, [0, 1], [20, 12], [1, 1], [40, 41], [(0, 1), (0, 1)]),
        ModelWorkerBatch(True, [0, 1], [21, 13], [1, 1], [42, 43], [(0, 1), (0, 1)]),
        ModelWorkerBatch(False, [2, 1], [12, 14], [5, 1], [1500, 1501, 1502, 1503, 1504, 44],
                         [(0, 5), (0, 1)], prefix_groups=None),
    ]


def _req_to_token() -> torch.Tensor:
    # rows 0 and 1 on shuffled slots; row 2 starts with row 0's first 12 slots (a cached
    # prefix), then slots of its own
    g = torch.Generator().manual_seed(0)
    slots = torch.randperm(POOL, generator=g)
    table = torch.zeros(3, 64, dtype=torch.int64)
    table[0], table[1] = slots[:64], slots[64:128]
    table[2, :12] = table[0, :12]
    table[2, 12:] = slots[128:180]
    return table


def _run(runner: ModelRunner) -> list[torch.Tensor]:
    table = _req_to_token()
    return [runner.forward(batch, table).clone() for batch in _steps()]


def _param_bytes(runner: ModelRunner) -> int:
    return sum(p.numel() * p.element_size() for p in runner.model.parameters())


def _tp_run(path: str, tp_size: int) -> tuple[list[torch.Tensor], int]:
    args = ServerArgs(model_path=path, max_total_tokens=POOL, device="cpu", dtype="float32",
                      tp_size=tp_size, dist_timeout=60)
    args, ranks = start_tp_ranks(args, path)
    runner = None
    try:
        runner = ModelRunner(args, path)
        assert runner.tp.size == tp_size and runner.kv_pool.num_kv_heads == max(2 // tp_size, 1)
        return _run(runner), _param_bytes(runner)
    finally:
        ranks.stop(runner)
        assert [p.returncode for p in ranks.procs.values()] == [0] * (tp_size - 1)
        assert not torch.distributed.is_initialized()


@pytest.mark.parametrize("arch,tp_size", [("llama", 2), ("qwen2", 2), ("llama", 4)])
def test_tp_logits_match_one_rank(tiny_llama_dir, tiny_qwen2_dir, arch, tp_size):
    """tp 4 on a model with 2 KV heads: each KV head is replicated on two ranks."""
    path = str(tiny_llama_dir if arch == "llama" else tiny_qwen2_dir)
    one = ModelRunner(ServerArgs(model_path=path, max_total_tokens=POOL, device="cpu",
                                 dtype="float32"), path)
    expected, full_bytes = _run(one), _param_bytes(one)
    got, rank0_bytes = _tp_run(path, tp_size)
    for step, (g, e) in enumerate(zip(got, expected)):
        assert g.shape == e.shape, (step, g.shape, e.shape)
        assert torch.allclose(g, e, atol=1e-4, rtol=0), (step, (g - e).abs().max().item())
    # everything but the norms (< 1% of the tiny model) is split, except that with more
    # ranks than KV heads each rank holds a whole KV head of k_proj and v_proj
    cfg = one.model_config
    kv_rows = max(cfg.num_key_value_heads // tp_size, 1) * cfg.head_dim
    replicated = cfg.num_layers * 2 * (kv_rows - cfg.kv_size / tp_size) * cfg.hidden_size * 4
    assert rank0_bytes < full_bytes / tp_size * 1.02 + replicated, (rank0_bytes, full_bytes)
