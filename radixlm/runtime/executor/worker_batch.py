"""ModelWorkerBatch: what the executor needs to know of one scheduler step.

The scheduler owns requests (``managers/schedule_batch.py``); the executor owns the
model and the KV pool. Between them passes this plain description, built by
``ScheduleBatch.worker_batch()``, so the executor never sees a request object (as
SGLang's scheduler hands its model worker a ``ModelWorkerBatch``).

Sequence ``i`` has ``prefix_lens[i]`` tokens whose K/V the pool already holds, in slots
``req_to_token[req_pool_indices[i], :prefix_lens[i]]``, and extends by
``extend_lens[i]`` new tokens (``input_ids``, packed over the batch), whose K/V go to
the next slots of the same row. ``sampling`` says which rows sample after the forward
(``executor/sampler.SamplingBatch``; None: none, or an embedding forward): the one batch the
scheduler hands the executor carries both.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass
class ModelWorkerBatch:
    is_decode: bool  # every sequence extends by one token and none is prefilling
    req_pool_indices: list[int]  # row of each sequence in req_to_token
    prefix_lens: list[int]  # tokens already in the pool, per sequence
    extend_lens: list[int]  # new tokens per sequence
    input_ids: list[int]  # the new tokens of every sequence, packed
    # rows of each sequence whose logits are needed: (start, end) offsets into its new tokens
    logit_ranges: list[tuple[int, int]]
    # sequences sharing a radix-tree prefix: (shared length, members); see AttentionPlan
    prefix_groups: list[tuple[int, list[int]]] | None = None
    # executor.sampler.SamplingBatch (typed Any: it holds a callable, and msgspec builds the
    # tensor-parallel step's decoder from these types); rank 0 only, never sent to others
    sampling: Any = None
    # a hybrid model's batch: each sequence's slot in the state pool (radix_cache/
    # state_pool.py); a sequence with prefix_lens 0 starts from zeros, not its slot
    state_slots: list[int] | None = None
    # a hybrid model's snapshots (radix_cache/snapshot_tree.py): [snapshot slot, own slot]
    # copied before the forward (a cached prefix's state), and [sequence, tokens, slot]:
    # the state after that many of the sequence's new tokens written into slot
    state_restores: list[list[int]] | None = None
    state_saves: list[list[int]] | None = None

    def __len__(self) -> int:
        return len(self.req_pool_indices)

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)
