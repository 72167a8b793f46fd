"""Sampler: the last step of a forward that generates, its logits into next tokens.

Beside the ``ModelWorkerBatch`` the scheduler hands the model runner a ``SamplingBatch``
(``OutputProcessor.sampling_batch``): which logit rows sample, each row's parameters and
tokens so far, the logprobs asked for (of the sampled tokens and of prompt positions), and
the grammars' vocabulary mask, which the scheduler fills on a worker thread while the
forward runs (``take_bitmask`` waits for it; SGLang's ``sampling_info`` carries its vocab
mask the same way). ``ModelRunner.forward_and_sample`` runs the forward, then
``Sampler.sample``; the scheduler's output processor then only appends the tokens, checks
finishes, advances the grammars and builds the outputs.

The sampler keeps the batch's ``SamplingBatchInfo`` from one step to the next: while the
batch is the same requests, each grown by exactly the token it sampled, that state is
advanced by the token (penalty counts, min-new-tokens, steps) instead of rebuilt from every
output id. Unseeded rows draw from one generator, seeded once by ``--random-seed`` (at
random when unset); a seeded row from ``(seed, step)`` alone (``sampling.exponential_noise``).
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from radixlm.runtime.executor.sampling import (
    SamplingBatchInfo,
    TopLogprobs,
    argmax,
    logprobs_of,
    sample,
)
from radixlm.runtime.executor.sampling_params import SamplingParams

# what a row's tokens were when it sampled: (rid, output length, last output id)
RowKey = tuple[str, int, int | None]


@dataclass
class PromptLogprobRows:
    """Logprobs of prompt tokens ``targets`` from the logit rows ``start ..``, one a target."""

    batch_index: int  # the sequence's index in the forward's batch
    start: int  # its first logit row (into the forward's logits)
    targets: list[int]
    top_k: int  # top logprobs per position (0: none)
    asked: list[int] | None  # token_ids_logprob


@dataclass
class SamplingBatch:
    """The scheduler's description of what samples after one forward (no request objects;
    the lists are the requests' own, read and not kept past the step)."""

    rows: list[int]  # the logit row of each sequence that samples
    rids: list[str]
    params: list[SamplingParams]
    output_ids: list[list[int]]  # each row's generated tokens so far
    prompt_ids: list[list[int]]  # read only when a row has a repetition penalty
    eos_token_ids: list[int]
    top_logprobs_nums: list[int]
    token_ids_logprobs: list[list[int] | None]
    return_logprob: bool  # whether any row returns the logprob of its token
    # the grammars' mask of these rows, [len(rows), ceil(V / 32)] int32 (None: no grammar),
    # waited for once the forward is done
    take_bitmask: Callable[[], torch.Tensor | None] = lambda: None
    prompt_logprobs: list[PromptLogprobRows] = field(default_factory=list)
    # speculative decoding: (index into ``rows``, first logit row, k) of each sequence
    # whose k draft tokens' rows follow its sampling row; their argmax is returned
    draft_rows: list[tuple[int, int, int]] = field(default_factory=list)


@dataclass
class PromptLogprobs:
    """Per target: its logprob, its position's top logprobs, the asked ids' logprobs."""

    logprobs: list[float]
    top: TopLogprobs | None
    asked: list[list[float] | None] | None


@dataclass
class NextTokens:
    next_token_ids: list[int]  # one per sampling row
    logprobs: list[float | None]  # of the sampled token (None when no row asked)
    top_logprobs: TopLogprobs | None
    token_ids_logprobs: list[list[float] | None] | None
    # batch index -> the prompt logprobs of that sequence's rows
    prompt_logprobs: dict[int, PromptLogprobs] = field(default_factory=dict)
    # index into the sampling rows -> the greedy token after each of its draft tokens
    draft_targets: dict[int, list[int]] = field(default_factory=dict)


class Sampler:
    """Next tokens (and logprobs) from a forward's logits; see the module docstring."""

    def __init__(self, vocab_size: int, device: torch.device, seed: int | None) -> None:
        self.vocab_size = vocab_size
        self.generator = torch.Generator(device)
        self.generator.manual_seed(seed if seed is not None else random.getrandbits(63))
        # the last step's state: each row's key as its next step would show it, the info,
        # and the tokens it sampled (to advance it by)
        self._kept: tuple[list[RowKey], SamplingBatchInfo, torch.Tensor] | None = None

    def sample(self, logits: torch.Tensor, batch: SamplingBatch) -> NextTokens:
        """``logits`` [rows, >= vocab] float32: the forward's, of which ``batch.rows``
        sample (and ``batch.prompt_logprobs`` are read)."""
        prompt = {p.batch_index: self._prompt_logprobs(logits, p)
                  for p in batch.prompt_logprobs}
        if not batch.rows:
            return NextTokens([], [], None, None, prompt)
        every = batch.rows == list(range(logits.shape[0]))  # a decode step: no gather
        rows = logits if every else logits[batch.rows]
        info = self._info(batch, rows.device)
        out = sample(rows[:, : self.vocab_size], info)
        ids = out.next_token_ids.tolist()
        self._kept = ([(rid, len(o) + 1, t) for rid, o, t in zip(batch.rids, batch.output_ids,
                                                                    ids)],
                      info, out.next_token_ids)
        lps = out.logprobs.tolist() if out.logprobs is not None else [None] * len(ids)
        return NextTokens(ids, lps, out.top_logprobs, out.token_ids_logprobs, prompt,
                          self._draft_targets(logits, batch.draft_rows))

    def _draft_targets(self, logits: torch.Tensor, draft_rows: list[tuple[int, int, int]]
                       ) -> dict[int, list[int]]:
        """The argmax of each draft token's row, all in one pass (the rows that draft are
        greedy with nothing that changes their logits: ``speculative.Speculator``)."""
        if not draft_rows:
            return {}
        idx = [r for _, start, k in draft_rows for r in range(start, start + k)]
        flat = argmax(logits[idx, : self.vocab_size]).tolist()
        out, at = {}, 0
        for i, _, k in draft_rows:
            out[i], at = flat[at: at + k], at + k
        return out

    def _info(self, batch: SamplingBatch, device: torch.device) -> SamplingBatchInfo:
        """The batch's sampling state: the last step's, advanced by the tokens it sampled,
        while the batch is the same requests each grown by exactly that token; else built
        anew (penalty counts from every output id)."""
        bitmask = batch.take_bitmask()
        kept, self._kept = self._kept, None
        keys = [(rid, len(o), o[-1] if o else None)
                for rid, o in zip(batch.rids, batch.output_ids)]
        if kept is not None and kept[0] == keys:
            info = kept[1]
            info.advance(kept[2])
            info.token_bitmask = bitmask
            return info
        params = batch.params
        rep = any(p.repetition_penalty != 1.0 for p in params)
        return SamplingBatchInfo.from_params(
            params, batch.output_ids, self.vocab_size,
            prompt_ids=batch.prompt_ids if rep else None,
            eos_token_ids=batch.eos_token_ids, top_logprobs_nums=batch.top_logprobs_nums,
            need_logprobs=batch.return_logprob, token_ids_logprobs=batch.token_ids_logprobs,
            token_bitmask=bitmask, generator=self.generator, device=device)

    @staticmethod
    def _prompt_logprobs(logits: torch.Tensor, p: PromptLogprobRows) -> PromptLogprobs:
        n = len(p.targets)
        ids = torch.tensor(p.targets, device=logits.device)
        lps, top, asked = logprobs_of(logits[p.start: p.start + n], ids,
                                      [p.top_k] * n if p.top_k else None,
                                      None if p.asked is None else [p.asked] * n)
        return PromptLogprobs(lps.tolist(), top, asked)
