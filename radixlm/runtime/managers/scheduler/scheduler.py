"""The scheduler: admit -> build batch -> forward and sample (the executor) -> finish and
emit. No I/O inside.

``step()`` runs one forward and returns what it produced; ``run_loop`` wraps it with
injected I/O functions, so the offline Engine (driven from the caller's thread) and the server
(a process and zmq sockets) run the same loop.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import torch

from radixlm.radix_cache.kv_events import MEDIUM_CPU, MEDIUM_GPU, KVEventBatch, KVEventRecorder
from radixlm.runtime.config import ServerArgs
from radixlm.runtime.constrained.after_text import AfterTextMatcher
from radixlm.runtime.cpu_threads import ThreadSizer
from radixlm.runtime.executor.model_runner import (
    ModelRunner,
    max_running_requests,
    resolve_device,
)
from radixlm.runtime.executor.pooler import PoolingConfig
from radixlm.runtime.managers.messages import (
    AbortReq,
    FlushCacheOutput,
    FlushCacheReq,
    GenerateReqInput,
    GetInfoReq,
    InfoOutput,
    ReqOutput,
    UpdateWeightFromDiskReq,
)
from radixlm.runtime.managers.scheduler.cache_manager import CacheManager
from radixlm.runtime.managers.scheduler.embedding_outputs import EmbeddingOutputs
from radixlm.runtime.managers.scheduler.hicache import build_hicache
from radixlm.runtime.managers.scheduler.output_processor import OutputProcessor
from radixlm.runtime.managers.scheduler.pd_queues import create_queues
from radixlm.runtime.managers.scheduler.schedule_batch import Req, ScheduleBatch
from radixlm.runtime.managers.scheduler.schedule_policy import (
    PrefillAdder,
    SchedulePolicy,
    decode_reserve,
)
from radixlm.runtime.managers.scheduler.scheduler_intake import (
    SchedulerIntake,
    make_grammar_compiler,
)
from radixlm.runtime.managers.scheduler.scheduler_reports import SchedulerReports
from radixlm.runtime.managers.scheduler.scheduler_weights import SchedulerWeightUpdates
from radixlm.runtime.managers.scheduler.speculative import Speculator
from radixlm.runtime.managers.validation import (
    RequestLimits,
)

logger = logging.getLogger(__name__)

INIT_NEW_TOKEN_RATIO, MIN_NEW_TOKEN_RATIO, NEW_TOKEN_RATIO_DECAY = 0.7, 0.1, 0.001
DEFAULT_WEIGHT_VERSION = "default"  # SGLang's --weight-version default


def wants_kv_events(args: ServerArgs) -> bool:
    """Events are recorded when published, or when a cache-aware dispatcher reads them."""
    return args.kv_events() is not None or (
        args.dp_size > 1 and args.balance_method == "cache_aware")


class Scheduler(SchedulerIntake, SchedulerReports, SchedulerWeightUpdates):
    def __init__(self, args: ServerArgs, model_path: str, tokenizer: Any,
                 dp_rank: int = 0, threads: ThreadSizer | None = None,
                 warm_up_grammar: bool = False) -> None:
        """``threads``: this process's torch thread count on a CPU (the server's scheduler
        process passes its own; default: the Engine's, every free core of the budget split
        between its replicas and tensor-parallel ranks). ``warm_up_grammar``: start the
        grammar compile worker before the model loads (a server's scheduler, which waits for
        it before it reports ready: ``grammar_compiler.wait_warm``)."""
        self.args = args
        self.dp_rank = dp_rank  # which of --dp-size replicas this is
        self.threads = threads or ThreadSizer(
            args.cpu_threads, share=args.dp_size * (args.tp_size // args.nnodes))
        self.on_cpu = resolve_device(args.device).type == "cpu"
        if self.on_cpu:
            torch.set_num_threads(self.threads.threads)
        self.grammar_compiler = make_grammar_compiler(args, model_path, tokenizer)
        if warm_up_grammar:
            self.grammar_compiler.warm_up()
        self.model_runner = ModelRunner(args, model_path)
        self.model_config = self.model_runner.model_config
        self.context_len = self.model_config.context_length
        pool = self.model_runner.pool_size
        self.max_running_requests = max_running_requests(args, pool)
        if self.model_runner.state_pool is not None:  # no more than the requests' slots
            self.max_running_requests = min(self.max_running_requests,
                                            self.model_runner.request_state_slots - 1)
        # the tree's KV events: published (--kv-events-config) and/or read by the dispatcher
        self.kv_events = (KVEventRecorder(args.page_size, MEDIUM_GPU if self.model_runner.device
                                          .type == "cuda" else MEDIUM_CPU)
                          if wants_kv_events(args) else None)
        self.kv_event_sinks: list[Callable[[KVEventBatch], Any]] = []
        # a hybrid model's tree keeps recurrent-state snapshots in their own state slots
        # (radix_cache/snapshot_tree.py)
        self.cache = CacheManager(pool, args.page_size, self.max_running_requests + 1,
                                  self.context_len, args.disable_radix_cache,
                                  self.model_runner.device, args.radix_eviction_policy,
                                  self.kv_events, build_hicache(args, self.model_runner,
                                                                model_path,
                                                                DEFAULT_WEIGHT_VERSION),
                                  swa=self.model_runner.swa_spec(),
                                  state_slots=self.model_runner.state_pool_size,
                                  snapshot_slots=self.model_runner.snapshot_state_slots,
                                  inner_snapshots=self.model_runner.inner_snapshots)
        # --speculative-algorithm: drafts verified in the decode forward (speculative.py)
        self.spec = Speculator.from_args(args, self.context_len,
                                         self.model_runner.state_pool is not None)
        self.limits = RequestLimits.from_args(args, self.context_len,
                                              self.model_config.vocab_size, pool)
        priority_sign = (None if not args.enable_priority_scheduling
                         else 1 if args.schedule_low_priority_values_first else -1)
        self.policy = SchedulePolicy(args.schedule_policy, self.cache, priority_sign)
        self.priority_preemption = (args.enable_priority_scheduling
                                    and not args.disable_priority_preemption)
        # namespace label -> [prompt tokens, cached tokens] admitted (namespace_label)
        self.namespace_stats: dict[str, list[int]] = {}
        self.outputs = OutputProcessor(self, tokenizer)
        # --is-embedding: every request is prefill-only and ends with its pooled embedding
        self.embeddings = (EmbeddingOutputs(self, PoolingConfig.from_model_dir(
            self.model_config.model_dir)) if args.is_embedding else None)
        self.grammar_waiting: list[Req] = []  # requests whose grammar is compiling
        self.waiting: list[Req] = []
        self.running: list[Req] = []  # requests that decode
        self.chunked_req: Req | None = None  # at most one request in the middle of prefill
        self.new_token_ratio = INIT_NEW_TOKEN_RATIO
        self.weight_version = DEFAULT_WEIGHT_VERSION
        # a weight update waits for the requests ahead of it; later ones are held until then
        self.weight_update: UpdateWeightFromDiskReq | None = None
        self.held: list[GenerateReqInput] = []
        self.stats: dict[str, float] = dict.fromkeys(
            ("prompt_tokens", "cached_tokens", "generation_tokens", "num_preemptions",
             "forward_steps", "decode_steps", "jump_forward_tokens",
             "num_priority_preemptions", "total_prefill_uncached_tokens",
             "total_prefill_busy_us"), 0)
        if self.spec is not None:  # drafts verified and accepted since start
            self.stats.update(dict.fromkeys(
                ("spec_verify_ct", "spec_draft_tokens", "spec_accepted_tokens"), 0))
        # decode steps' [count, sum b, sum t, sum b^2, sum b*t, sum tokens] (t: step time in
        # us, b: batch size), SGLang's /v1/loads decode_moments: fit t = a + c*b from them
        self.decode_moments = [0.0] * 6
        self._gen_tokens_at_log = 0
        self._last_log_time = time.monotonic()
        self.gen_throughput = 0.0  # tokens/s over the last decode log interval
        self.pd = create_queues(self, args, dp_rank)  # --disaggregation-mode: the transfer queues

    # --- input ------------------------------------------------------------------------
    def handle(self, msg: Any) -> Any:
        """Apply one input message; returns a reply for request/response messages."""
        if isinstance(msg, GenerateReqInput):
            if self.weight_update is not None:
                self.held.append(msg)  # it runs on the new weights
            else:
                self.add_request(msg)
            return None
        if isinstance(msg, AbortReq):
            return self.abort_all() if msg.abort_all else self.abort(msg.rid, msg.message)
        if isinstance(msg, UpdateWeightFromDiskReq):
            return self.request_weight_update(msg)
        if isinstance(msg, FlushCacheReq):
            ok = self.is_idle() and self.cache.flush()
            self.emit_kv_events()  # now, not at the next step: an idle Engine may not step
            return FlushCacheOutput(ok, "" if ok else "requests are running; cache not flushed")
        if isinstance(msg, GetInfoReq):
            info = self.get_info()
            if msg.check_invariants:
                try:
                    self.check_idle_invariants()
                except AssertionError as e:
                    info["invariant_error"] = str(e)
            return InfoOutput(info)
        raise TypeError(f"unexpected message {type(msg).__name__}")

    # --- one step ---------------------------------------------------------------------
    def is_idle(self) -> bool:
        return not (self.waiting or self.running or self.chunked_req or self.grammar_waiting
                    or (self.pd is not None and self.pd.busy()))

    def _poll_grammars(self) -> None:
        """Requests whose grammar compiled join the waiting queue."""
        still = []
        for req in self.grammar_waiting:
            ready = self.grammar_ready(req)
            if ready:
                self.waiting.append(req)
            elif ready is not None:
                still.append(req)
        self.grammar_waiting = still

    def grammar_ready(self, req: Req) -> bool | None:
        """Whether ``req`` has its matcher (True also without a grammar; False: still
        compiling). None: the grammar failed and the request finished as a bad request
        (HTTP 400, ValueError in the Engine), holding no KV."""
        future = req.grammar_future
        if future is None:
            return True
        if not future.done():
            return False
        req.grammar_future = None
        try:
            req.grammar = future.result().new_matcher()
            if req.sampling_params.reasoning_end is not None:  # the answer only
                req.grammar = AfterTextMatcher(req.grammar, req.sampling_params.reasoning_end,
                                               self.outputs.tokenizer)
        except Exception as e:  # noqa: BLE001 - a bad grammar fails its request only
            message = str(e) if isinstance(e, ValueError) else f"invalid grammar: {e!r}"
            reason = {"type": "abort", "message": message, "status_code": 400}
            self.outputs.emit_later(self.outputs.finish(req, reason, release=False))
            return None
        return True

    def step(self) -> list[ReqOutput]:
        if self.on_cpu and (threads := self.threads.resize()) is not None:
            torch.set_num_threads(threads)  # other processes took or left cores
        if self.pd is not None:
            self.pd.poll()  # claimed rooms to waiting, received KV to running
        if self.grammar_waiting:
            self._poll_grammars()
        batch = self._next_batch()
        if batch is None:
            return []
        # what samples after the forward; grammar masks fill while the model runs
        sampling = None if self.embeddings is not None else self.outputs.sampling_batch(batch)
        t0, decode = time.perf_counter(), batch.is_decode
        if self.spec is not None and batch.is_verify:  # a decode step with drafts
            decode = True
        if self.cache.snapshots is not None:  # a hybrid: where its prefill saves its state
            self.cache.snapshots.plan(batch.reqs, batch.extend_lens, batch.num_prefill)
        logits, sampled = self.model_runner.forward_and_sample(
            batch.worker_batch(sampling), self.cache.req_to_token_pool.req_to_token)
        self.stats["forward_steps"] += 1
        outs = (self.embeddings.process(batch, logits) if self.embeddings is not None
                else self.outputs.process(batch, sampled))
        seconds = time.perf_counter() - t0
        self._time_step(batch, decode, seconds)
        if not decode:  # the storage tier's default policy weighs loading against this
            self.cache.observe_prefill(batch.num_tokens, seconds)
        if self.pd is not None:
            self.pd.after_forward()  # prefill server: first tokens sampled, send the KV
        return outs

    def _next_batch(self) -> ScheduleBatch | None:
        prefill = self._prefill_batch()
        mixed = self.args.mixed_chunk
        decodes = self._prepare_decode() if self.running and (prefill is None or mixed) else []
        if prefill is None and not decodes:
            return None
        dec_lens = [r.num_new_tokens for r in decodes]
        if prefill is None:
            self._on_decode_step(len(decodes))
            return ScheduleBatch(decodes, dec_lens,
                                 [(n - 1 - len(r.draft_ids), n) for r, n in zip(decodes, dec_lens)],
                                 prefix_groups=self._prefix_groups(decodes))
        reqs, lens = prefill.reqs + decodes, prefill.extend_lens + dec_lens
        range_of = (self.embeddings or self.outputs).logit_range
        ranges = [range_of(r, n) for r, n in zip(reqs, lens)]
        self._log_prefill(prefill)
        return ScheduleBatch(reqs, lens, ranges, num_prefill=len(prefill.reqs),
                             prefix_groups=self._prefix_groups(reqs))

    def _prefix_groups(self, reqs: list[Req]) -> list[tuple[int, list[int]]] | None:
        if not self.model_runner.uses_torch_attention or len(reqs) < 2:
            return None
        return self.cache.shared_prefix_groups(reqs) or None

    def _prefill_batch(self) -> PrefillAdder | None:
        if not self.waiting and self.chunked_req is None:
            return None
        chunk = self.args.chunked_prefill_size
        budget = None if chunk == -1 else chunk
        if budget is not None and self.args.mixed_chunk:
            budget = max(budget - len(self.running), 1)
        adder = PrefillAdder(self.cache, self.running, self.new_token_ratio, budget,
                             self.args.max_prefill_tokens)
        if self.chunked_req is not None:
            req, self.chunked_req = self.chunked_req, None
            adder.add_chunked(req)
            if not adder.reqs:  # could not get memory for the next chunk: try again later
                self.chunked_req = req
        if adder.chunked_req is None and self.waiting:
            self._admit_waiting(adder)
        self.chunked_req = adder.chunked_req or self.chunked_req
        return adder if adder.reqs else None

    def _admit_waiting(self, adder: PrefillAdder) -> None:
        admitted: set[str] = set()
        for req in self.policy.order(self.waiting, ahead=adder.reqs):
            if not self.cache.storage_ready(req):
                continue  # its pages are loading from storage (the prefetch policy)
            if not self._fits(req, adder) and not self._preempt_for(req, adder):
                break
            admitted.add(req.rid)
            self.stats["prompt_tokens"] += req.seq_len
            self.stats["cached_tokens"] += req.prefix_len
            self._count_namespace(req)
            if adder.full():
                break
        self.waiting = [r for r in self.waiting if r.rid not in admitted]

    def _fits(self, req: Req, adder: PrefillAdder) -> bool:
        """Admit ``req`` into this prefill if a running slot and its memory are free."""
        running = len(self.running) + len(adder.reqs) + (self.chunked_req is not None)
        return running < self.max_running_requests and adder.add(req)

    def _preempt_for(self, req: Req, adder: PrefillAdder) -> bool:
        """Priority preemption (SGLang): retract running requests less urgent than ``req``
        by more than the threshold, least urgent first, if that makes room for it; then
        admit it. Nothing is retracted when even all of them would not make room."""
        if not self.priority_preemption or adder.full():
            return False
        victims = self.policy.preemption_victims(
            req, self.running, self.args.priority_scheduling_preemption_threshold)
        short = adder.estimated_cost(req) - adder.rem_total()
        rows = (len(self.running) + len(adder.reqs) + (self.chunked_req is not None) + 1
                - self.max_running_requests)
        chosen: list[Req] = []
        for victim in victims:
            if short <= 0 and rows <= 0:
                break
            chosen.append(victim)
            short -= (victim.alloc_len - victim.prefix_len
                      + decode_reserve(victim, self.new_token_ratio))
            rows -= 1
        if not chosen or short > 0 or rows > 0:
            return False
        for victim in chosen:
            self.running.remove(victim)
            adder.unreserve(victim)
            self.cache.release(victim, cache=True)  # its KV stays in the tree, evictable
            victim.on_retracted()
            self.waiting.append(victim)
            self.stats["num_priority_preemptions"] += 1
            logger.info("request %s (priority %d) preempted by %s (priority %d)", victim.rid,
                        victim.priority, req.rid, req.priority)
        return self._fits(req, adder)

    def _prepare_decode(self) -> list[Req]:
        """KV slots for the next token(s) of every running request (more than one after a
        jump-forward); evict, then retract, if short."""
        reqs = sorted(self.running, key=lambda r: (len(r.output_ids), -r.prompt_len))
        need = sum(self.cache.pages_needed(r, r.num_new_tokens) for r in reqs)
        while not self.cache.ensure_free(need) and len(reqs) > 1:
            victim = reqs.pop(0)
            self._retract(victim)
            need = sum(self.cache.pages_needed(r, r.num_new_tokens) for r in reqs)
        if self.spec is not None:
            self.spec.propose(reqs, self.cache)
            self.stats["spec_verify_ct"] += len(reqs)
        if not self.cache.alloc_many(reqs, [r.num_new_tokens for r in reqs]):
            # only a lone request is left and even it cannot grow: out of memory
            for r in reqs:
                self.running.remove(r)
                self.outputs.emit_later(self.outputs.finish(
                    r, {"type": "abort", "message": "out of KV cache memory"}, release=True))
            reqs = []
        kept = set(map(id, reqs))
        return [r for r in self.running if id(r) in kept]

    def _retract(self, req: Req) -> None:
        self.running.remove(req)
        self.cache.release(req, cache=False)
        req.on_retracted()
        self.waiting.insert(0, req)
        self.cache.prefetch(req)  # its pages may be in storage now: load them again
        self.stats["num_preemptions"] += 1
        self.new_token_ratio = 1.0
        logger.warning("KV cache full: retracted request %s (%d running left)", req.rid,
                       len(self.running))

    def _on_decode_step(self, batch_size: int) -> None:
        self.stats["decode_steps"] += 1
        self.new_token_ratio = max(self.new_token_ratio - NEW_TOKEN_RATIO_DECAY,
                                   MIN_NEW_TOKEN_RATIO)
        if self.stats["decode_steps"] % self.args.decode_log_interval == 0:
            self._log_decode(batch_size)

    # --- the loop -----------------------------------------------------------------------
    @torch.inference_mode()
    def run_loop(self, recv: Callable[[bool], list[Any]], send: Callable[[Any], None],
                 should_stop: Callable[[], bool]) -> None:
        """``recv(block)`` returns new messages (blocking while idle); ``send`` gets replies
        and lists of ReqOutput."""
        while not should_stop():
            self.run_once(recv(self.is_idle()), send)

    def run_once(self, msgs: list[Any], send: Callable[[Any], None]) -> bool:
        """One turn of the loop: apply ``msgs``, run one step, ``send`` what came out.
        Returns whether anything was produced."""
        for msg in msgs:
            reply = self.handle(msg)
            if reply is not None:
                send(reply)
        busy = not self.is_idle()
        outs = self.step()
        outs = self.outputs.take_pending() + outs
        # what the step cached reaches a dispatcher before the outputs that end requests:
        # once it hears a request finished, it knows where its prompt is
        self.emit_kv_events()
        if outs:
            send(outs)
        if self.weight_update is not None and self.is_idle():
            send(self._apply_weight_update())
        if busy and self.is_idle():  # a KV leak shows here, not hours later
            self.check_idle_invariants(deep=False)
        elif self.grammar_waiting and not (self.waiting or self.running):
            time.sleep(0.001)  # only compiles in flight: do not spin on the GIL
        elif self.waiting and not (outs or self.running or self.chunked_req):
            self.cache.wait_storage(0.002)  # the queue waits for storage: nap, do not spin
        elif self.pd is not None and self.pd.busy() and not (outs or self.waiting
                                                             or self.running or self.chunked_req):
            self.pd.wait(0.005)  # only transfers in flight: nap until a message arrives
        self.emit_kv_events()
        return bool(outs)

    def emit_kv_events(self) -> None:
        """Hand this turn's tree events, as one batch, to every sink (once per step)."""
        if self.kv_events is None or not self.kv_events.pending():
            return
        batch = self.kv_events.take_batch()
        assert batch is not None
        for sink in self.kv_event_sinks:
            sink(batch)
