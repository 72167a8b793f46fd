"""Speculative decoding in the scheduler (``--speculative-algorithm NGRAM``): which running
requests draft, how many, and what of a verification forward they keep.

A decode step of a request with ``k`` drafts ``d1..dk`` is an EXTEND of ``k + 1`` tokens
over its cached KV: its last token ``x`` (no KV yet) and the drafts, at positions
``p .. p + k`` (``p == kv_len``), every one of their logit rows read::

    tokens   x    d1   d2  ...  dk          logits of each row: t0 t1 ... tk
    KV       p   p+1  p+2      p+k          (t_j: the greedy token after row j)

``t0`` is sampled as a plain decode step would sample it (the sampler's row); the others
are the argmax of their rows (``Sampler``: ``SamplingBatch.draft_rows``). Draft ``d_j`` is
accepted while every draft before it was and ``d_j == t_(j-1)``; the request then appends
``t0 .. t_m`` (``m`` drafts accepted, ``t_m`` the bonus token), each checked for stops like a
sampled token (a stop cuts the rest). The KV of ``x, d1 .. d_m`` is the request's; the
rejected positions' pages are freed at once (``CacheManager.free_spare``), and the tree
only ever takes ``fill_ids[:kv_len]``, which holds none of them.

Only greedy requests draft: no logit bias, penalty, grammar, logprobs or pending
``min_new_tokens`` (what makes a row's token differ from its logits' argmax); the others
decode one token a step in the same batch (SGLang samples them through its drafts; that,
and logprobs of accepted tokens, are not done yet).
"""

from __future__ import annotations

from dataclasses import dataclass

from radixlm.runtime.config import ServerArgs
from radixlm.runtime.managers.scheduler.cache_manager import CacheManager
from radixlm.runtime.managers.scheduler.schedule_batch import Req
from radixlm.runtime.managers.scheduler.speculative_ngram import NgramIndex


@dataclass(frozen=True)
class SpecConfig:
    """NGRAM's numbers, derived from ServerArgs (SGLang's defaults)."""

    num_drafts: int  # per verification: --speculative-num-draft-tokens minus one
    min_window: int
    max_window: int

    @classmethod
    def from_args(cls, args: ServerArgs) -> SpecConfig | None:
        """None without ``--speculative-algorithm`` (``config.check_speculative`` refused
        everything but NGRAM already)."""
        if args.speculative_algorithm is None:
            return None
        tokens = args.speculative_num_draft_tokens
        if tokens is None:  # SGLang: num_steps + 1 for a chain, else the largest window
            steps = args.speculative_num_steps
            tokens = (steps + 1 if steps is not None
                      else args.speculative_ngram_max_match_window_size)
        return cls(max(tokens - 1, 1), args.speculative_ngram_min_match_window_size,
                   args.speculative_ngram_max_match_window_size)


@dataclass
class SpecState:
    """One request's drafting state and counts (SGLang's ``meta_info`` fields)."""

    index: NgramIndex
    verify_ct: int = 0  # decode forwards of the request (each verifies 0..k drafts)
    draft_tokens: int = 0  # drafts proposed
    accepted_tokens: int = 0  # of which accepted


class Speculator:
    """Drafts for the running requests before a decode step; the accepted tokens after."""

    def __init__(self, config: SpecConfig, context_len: int) -> None:
        self.config = config
        self.context_len = context_len

    @classmethod
    def from_args(cls, args: ServerArgs, context_len: int, hybrid: bool) -> Speculator | None:
        """None when off. ``hybrid``: the model keeps recurrent state, which a rejected
        draft would have advanced (refused)."""
        config = SpecConfig.from_args(args)
        if config is None:
            return None
        if hybrid:
            raise ValueError("speculative_algorithm NGRAM is not supported yet for hybrid "
                             "models (their recurrent state cannot be rolled back over "
                             "rejected drafts)")
        return cls(config, context_len)

    @staticmethod
    def drafts_for(req: Req) -> bool:
        """Whether ``req``'s next token is its logits' argmax whatever its earlier tokens
        were, so that one forward can verify several."""
        sp = req.sampling_params
        return (sp.is_greedy and req.grammar is None and not req.return_logprob
                and not sp.logit_bias and sp.frequency_penalty == 0
                and sp.presence_penalty == 0 and sp.repetition_penalty == 1.0
                and len(req.output_ids) >= sp.min_new_tokens and req.bootstrap is None)

    def propose(self, reqs: list[Req], cache: CacheManager) -> None:
        """Set ``draft_ids`` of the decode rows ``reqs`` (after the scheduler made room
        for their next token): each a chain of at most ``num_drafts``, none past
        ``max_new_tokens`` or the context; none at all when their pages do not fit
        without retracting anyone."""
        for req in reqs:
            if req.spec is None:
                req.spec = SpecState(NgramIndex(self.config.min_window,
                                                self.config.max_window))
            req.spec.verify_ct += 1
            k = min(self.config.num_drafts, req.remaining_new_tokens() - 1,
                    self.context_len - req.seq_len)
            if k > 0 and self.drafts_for(req):
                req.draft_ids = req.spec.index.propose(req.fill_ids, k)
        need = sum(cache.pages_needed(r, r.num_new_tokens) for r in reqs)
        if not cache.ensure_free(need):  # drafts never retract or abort a request
            for req in reqs:
                req.draft_ids = []

    @staticmethod
    def accepted(drafts: list[int], targets: list[int]) -> list[int]:
        """The tokens a verification appends: ``targets[0]``, then ``targets[j]`` for each
        draft ``drafts[j-1]`` that equals the token before it (greedy acceptance)."""
        out = [targets[0]]
        for j, d in enumerate(drafts):
            if d != out[-1]:
                break
            out.append(targets[j + 1])
        return out

    @staticmethod
    def after_verify(req: Req, appended: int, cache: CacheManager) -> None:
        """``req`` appended ``appended`` tokens of its verification: the drafts among them
        keep their KV (``kv_len`` grows over them), the rest of its pages are freed."""
        assert req.spec is not None and 1 <= appended <= len(req.draft_ids) + 1, (
            req, appended, req.draft_ids)
        req.spec.draft_tokens += len(req.draft_ids)
        req.spec.accepted_tokens += appended - 1
        req.kv_len += appended - 1
        req.draft_ids = []
        cache.free_spare(req)
