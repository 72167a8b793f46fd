"""Around a forward: what samples after it (``sampling_batch``, with the grammars' masks
filled while it runs), then the sampled tokens appended, stop checks, the grammars' advance
and jump-forward, and the per-request outputs (``process``). Sampling itself is the
executor's (``executor/sampler.py``)."""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from radixlm.runtime.constrained import allocate_token_bitmask
from radixlm.runtime.constrained.jump_forward import canonical_jump
from radixlm.runtime.constrained.jump_search import JumpSearch
from radixlm.runtime.constrained.probe import allows_nothing
from radixlm.runtime.constrained.step_budget import BUDGET_FLAG, StepCost, jump_deadline_s
from radixlm.runtime.executor.sampler import (
    NextTokens,
    PromptLogprobRows,
    PromptLogprobs,
    SamplingBatch,
)
from radixlm.runtime.executor.stop_regex import STOP_REGEX_WINDOW, contains_match
from radixlm.runtime.managers.messages import ReqOutput, SpecCounts
from radixlm.runtime.managers.scheduler.schedule_batch import Req, ScheduleBatch

logger = logging.getLogger(__name__)


class OutputProcessor:
    def __init__(self, scheduler: Any, tokenizer: Any) -> None:
        """``scheduler``: the Scheduler that owns this processor (its cache, running list,
        stats and settings)."""
        self.s = scheduler
        self.tokenizer = tokenizer
        cfg = scheduler.model_config
        eos = set(cfg.eos_token_ids)
        if getattr(tokenizer, "eos_token_id", None) is not None:
            eos.add(tokenizer.eos_token_id)
        self.eos_ids = sorted(eos)
        self.vocab_size = cfg.vocab_size
        self._pending: list[ReqOutput] = []
        self.jump_forward = not scheduler.args.disable_jump_forward
        self._mask_pool = ThreadPoolExecutor(1, thread_name_prefix="grammar-mask")
        # (ids of the rows, their filled bitmask and each row's seconds)
        self._bitmask_job: tuple[list[int], Future[tuple[torch.Tensor, list[float]]]] | None
        self._bitmask_job = None
        self.step_budget_ms = scheduler.args.grammar_step_budget_ms
        # a step's jump-forward searches, off this thread with a deadline (no budget: here)
        self._searches = JumpSearch(jump_deadline_s(self.step_budget_ms)) \
            if self.step_budget_ms else None
        self._mask_s: dict[int, float] = {}  # id(req) -> seconds its mask row took this step

    # --- which logits a forward must produce ----------------------------------------------
    @staticmethod
    def logit_range(req: Req, n: int) -> tuple[int, int]:
        """Rows (offsets into the request's ``n`` new tokens) whose logits are needed: the
        last one if the request samples after this forward (and its draft tokens' rows
        after it), and prompt positions whose logprobs were asked for."""
        k = len(req.draft_ids)
        final = req.kv_len + n - k == req.seq_len
        if not req.wants_input_logprobs:
            return (n - 1 - k, n) if final else (n, n)
        first = max(req.logprob_start_len - 1, 0)
        end = n if final else min(req.prompt_len - 1, req.kv_len + n) - req.kv_len
        return min(max(first - req.kv_len, 0), end), end

    # --- before a forward -----------------------------------------------------------------
    def sampling_batch(self, batch: ScheduleBatch) -> SamplingBatch | None:
        """What the executor samples after this forward (None: nothing, and no prompt
        logprobs); the grammar masks of those rows start filling now, on a worker thread
        while the forward runs (the matchers do not move until then)."""
        rows: list[int] = []
        reqs: list[Req] = []
        prompt: list[PromptLogprobRows] = []
        drafts: list[tuple[int, int, int]] = []
        row = 0
        for i, (req, n, (a, b)) in enumerate(
                zip(batch.reqs, batch.extend_lens, batch.logit_ranges)):
            if req.wants_input_logprobs:
                n_in = min(b, req.prompt_len - 1 - req.kv_len) - a
                if n_in > 0:  # the targets: prompt tokens after positions kv_len + a ..
                    first = req.kv_len + a + 1
                    prompt.append(PromptLogprobRows(
                        i, row, req.origin_input_ids[first: first + n_in],
                        req.top_logprobs_num, req.token_ids_logprob))
            row += b - a
            k = len(req.draft_ids)
            if req.kv_len + n - k == req.seq_len and req.sampling_params.max_new_tokens > 0:
                if k:  # the draft tokens' rows follow the row that samples
                    drafts.append((len(reqs), row - k, k))
                reqs.append(req)
                rows.append(row - 1 - k)
        self._start_bitmask(reqs)
        if not reqs and not prompt:
            return None
        rep = any(r.sampling_params.repetition_penalty != 1.0 for r in reqs)
        return SamplingBatch(
            rows, [r.rid for r in reqs], [r.sampling_params for r in reqs],
            [r.output_ids for r in reqs], [r.origin_input_ids for r in reqs] if rep else [],
            self.eos_ids, [r.top_logprobs_num for r in reqs],
            [r.token_ids_logprob for r in reqs], any(r.return_logprob for r in reqs),
            take_bitmask=lambda: self._take_bitmask(reqs), prompt_logprobs=prompt,
            draft_rows=drafts)

    # --- after a forward ------------------------------------------------------------------
    def process(self, batch: ScheduleBatch, sampled: NextTokens | None) -> list[ReqOutput]:
        """The forward of ``batch`` is done and ``sampled`` holds what the executor sampled
        for ``sampling_batch(batch)``: advance each request, finish or emit it."""
        sample_reqs: list[Req] = []
        done_prefill: list[Req] = []
        for i, (req, n, (a, _)) in enumerate(
                zip(batch.reqs, batch.extend_lens, batch.logit_ranges)):
            kv0 = req.kv_len
            req.kv_len += n - len(req.draft_ids)  # drafts' KV: once verified (speculative.py)
            if req.wants_input_logprobs:
                self._input_logprobs(req, kv0 + a,
                                     sampled.prompt_logprobs.get(i) if sampled else None)
            if i < batch.num_prefill:
                # share the prompt's KV at once: later requests with the same prefix
                # (the rest of a group, n > 1 samples) match it while this one decodes
                self.s.cache.cache_unfinished(req)
            if req.kv_len < req.seq_len:  # more of the prompt to come
                continue
            if req.sampling_params.max_new_tokens == 0:  # prefill only
                done_prefill.append(req)
            else:
                sample_reqs.append(req)
        outs = [self.finish(r, {"type": "length", "length": 0}, release=True)
                for r in done_prefill]
        if sample_reqs:
            assert sampled is not None and len(sampled.next_token_ids) == len(sample_reqs), \
                f"{len(sample_reqs)} rows sample, {sampled and len(sampled.next_token_ids)} sampled"
            outs += self._append_sampled(sample_reqs, sampled)
        # requests that just finished their prompt start decoding; decode rows already are
        prefill = {id(r) for r in batch.reqs[: batch.num_prefill]}
        new = [r for r in sample_reqs if not r.finished and id(r) in prefill]
        self.s.running = [r for r in self.s.running + new if not r.finished]
        return outs

    @staticmethod
    def _input_logprobs(req: Req, first_pos: int, got: PromptLogprobs | None) -> None:
        """Record the logprobs of prompt tokens ``first_pos+1 ..`` (``got``: None when this
        chunk has no such position)."""
        prompt = req.origin_input_ids
        if first_pos == 0 and req.logprob_start_len == 0 and not req.input_token_logprobs:
            req.input_token_logprobs.append((None, prompt[0]))
            req.input_top_logprobs.append(None)
            req.input_token_ids_logprobs.append(None)
        if got is None:
            return
        n = len(got.logprobs)
        targets = prompt[first_pos + 1: first_pos + 1 + n]
        asked = req.token_ids_logprob
        req.input_token_logprobs.extend(zip(got.logprobs, targets))
        req.input_top_logprobs.extend(
            [list(zip(v, i)) for v, i in got.top] if got.top else [None] * n)
        req.input_token_ids_logprobs.extend(
            [_pairs(v, asked) for v in got.asked] if got.asked else [None] * n)

    def _append_sampled(self, reqs: list[Req], out: NextTokens) -> list[ReqOutput]:
        """Each request's sampled token appended and checked, the grammars advanced (and
        jumped forward), the outputs built; a finished request's KV goes to the tree."""
        ids, lps = out.next_token_ids, out.logprobs
        starts = [len(req.output_ids) for req in reqs]
        for i, (req, tok) in enumerate(zip(reqs, ids)):
            if req.draft_ids:
                self._append_verified(req, tok, out.draft_targets[i])
                continue
            req.output_ids.append(tok)
            self.s.stats["generation_tokens"] += 1
            req.finish_reason = self._check_finish(req, tok)
        self._advance_grammars(reqs, ids)
        outs = []
        for i, (req, tok) in enumerate(zip(reqs, ids)):
            new_ids = req.output_ids[starts[i]:]
            top = None
            if out.top_logprobs is not None and req.top_logprobs_num:
                v, t = out.top_logprobs[i]
                top = [list(zip(v, t))]
            asked = None
            if out.token_ids_logprobs is not None and req.token_ids_logprob is not None:
                asked = [_pairs(out.token_ids_logprobs[i], req.token_ids_logprob)]
            if req.return_logprob and self._prefill_side(req):  # the decode server's too
                req.first_token_logprobs = (lps[i], top[0] if top else None,
                                            asked[0] if asked else None)
            outs.append(self._output(req, new_ids, [(lps[i], tok)], top, asked))
            if req.finished:
                self.s.cache.release(req, cache=True)
        return outs

    def _append_verified(self, req: Req, tok: int, targets: list[int]) -> None:
        """A verification's tokens (``tok``, then the drafts' argmax ``targets``) appended
        while its drafts are accepted, each checked for stops like a sampled token: a stop
        drops the tokens after it."""
        appended = 0
        for t in self.s.spec.accepted(req.draft_ids, [tok, *targets]):
            req.output_ids.append(t)
            appended += 1
            req.finish_reason = self._check_finish(req, t)
            if req.finished:
                break
        self.s.stats["generation_tokens"] += appended
        self.s.stats["spec_accepted_tokens"] += appended - 1
        self.s.stats["spec_draft_tokens"] += len(req.draft_ids)
        self.s.spec.after_verify(req, appended, self.s.cache)

    # --- constrained decoding -------------------------------------------------------------
    def _start_bitmask(self, reqs: list[Req]) -> None:
        """Fill the grammar masks of ``reqs``, the rows that will sample after this
        forward, on a worker thread while the forward runs."""
        if not any(r.grammar is not None for r in reqs):
            self._bitmask_job = None
            return
        self._bitmask_job = ([id(r) for r in reqs], self._mask_pool.submit(self._fill, reqs))

    def _take_bitmask(self, reqs: list[Req]) -> torch.Tensor | None:
        job, self._bitmask_job = self._bitmask_job, None
        if job is not None and job[0] == [id(r) for r in reqs]:
            filled = job[1].result()
        else:
            if job is not None:
                job[1].result()  # a batch that changed shape: never leave a fill running
            if not any(r.grammar is not None for r in reqs):
                return None
            filled = self._fill(reqs)
        bitmask, seconds = filled
        self._mask_s = {id(r): s for r, s in zip(reqs, seconds)}
        return bitmask

    def _fill(self, reqs: list[Req]) -> tuple[torch.Tensor, list[float]]:
        """[B, ceil(V / 32)] int32: every token allowed, except in constrained rows; and
        the CPU seconds each row's fill took (its step's mask cost)."""
        bitmask = allocate_token_bitmask(len(reqs), self.vocab_size)
        seconds = [0.0] * len(reqs)
        for i, r in enumerate(reqs):
            if r.grammar is not None:
                start = time.thread_time()  # CPU time, as StepCost counts it
                r.grammar.fill_bitmask(bitmask, i)
                seconds[i] = time.thread_time() - start
        return bitmask, seconds

    def _rejected(self, g: Any, tok: int) -> dict[str, Any]:
        """The finish reason of a row whose sampled token its grammar refused: a 400 when
        the mask allowed nothing (the grammar matches nothing from here, or llguidance hit
        a limit), sampling then picked a forbidden token; else the backend's bug, a 500."""
        row = allocate_token_bitmask(1, self.vocab_size)
        g.fill_bitmask(row, 0)
        if allows_nothing(g, row[0], self.eos_ids):
            error = g.error() if hasattr(g, "error") else ""
            return {"type": "abort", "status_code": 400,
                    "message": "the grammar allows no next token: it matches no string "
                               "from here" + (f" ({error})" if error else "")}
        return {"type": "abort", "status_code": 500,
                "message": f"the grammar backend rejected token {tok} that its own mask "
                           "allowed"}

    def _advance_grammars(self, reqs: list[Req], ids: list[int]) -> None:
        """Move each constrained row's matcher over its token, then jump forward over the
        text its grammar forces (the searches off this thread, ``_jump``); a row whose
        grammar took more than ``--grammar-step-budget-ms`` in this step (its mask, advance
        and jump together) ends with status 400, alone."""
        rows: list[tuple[Req, int, StepCost]] = []
        for req, tok in zip(reqs, ids):
            g = req.grammar
            if g is None or req.finished or self._prefill_side(req):
                continue  # a prefill server's request: the decode server advances its own
            cost = StepCost()
            cost.add("mask", self._mask_s.pop(id(req), 0.0))
            self._accept(req, g, tok, cost)
            rows.append((req, tok, cost))
        if self.jump_forward:
            self._jump([(r, t, c) for r, t, c in rows
                        if not r.finished and not r.return_logprob])
        for req, _, cost in rows:
            message = cost.over(self.step_budget_ms)
            if message is not None and not req.finished:
                logger.warning("request %s: %s", req.rid, message)
                req.finish_reason = {"type": "abort", "status_code": 400, "message": message}

    def _accept(self, req: Req, g: Any, tok: int, cost: StepCost) -> None:
        """Move the matcher over ``tok``; finish the request when only EOS is left."""
        if not cost.timed("advance", g.accept_token, tok):
            req.finish_reason = self._rejected(g, tok)
        elif cost.timed("advance", g.is_terminated):
            req.finish_reason = {"type": "stop", "matched": None}

    def _jump(self, rows: list[tuple[Req, int, StepCost]]) -> None:
        """Each row's forced text (``JumpSearch``: on a worker thread, at most its deadline;
        without a budget, here), then the jumps. A row still searching at the deadline ends
        with 400 and its matcher is left to the search; the rows after it, or every row
        when all search threads are held, skip their jump this step."""
        if not rows:
            return
        if self._searches is None:
            texts = [c.timed("jump-forward", r.grammar.forced_string) for r, _, c in rows]
            stuck = None
        else:
            found = self._searches.run([r.grammar for r, _, _ in rows])
            if found is None:
                return
            texts, stuck = found.texts, found.stuck
            for (_, _, cost), seconds in zip(rows, found.cpu_s):
                cost.add("jump-forward", seconds)
        for k, (req, tok, cost) in enumerate(rows):
            if k == stuck:
                message = (f"the grammar's jump-forward search ran past "
                           f"{self._searches.deadline_s * 1e3:.0f} ms in one decode step, "
                           f"over the per-step budget of {self.step_budget_ms:g} ms "
                           f"({BUDGET_FLAG})")
                logger.warning("request %s: %s", req.rid, message)
                req.grammar = None  # the search thread holds it until it returns
                req.finish_reason = {"type": "abort", "status_code": 400, "message": message}
            elif texts[k] is not None:
                self._apply_jump(req, req.grammar, tok, texts[k], cost)

    def _apply_jump(self, req: Req, g: Any, tok: int, forced: str, cost: StepCost) -> None:
        """Append the text the grammar forces (canonical jump-forward), each forced token
        checked for stops like a sampled one."""
        jump = cost.timed("jump-forward", canonical_jump, g, self.tokenizer, [tok], forced)
        if jump is None:
            return
        del req.output_ids[len(req.output_ids) - jump.rollback:]
        self.s.stats["jump_forward_tokens"] += len(jump.ids)
        for n, forced_id in enumerate(jump.ids):
            req.output_ids.append(forced_id)
            req.finish_reason = self._check_finish(req, forced_id)
            if req.finished:
                g.rollback(len(jump.ids) - n - 1)  # the rest never happened
                return
        if g.is_terminated():
            req.finish_reason = {"type": "stop", "matched": None}

    def _prefill_side(self, req: Req) -> bool:
        """A request this prefill server only computes the prompt and first token of."""
        return req.bootstrap is not None and self.s.args.disaggregation_mode == "prefill"

    def _check_finish(self, req: Req, tok: int) -> dict[str, Any] | None:
        if self._prefill_side(req):
            return None  # the decode server checks the first token (pd_queues)
        sp = req.sampling_params
        if sp.stop_token_ids and tok in sp.stop_token_ids:
            return {"type": "stop", "matched": tok}
        if not sp.ignore_eos and tok in self.eos_ids:
            return {"type": "stop", "matched": tok}
        if sp.stop and len(req.output_ids) >= sp.min_new_tokens:
            matched = self._match_stop_str(req, sp.stop)
            if matched is not None:
                return {"type": "stop", "matched": matched}
        if sp.stop_regex and len(req.output_ids) >= sp.min_new_tokens:
            tail = self.tokenizer.decode(req.output_ids[-STOP_REGEX_WINDOW:],
                                         skip_special_tokens=False)
            for pattern in sp.stop_regex:
                if contains_match(pattern, tail):
                    return {"type": "stop", "matched": pattern}
        if len(req.output_ids) >= sp.max_new_tokens or req.seq_len >= self.s.context_len:
            return {"type": "length", "length": len(req.output_ids)}
        return None

    def _match_stop_str(self, req: Req, stops: list[str]) -> str | None:
        # a stop string of k bytes spans at most k tokens, plus one for a partial character
        window = max(len(s.encode()) for s in stops) + 1
        tail = self.tokenizer.decode(req.output_ids[-window:], skip_special_tokens=False)
        for s in stops:
            if s in tail:
                return s
        return None

    # --- outputs --------------------------------------------------------------------------
    def finish(self, req: Req, reason: dict[str, Any], release: bool) -> ReqOutput:
        req.finish_reason = reason
        out = self._output(req, [], [] if req.return_logprob else None,
                           [] if req.top_logprobs_num else None,
                           [] if req.token_ids_logprob is not None else None)
        if release and req.req_pool_idx is not None:
            self.s.cache.release(req, cache=True)
        return out

    @staticmethod
    def refuse(rid: str, prompt_tokens: int, reason: dict[str, Any]) -> ReqOutput:
        """The only output of a request that never became a Req (it was invalid)."""
        return ReqOutput(rid=rid, new_token_ids=[], prompt_tokens=prompt_tokens,
                         cached_tokens=0, completion_tokens=0, finish_reason=reason)

    def _output(self, req: Req, new_ids: list[int], lps: list | None, top: list | None,
                asked: list | None = None) -> ReqOutput:
        """``asked``: per new token, the (logprob, id) pairs of ``token_ids_logprob``."""
        wants_ids = req.token_ids_logprob is not None
        out = ReqOutput(
            rid=req.rid, new_token_ids=new_ids, prompt_tokens=req.prompt_len,
            cached_tokens=req.cached_tokens, completion_tokens=len(req.output_ids),
            finish_reason=req.finish_reason,
            output_token_logprobs=lps if req.return_logprob else None,
            output_top_logprobs=top if req.top_logprobs_num else None,
            output_token_ids_logprobs=(asked or []) if wants_ids else None,
            storage_cached_tokens=(req.storage_cached_tokens
                                   if self.s.cache.hicache is not None else None))
        if self.s.spec is not None:  # SGLang's meta_info counts (speculative.py)
            st = req.spec
            out.spec = SpecCounts(0, 0, 0) if st is None else SpecCounts(
                st.verify_ct, st.draft_tokens, st.accepted_tokens)
        if req.wants_input_logprobs and req.kv_len >= req.prompt_len:
            out.input_token_logprobs = req.input_token_logprobs
            out.input_top_logprobs = req.input_top_logprobs if req.top_logprobs_num else None
            if wants_ids:
                out.input_token_ids_logprobs = req.input_token_ids_logprobs
            req.input_logprobs_sent = True
        return out

    def emit_later(self, out: ReqOutput) -> None:
        self._pending.append(out)

    def take_pending(self) -> list[ReqOutput]:
        out, self._pending = self._pending, []
        return out


def _pairs(values: list[float], ids: list[int]) -> list[tuple[float, int]] | None:
    """(logprob, id) per asked id; None for an empty list, as SGLang shows one."""
    return list(zip(values, ids)) or None
