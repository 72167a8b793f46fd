"""Req: the scheduler's state of one request; ScheduleBatch: the requests of one forward.

KV ownership of a running request (positions of its token sequence)::

    0             prefix_len           kv_len        alloc_len
    |-- tree's ----|---- request's -----|-- spare ----|
    locked through   computed by this     allocated, not yet written
    last_node        request              (rest of the last page)

``prefix_len`` and ``alloc_len`` are page-aligned. ``req_to_token[req_pool_idx, :alloc_len]``
holds the slots. When the request finishes, its computed tokens are inserted into the
tree, duplicates of what the tree already had are freed, and so is the spare tail.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from radixlm.radix_cache.state_pool import state_slots_of
from radixlm.runtime.executor.sampling_params import SamplingParams
from radixlm.runtime.executor.worker_batch import ModelWorkerBatch


class Req:
    """One generation request as the scheduler sees it."""

    def __init__(
        self,
        rid: str,
        input_ids: list[int],
        sampling_params: SamplingParams,
        return_logprob: bool = False,
        logprob_start_len: int = -1,
        top_logprobs_num: int = 0,
        namespace: str | None = None,
        token_ids_logprob: list[int] | None = None,
    ) -> None:
        self.rid = rid
        self.origin_input_ids = input_ids
        self.sampling_params = sampling_params
        self.return_logprob = return_logprob
        # -1: no prompt logprobs (SGLang); otherwise the first prompt position to report
        if return_logprob and logprob_start_len < 0:  # SGLang: only the last prompt token
            logprob_start_len = len(input_ids) - 1
        self.logprob_start_len = (
            min(logprob_start_len, len(input_ids) - 1) if return_logprob else -1)
        self.top_logprobs_num = top_logprobs_num if return_logprob else 0
        # SGLang: logprobs of these ids at each position, with return_logprob only
        self.token_ids_logprob = token_ids_logprob if return_logprob else None
        self.namespace = namespace
        self.priority = 0  # with --enable-priority-scheduling: set from the request
        self.output_ids: list[int] = []
        self.finish_reason: dict[str, Any] | None = None
        self.arrival_time = time.monotonic()
        # KV state (see module docstring)
        self.req_pool_idx: int | None = None
        self.last_node: Any = None
        self.prefix_len = 0
        self.kv_len = 0
        self.alloc_len = 0
        # with the SWA pool: positions [prefix_len, swa_released) have no sliding K/V
        self.swa_released = 0
        self.swa_uuid = 0  # its sliding lock in the tree (0: none)
        # a hybrid model's request: its slot in the state pool while admitted (state_pool.py)
        self.state_slot: int | None = None
        # its first forward copies this snapshot slot into state_slot (a cached prefix)
        self.state_restore: int | None = None
        # snapshots the next forward writes: [pos, slot], the state after pos tokens into
        # slot, which the tree takes when those tokens are inserted (cache_manager.py)
        self.snaps: list[list[int]] = []
        self.branch_pos = 0  # where its K/V match outran its snapshot match (0: it did not)
        self.cached_tokens = 0
        self.storage_cached_tokens = 0  # of cached_tokens, loaded from the storage tier
        self.admitted_once = False
        self.num_retractions = 0
        # prompt logprobs gathered across prefill chunks; sent with the first output
        self.input_token_logprobs: list[tuple[float | None, int]] = []
        self.input_top_logprobs: list[list[tuple[float, int]] | None] = []
        self.input_token_ids_logprobs: list[list[tuple[float, int]] | None] = []
        self.input_logprobs_sent = False
        # a prefill server's request: its first token's logprobs, sent with its KV
        self.first_token_logprobs: tuple | None = None
        self.grammar: Any = None  # a constrained-decoding matcher, when the request has one
        self.grammar_future: Any = None  # its compilation, while the request waits for it
        # prefill/decode disaggregation: the room (rooms.Bootstrap) and its KVSender or
        # KVReceiver (managers/pd_queues.py); None on a request served whole
        self.bootstrap: Any = None
        self.kv_transfer: Any = None
        # --is-embedding: the pooling's hidden states so far (embedding_outputs.py); True
        # for pooling that reads every prompt token (mean, cls), so no cache hit is used
        self.pooled: Any = None
        self.pools_every_token = False
        # speculative decoding (speculative.py): this step's draft tokens, verified after
        # its last token in the same forward, and its SpecState (None: it never decoded
        # with --speculative-algorithm)
        self.draft_ids: list[int] = []
        self.spec: Any = None

    @property
    def fill_ids(self) -> list[int]:
        """Every token whose KV the request needs: prompt plus what it generated."""
        return self.origin_input_ids + self.output_ids

    def tokens(self, start: int, end: int) -> list[int]:
        """``fill_ids[start:end]`` without building the whole list."""
        n = len(self.origin_input_ids)
        if end <= n:
            return self.origin_input_ids[start:end]
        if start >= n:
            return self.output_ids[start - n: end - n]
        return self.origin_input_ids[start:] + self.output_ids[: end - n]

    @property
    def seq_len(self) -> int:
        return len(self.origin_input_ids) + len(self.output_ids)

    @property
    def prompt_len(self) -> int:
        return len(self.origin_input_ids)

    @property
    def is_prefilling(self) -> bool:
        """True while the request still has tokens to extend before it can decode."""
        return self.kv_len < self.seq_len - 1

    @property
    def num_new_tokens(self) -> int:
        """Tokens whose KV the next forward computes (> 1 after a jump-forward, or with
        draft tokens)."""
        return self.seq_len - self.kv_len + len(self.draft_ids)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def wants_input_logprobs(self) -> bool:
        return self.logprob_start_len >= 0 and not self.input_logprobs_sent

    def max_cached_prefix(self) -> int:
        """How much of the sequence a prefix match may cover: the last token must be
        computed for its logits, and so must every prompt position whose logprob is asked
        (or, for mean / cls pooling, whose hidden state is pooled)."""
        limit = self.seq_len - 1
        if self.pools_every_token:  # hidden states are not cached, only K/V
            return 0
        if self.wants_input_logprobs:
            limit = min(limit, max(self.logprob_start_len - 1, 0))
        return limit

    def remaining_new_tokens(self) -> int:
        return max(self.sampling_params.max_new_tokens - len(self.output_ids), 0)

    def on_retracted(self) -> None:
        """Its KV was freed: it keeps its tokens and will recompute their KV."""
        self.num_retractions += 1
        if not self.input_logprobs_sent:
            self.input_token_logprobs, self.input_top_logprobs = [], []
            self.input_token_ids_logprobs = []

    def __repr__(self) -> str:
        return (f"Req(rid={self.rid!r}, prompt={self.prompt_len}, out={len(self.output_ids)}, "
                f"prefix={self.prefix_len}, kv={self.kv_len}, alloc={self.alloc_len})")


@dataclass
class ScheduleBatch:
    """The requests of one forward and how many new tokens each extends by.

    A request with ``extend_lens[i] == 1`` and no prefill left is a decode row. In a
    mixed batch, decode rows and prefill chunks run in one EXTEND forward.
    """

    reqs: list[Req]
    extend_lens: list[int]
    # rows of each request whose logits are needed: (start, end) offsets into its new tokens
    logit_ranges: list[tuple[int, int]] = field(default_factory=list)
    num_prefill: int = 0  # the first ``num_prefill`` requests extend their prompt
    prefix_groups: list[tuple[int, list[int]]] | None = None  # see ModelWorkerBatch

    @property
    def is_decode(self) -> bool:
        return all(n == 1 and not r.is_prefilling for r, n in zip(self.reqs, self.extend_lens))

    @property
    def is_verify(self) -> bool:
        """A decode step (no prefill) in which some rows verify draft tokens."""
        return self.num_prefill == 0 and any(r.draft_ids for r in self.reqs)

    @property
    def num_tokens(self) -> int:
        return sum(self.extend_lens)

    def __len__(self) -> int:
        return len(self.reqs)

    def worker_batch(self, sampling: Any = None) -> ModelWorkerBatch:
        """The executor's view of this step: pool rows, lengths and new tokens, and what
        samples after it (``sampling``: an ``executor.sampler.SamplingBatch``), no requests."""
        input_ids: list[int] = []
        for r, n in zip(self.reqs, self.extend_lens):
            input_ids += r.tokens(r.kv_len, r.kv_len + n - len(r.draft_ids)) + r.draft_ids
        slots = [r.state_slot for r in self.reqs]
        restores, saves = self._state_copies()
        return ModelWorkerBatch(
            is_decode=self.is_decode,
            req_pool_indices=[r.req_pool_idx for r in self.reqs],
            prefix_lens=[r.kv_len for r in self.reqs],
            extend_lens=self.extend_lens,
            input_ids=input_ids,
            logit_ranges=self.logit_ranges,
            prefix_groups=self.prefix_groups,
            sampling=sampling,
            state_slots=None if all(s is None for s in slots) else state_slots_of(slots),
            state_restores=restores,
            state_saves=saves,
        )

    def _state_copies(self) -> tuple[list[list[int]] | None, list[list[int]] | None]:
        """A hybrid model's snapshot copies of this forward: ``[snapshot, own slot]`` to
        restore before it (each once: taken off the request), ``[i, tokens, slot]`` to save
        (the state of sequence ``i`` after ``tokens`` of its new tokens)."""
        restores, saves = [], []
        for i, r in enumerate(self.reqs):
            if r.state_restore is not None:
                restores.append([r.state_restore, r.state_slot])
                r.state_restore = None
            n = self.extend_lens[i]
            saves += [[i, pos - r.kv_len, slot] for pos, slot in r.snaps
                      if r.kv_len < pos <= r.kv_len + n]
        return restores or None, saves or None
