"""The last layer of an extend runs only the rows whose logits are wanted, one a sequence
at most (``ForwardBatch.last_rows``): every row's K/V still goes to the pool, then those
rows attend as a decode batch over their KV up to them and alone go through o_proj and the
MLP. For every family, through the ModelRunner's own path (prefix groups, a mixed batch, a
row before the last, a chunk that wants no logits): the logits equal those of every row
through the last layer, and the pools hold the same K/V, bit for bit. Prompt logprobs and
mean pooling keep every row."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():  # before the Triton kernels are first imported
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402

from radixlm.runtime.config import ServerArgs  # noqa: E402
from radixlm.runtime.executor.batch_builder import ForwardBatchBuilder  # noqa: E402
from radixlm.runtime.executor.model_runner import ModelRunner  # noqa: E402
from radixlm.runtime.executor.worker_batch import ModelWorkerBatch  # noqa: E402
from radixlm.tiny_families import FAMILIES, WINDOW  # noqa: E402

POOL = 512
S0, S1 = list(range(5, 45)), list(range(300, 340))  # 40 tokens each: past the windows
S2 = S1[:32] + list(range(700, 720))  # row 2 starts with row 1's first 32 slots
S3 = list(range(900, 916))
STEPS = [
    # two prompts, each wanting its last row
    ModelWorkerBatch(False, [0, 1], [0, 0], [40, 40], S0 + S1, [(39, 40), (39, 40)]),
    # a mixed batch: a decode row, a prompt over row 1's cached first 32 tokens, and a
    # chunk that wants no logits (its prompt goes on)
    ModelWorkerBatch(False, [0, 2, 3], [40, 32, 0], [1, 20, 16], [50] + S2[32:] + S3,
                     [(0, 1), (19, 20), (16, 16)], prefix_groups=None),
    ModelWorkerBatch(True, [0, 2], [41, 52], [1, 1], [51, 52], [(0, 1), (0, 1)]),
    # rows 1 and 2 share their first 32 slots: a group in the last layer's decode view too;
    # row 3 wants its second new row's logits, not its last (keys past it not attended)
    ModelWorkerBatch(False, [1, 2, 3], [40, 53, 16], [3, 2, 4], [60, 61, 62, 63, 64,
                                                                  65, 66, 67, 68],
                     [(2, 3), (1, 2), (1, 2)], prefix_groups=[(32, [0, 1])]),
    # a chunk alone that wants no logits: its last layer only stores K/V, which the
    # decode step after it reads
    ModelWorkerBatch(False, [3], [20], [8], list(range(920, 928)), [(8, 8)]),
    ModelWorkerBatch(True, [3], [28], [1], [70], [(0, 1)]),
]


def _req_to_token() -> torch.Tensor:
    slots = torch.randperm(POOL - 1, generator=torch.Generator().manual_seed(1))
    table = torch.zeros(4, 64, dtype=torch.int64)
    table[0], table[1], table[3] = slots[:64], slots[64:128], slots[128:192]
    table[2, :32] = table[1, :32]
    table[2, 32:] = slots[192:224]
    return table


def _run(runner: ModelRunner, steps=STEPS) -> tuple[list[torch.Tensor], list[bool]]:
    table = _req_to_token()
    out, viewed = [], []
    for batch in steps:
        viewed.append(runner.batch_builder.build(batch, table).last_rows is not None)
        out.append(runner.forward(batch, table))
    return out, viewed


def _pool(runner: ModelRunner) -> list[torch.Tensor]:
    pool = runner.kv_pool
    return [t for layer in range(runner.model_config.num_layers)
            for t in pool.get_kv_buffer(layer)]


def _runners(path, monkeypatch, **kwargs) -> tuple[ModelRunner, ModelRunner]:
    args = ServerArgs(model_path=str(path), max_total_tokens=POOL, device="cpu",
                      random_seed=0, **kwargs)
    fast = ModelRunner(args, str(path))
    every = ModelRunner(args, str(path))
    monkeypatch.setattr(every.batch_builder, "_last_rows", lambda batch, table: None)
    return fast, every


def _check(fast: ModelRunner, every: ModelRunner, arch: str, atol: float = 1e-4) -> None:
    got, viewed = _run(fast)
    want, _ = _run(every)
    assert viewed == [True, True, False, True, True, False], arch  # decodes have none
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=atol, rtol=0, msg=arch)
    for g, w in zip(_pool(fast), _pool(every)):  # every row's K/V, the last layer's too
        assert torch.equal(g, w), arch


@pytest.mark.parametrize("arch", sorted(FAMILIES))
def test_last_layer_on_the_wanted_rows_alone(family_dirs, monkeypatch, arch):
    """Every family: norms before, around and after each block (Llama, Gemma, OLMo 2),
    soft-caps, sinks, sliding windows (40-token prompts, 24-token windows), experts."""
    assert len(S0) > WINDOW
    _check(*_runners(family_dirs[arch], monkeypatch), arch)


@pytest.mark.parametrize("arch", ["gemma3", "mistral"])
def test_sliding_layers_in_the_swa_pool(family_dirs, monkeypatch, arch):
    """The view is translated into the sliding pool's slots like the forward itself."""
    fast, every = _runners(family_dirs[arch], monkeypatch, enable_hybrid_swa_memory=True)
    assert fast.swa is not None
    _check(fast, every, arch)


@pytest.mark.parametrize("options", [{"torchao_config": "int8wo"}, {"dtype": "bfloat16"}])
def test_int8_and_bf16_linears(family_dirs, monkeypatch, options):
    """Weight-only int8 and bfloat16 linears over M rows (or none) in the last layer."""
    _check(*_runners(family_dirs["qwen3"], monkeypatch, **options), "qwen3",
           atol=0.05 if "dtype" in options else 1e-4)


def test_triton_path(family_dirs, monkeypatch):
    """The Triton kernels (interpreted on a CPU) decode the view too."""
    _check(*_runners(family_dirs["gemma2"], monkeypatch, attention_backend="triton"),
           "gemma2")


class _Builder(ForwardBatchBuilder):
    """Only the eligibility of ``_last_rows``: no view is built."""

    def __init__(self) -> None:
        super().__init__(torch.device("cpu"), None, None, torch.float32, [], False, False,
                         False)

    def _decode_batch(self, batch, req_to_token):
        return batch


@pytest.mark.parametrize("ranges, kept", [
    ([(4, 5), (2, 3)], [0, 1]),  # each sequence's last row
    ([(4, 5), (3, 3)], [0]),  # the second wants none (a chunk with prompt left)
    ([(5, 5), (3, 3)], []),  # none wanted: the last layer only stores K/V
    ([(0, 5), (2, 3)], None),  # prompt logprobs (or mean pooling): every row
    ([(0, 1), (3, 3)], [0]),  # one row, not the last (CLS pooling)
])
def test_which_batches_get_a_view(ranges, kept):
    batch = ModelWorkerBatch(False, [7, 8], [10, 9], [5, 3], list(range(8)), ranges,
                             prefix_groups=[(8, [0, 1])])
    view = _Builder()._last_rows(batch, torch.zeros(0))
    if kept is None:
        assert view is None
        return
    if not kept:
        assert view.batch_size == 0 and view.logits_indices.numel() == 0
        return
    assert view.req_pool_indices == [[7, 8][b] for b in kept]
    positions = [10 + ranges[0][0], 9 + ranges[1][0]]
    assert view.prefix_lens == [positions[b] for b in kept]  # the wanted row's position
    assert view.prefix_groups == ([(8, [0, 1])] if len(kept) == 2 else None)
