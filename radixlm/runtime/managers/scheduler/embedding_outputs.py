"""After a forward of an embedding server (``--is-embedding``): pool the final hidden
states into each finished request's embedding.

An embedding request is a prefill-only request (``max_new_tokens`` 0): it is admitted,
chunked, batched and cached like any prompt, and finishes when its last prompt token is
computed, with ``{"type": "length", "length": 0}`` as SGLang's. What the forward returns
for it are hidden-state rows instead of logits (``ModelRunner.forward``), picked by
``logit_range``:

    last  the last prompt token, in the chunk that reaches it; cached prefixes are reused
    mean  every prompt token, summed chunk by chunk into ``Req.pooled``
    cls   the first token

The radix cache holds K/V, not hidden states, so mean and cls pooling match no cached
prefix (``Req.pools_every_token``): their prompts are always computed in full.
"""

from __future__ import annotations

from typing import Any

import torch

from radixlm.runtime.executor.pooler import PoolingConfig, finish_pooling
from radixlm.runtime.managers.messages import ReqOutput
from radixlm.runtime.managers.scheduler.schedule_batch import Req, ScheduleBatch

FINISHED = {"type": "length", "length": 0}  # SGLang's finish reason of an embedding


class EmbeddingOutputs:
    def __init__(self, scheduler: Any, config: PoolingConfig) -> None:
        """``scheduler``: the Scheduler (its cache, running list and OutputProcessor)."""
        self.s = scheduler
        self.config = config

    def admit(self, req: Req) -> None:
        """Mark a new request as an embedding; ValueError for one that would generate
        (the front end sends none: it refuses generation on an embedding server)."""
        if req.sampling_params.max_new_tokens != 0 or req.return_logprob:
            raise ValueError("this server serves embeddings (--is-embedding): a request "
                             "must be prefill-only (max_new_tokens 0, no logprobs)")
        req.pools_every_token = self.config.needs_every_token

    def logit_range(self, req: Req, n: int) -> tuple[int, int]:
        """Rows (offsets into the request's ``n`` new tokens) whose hidden states the
        pooling reads."""
        if self.config.method == "mean":
            return 0, n
        if self.config.method == "cls":
            return (0, 1) if req.kv_len == 0 else (n, n)
        return (n - 1, n) if req.kv_len + n == req.seq_len else (n, n)

    def process(self, batch: ScheduleBatch, hidden: torch.Tensor) -> list[ReqOutput]:
        """Pool this forward's rows ``hidden`` [rows, hidden_size]; the requests whose
        prompt is complete finish with their embedding and free their KV into the tree."""
        row = 0
        outs: list[ReqOutput] = []
        for i, (req, n, (a, b)) in enumerate(
                zip(batch.reqs, batch.extend_lens, batch.logit_ranges)):
            assert i < batch.num_prefill, f"embedding request {req.rid} in a decode row"
            req.kv_len += n
            rows = hidden[row: row + b - a]
            row += b - a
            if rows.shape[0]:
                summed = rows.float().sum(dim=0)
                req.pooled = summed if req.pooled is None else req.pooled + summed
            self.s.cache.cache_unfinished(req)  # later prompts share its prefix at once
            if req.kv_len < req.seq_len:  # more of the prompt to come
                continue
            assert req.pooled is not None, f"request {req.rid} pooled no hidden state"
            out = self.s.outputs.finish(req, dict(FINISHED), release=True)
            out.embedding = finish_pooling(req.pooled, req.prompt_len, self.config)
            req.pooled = None
            outs.append(out)
        return outs
