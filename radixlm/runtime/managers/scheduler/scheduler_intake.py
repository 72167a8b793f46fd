"""The scheduler's request intake: a new request is checked and queued (or handed to the
PD transfer queues), the ``--max-queued-requests`` limit under priority scheduling, and
aborts wherever a request is."""

from __future__ import annotations

import logging
from typing import Any

from radixlm.runtime.config import ServerArgs
from radixlm.runtime.constrained import GrammarCompiler, create_grammar_backend
from radixlm.runtime.disaggregation.rooms import Bootstrap
from radixlm.runtime.executor.sampling_params import SamplingParams
from radixlm.runtime.managers.messages import GenerateReqInput
from radixlm.runtime.managers.scheduler.cache_manager import CacheManager
from radixlm.runtime.managers.scheduler.embedding_outputs import EmbeddingOutputs
from radixlm.runtime.managers.scheduler.output_processor import OutputProcessor
from radixlm.runtime.managers.scheduler.pd_queues import DecodeQueues, PrefillQueues
from radixlm.runtime.managers.scheduler.schedule_batch import Req
from radixlm.runtime.managers.scheduler.schedule_policy import SchedulePolicy
from radixlm.runtime.managers.tokenizer_manager.tenant_rids import rid_tenant
from radixlm.runtime.managers.tokenizer_manager.tokenize_pool import chars_per_token
from radixlm.runtime.managers.validation import RequestLimits, validate_request
from radixlm.runtime.model_config import ModelConfig

logger = logging.getLogger(__name__)

# SGLang's finish reasons of an abort: FINISH_ABORT() for a running request, the tokenizer
# manager's for a queued one
ABORT_RUNNING = {"type": "abort", "message": "Aborted", "status_code": None, "err_type": None}
ABORT_WAITING = {"type": "abort", "message": "Abort in waiting queue"}


def make_grammar_compiler(args: ServerArgs, model_path: str, tokenizer: Any) -> GrammarCompiler:
    """The scheduler's grammar compiler: from config.json's vocabulary, stop tokens and
    context alone, so it (and its compile worker) can start before the model loads."""
    config = ModelConfig.from_hf(model_path, dtype=args.dtype,
                                 context_length=args.context_length)
    return GrammarCompiler(
        create_grammar_backend(args.grammar_backend, tokenizer, config.vocab_size,
                               config.eos_token_ids),
        max_cache_entries=args.grammar_cache_size, timeout_s=args.grammar_compile_timeout,
        memory_mb=args.grammar_compile_memory_mb, step_budget_ms=args.grammar_step_budget_ms,
        max_match_chars=config.context_length * chars_per_token(tokenizer))


class SchedulerIntake:
    """Mixed into ``Scheduler``, which sets the state below in its ``__init__``."""

    args: ServerArgs
    cache: CacheManager
    policy: SchedulePolicy
    limits: RequestLimits
    grammar_compiler: GrammarCompiler
    outputs: OutputProcessor
    embeddings: EmbeddingOutputs | None  # --is-embedding
    pd: PrefillQueues | DecodeQueues | None  # --disaggregation-mode
    grammar_waiting: list[Req]
    waiting: list[Req]
    running: list[Req]
    chunked_req: Req | None
    held: list[GenerateReqInput]  # arrived while a weight update waits

    def add_request(self, msg: GenerateReqInput) -> None:
        """Queue a request. One the front end should have refused (it checks the same
        things) finishes at once with a 400; it never reaches a batch."""
        try:
            params = SamplingParams.from_dict(msg.sampling_params)
            req = Req(msg.rid, list(msg.input_ids), params, msg.return_logprob,
                      msg.logprob_start_len, msg.top_logprobs_num, msg.namespace,
                      msg.token_ids_logprob)
            self.check_request(req)
            if self.embeddings is not None:
                self.embeddings.admit(req)
            req.priority = msg.priority
        except Exception as e:  # noqa: BLE001 - a bad request fails alone, the loop goes on
            logger.warning("request %s refused by the scheduler: %r", msg.rid, e)
            reason = {"type": "abort", "message": f"invalid request: {e}", "status_code": 400}
            self.outputs.emit_later(self.outputs.refuse(msg.rid, len(msg.input_ids), reason))
            return
        if msg.bootstrap_room is not None and self.pd is not None:
            self._add_disaggregated(msg, req)
            return
        if not self._room_in_queue(req):
            return
        grammar = params.grammar
        if grammar is not None:
            req.grammar_future = self.grammar_compiler.submit(*grammar,
                                                              owner=rid_tenant(req.rid))
            self.grammar_waiting.append(req)
        else:
            self.waiting.append(req)
        self.cache.prefetch(req)  # --enable-hierarchical-cache: pages from storage

    def _add_disaggregated(self, msg: GenerateReqInput, req: Req) -> None:
        """A request with a room goes to the transfer queues (its grammar compiling
        meanwhile: both servers build it, the prefill to constrain the first token, the
        decode to go on from it)."""
        if req.sampling_params.grammar is not None:
            req.grammar_future = self.grammar_compiler.submit(*req.sampling_params.grammar,
                                                              owner=rid_tenant(req.rid))
        req.bootstrap = Bootstrap(msg.bootstrap_host or "", msg.bootstrap_port or 0,
                                  msg.bootstrap_room, msg.prefill_dp_rank)
        self.pd.add(req)

    def _room_in_queue(self, req: Req) -> bool:
        """``--max-queued-requests`` with priority scheduling, enforced here (the front end
        cannot see who is queued): a full queue drops its least urgent request for a
        strictly more urgent ``req``, else refuses ``req``; either gets a 503."""
        limit = self.args.max_queued_requests
        if (limit is None or self.policy.priority_sign is None
                or len(self.waiting) + len(self.grammar_waiting) < limit):
            return True
        victim = self.policy.queue_victim(req, [*self.waiting, *self.grammar_waiting])
        if victim is None:
            reason = {"type": "abort", "status_code": 503, "message":
                      f"the request queue is full: the limit is {limit} (--max-queued-requests)"}
            self.outputs.emit_later(self.outputs.refuse(req.rid, len(req.origin_input_ids),
                                                        reason))
            return False
        (self.waiting if victim in self.waiting else self.grammar_waiting).remove(victim)
        logger.info("queued request %s (priority %d) dropped for %s (priority %d)",
                    victim.rid, victim.priority, req.rid, req.priority)
        reason = {"type": "abort", "status_code": 503, "message": "aborted by a more urgent "
                  f"request: the queue is full ({limit}, --max-queued-requests)"}
        self.outputs.emit_later(self.outputs.finish(victim, reason, release=False))
        return True

    def check_request(self, req: Req) -> None:
        """What the scheduler relies on; raises ValueError (the front end checked it too)."""
        validate_request(req.origin_input_ids, req.sampling_params, self.limits,
                         req.top_logprobs_num, req.token_ids_logprob)

    def abort(self, rid: str, message: str | None = None) -> None:
        """Stop ``rid`` wherever it is; its KV goes back (computed tokens to the tree).
        Without ``message`` the finish reason is SGLang's."""
        if self.pd is not None and self.pd.abort(rid, message):
            return None
        held = next((m for m in self.held if m.rid == rid), None)
        if held is not None:
            self.held.remove(held)
            reason = {"type": "abort", "message": message or ABORT_WAITING["message"]}
            self.outputs.emit_later(self.outputs.refuse(rid, len(held.input_ids), reason))
            return None
        for queue in (self.waiting, self.grammar_waiting):
            req = next((r for r in queue if r.rid == rid), None)
            if req is not None:
                queue.remove(req)
                reason = {**ABORT_WAITING, "message": message or ABORT_WAITING["message"]}
                self.outputs.emit_later(self.outputs.finish(req, reason, release=False))
                return None
        for req in [*self.running, *([self.chunked_req] if self.chunked_req else [])]:
            if req.rid == rid:
                if req is self.chunked_req:
                    self.chunked_req = None
                else:
                    self.running.remove(req)
                reason = {**ABORT_RUNNING, "message": message or ABORT_RUNNING["message"]}
                self.outputs.emit_later(self.outputs.finish(req, reason, release=True))
                return None
        return None

    def abort_all(self) -> None:
        """SGLang's ``abort_all``: every queued and running request (not those held for a
        weight update: they came after it)."""
        queued = [*self.waiting, *self.grammar_waiting]
        active = [*self.running, *([self.chunked_req] if self.chunked_req else [])]
        self.waiting, self.grammar_waiting, self.running, self.chunked_req = [], [], [], None
        if self.pd is not None:
            self.pd.abort_all()
        for req in queued:
            self.outputs.emit_later(self.outputs.finish(req, dict(ABORT_WAITING), False))
        for req in active:
            self.outputs.emit_later(self.outputs.finish(req, dict(ABORT_RUNNING), True))
