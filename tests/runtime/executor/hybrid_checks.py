"""The hybrid families' shared logits check: a ModelRunner's forward over two sequences,
extend, extend past a chunk from the states the first left in their slots, then decode
steps, every row against a reference's logits of the whole sequence."""

from __future__ import annotations

from pathlib import Path

import torch

from radixlm.runtime.config import ServerArgs
from radixlm.runtime.executor.model_runner import ModelRunner
from radixlm.runtime.executor.worker_batch import ModelWorkerBatch


def step(runner: ModelRunner, table: torch.Tensor, seqs: list[list[int]],
         ranges: list[tuple[int, int]], decode: bool) -> torch.Tensor:
    """One forward of ``seqs[i][a:b]`` for each sequence (request row i; state slots 2, 0),
    every new row's logits."""
    for i, (a, b) in enumerate(ranges):
        table[i, a:b] = torch.arange(1000 * i + a, 1000 * i + b)  # slots of its own
    batch = ModelWorkerBatch(decode, list(range(len(seqs))), [a for a, _ in ranges],
                             [b - a for a, b in ranges],
                             [t for s, (a, b) in zip(seqs, ranges) for t in s[a:b]],
                             [(0, b - a) for a, b in ranges], state_slots=[2, 0])
    return runner.forward(batch, table)


def check_logits_over_steps(path: Path | str, seqs: list[list[int]],
                            ref: list[torch.Tensor], state_layers: list[int], atol: float,
                            name: str) -> None:
    """``seqs`` (two, of at least 143 and 73 tokens) through extend (7 / 30 tokens), extend
    past a 64-token chunk (to 70 / 140) and 3 decode steps, each row within ``atol`` of
    ``ref[i]`` (the reference's logits of sequence i). The state slots start with
    garbage: a fresh sequence must not read it."""
    runner = ModelRunner(ServerArgs(model_path=str(path), max_total_tokens=4096,
                                    device="cpu"), str(path))
    pool = runner.state_pool
    assert pool is not None and sorted(pool.specs) == state_layers
    for layer in pool.specs:
        pool.conv[layer].normal_()
        pool.ssm[layer].normal_()
    table = torch.zeros(2, 256, dtype=torch.int64)
    steps = [([(0, 7), (0, 30)], False), ([(7, 70), (30, 140)], False)]
    steps += [([(70 + i, 71 + i), (140 + i, 141 + i)], True) for i in range(3)]
    for ranges, decode in steps:
        got = step(runner, table, seqs, ranges, decode)
        expected = torch.cat([ref[i][a:b] for i, (a, b) in enumerate(ranges)])
        torch.testing.assert_close(got, expected, atol=atol, rtol=0, msg=f"{name} {ranges}")
