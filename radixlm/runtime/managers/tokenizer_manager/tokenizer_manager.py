"""The tokenizer manager: the server process's side of the pipeline (asyncio).

It tokenizes and validates requests, sends them to the scheduler process, and routes
the detokenizer's TextOutputs to one asyncio queue per request. A request whose
consumer goes away (client disconnect, cancelled task) is aborted in the scheduler.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from radixlm.runtime.config import ServerArgs
from radixlm.runtime.executor.sampling_params import sample_sampling_params, sampling_defaults
from radixlm.runtime.managers.api_error import ApiError
from radixlm.runtime.managers.data_parallel.data_parallel_controller import DataParallelController
from radixlm.runtime.managers.data_parallel.load_balancer import NoReplica
from radixlm.runtime.managers.messages import (
    AbortReq,
    GenerateReqInput,
    ReplicaKVEvents,
    ReplicaLoad,
    SchedulerReady,
    TextBatch,
    TextOutput,
    UpdateWeightFromDiskOutput,
    decode,
    encode,
)
from radixlm.runtime.managers.tokenizer_manager.admission import Admission, Prepared, with_rooms
from radixlm.runtime.managers.tokenizer_manager.control_calls import CONTROL_REPLIES, ControlCalls
from radixlm.runtime.managers.tokenizer_manager.heap_trim import HeapTrimmer
from radixlm.runtime.managers.tokenizer_manager.request_log import (
    RequestLog,
    RequestOrigin,
    Timings,
)
from radixlm.runtime.managers.tokenizer_manager.result import ResultBuilder
from radixlm.runtime.managers.tokenizer_manager.tenant_rids import (
    abort_matches,
    client_rid,
    scoped_rid,
)
from radixlm.runtime.managers.tokenizer_manager.tokenize_pool import TextBounds, TokenizePool
from radixlm.runtime.managers.validation import RequestLimits
from radixlm.runtime.metrics import ServerMetrics

logger = logging.getLogger(__name__)


@dataclass
class ReqState:
    msg: GenerateReqInput
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    created: float = field(default_factory=time.monotonic)
    last_token_time: float | None = None
    finished: bool = False
    labels: tuple[str, ...] | None = ()  # custom metric label values; None: no metrics
    weight_version: str = ""  # of the weights that computed its latest output
    first_token_time: float | None = None
    origin: RequestOrigin | None = None  # set when the request log is on


class TokenizerManager(Admission, ControlCalls):
    """Requests in (``Admission`` checks them), outputs routed back per request, control
    calls to the replicas (``ControlCalls``)."""

    def __init__(
        self, args: ServerArgs, model_path: str, tokenizer: Any, sched_addr: str | list[str],
        recv_addr: str,
    ) -> None:
        self.args = args
        self.model_path = model_path
        self.tokenizer = tokenizer
        self.metrics = ServerMetrics(args.tokenizer_metrics_allowed_custom_labels or (),
                                     args.served_model_name or model_path)
        self.request_log = RequestLog.from_args(args)
        self.sampling_defaults = sampling_defaults(args, model_path)
        # one scheduler per data-parallel replica; requests go where the dispatcher says
        self.dp = DataParallelController(
            args, [sched_addr] if isinstance(sched_addr, str) else sched_addr)
        self._pull_ctx = zmq.asyncio.Context()
        self._pull = self._pull_ctx.socket(zmq.PULL)
        self._pull.setsockopt(zmq.RCVHWM, 0)
        self._pull.bind(recv_addr)
        self.states: dict[str, ReqState] = {}
        self._waiters: dict[tuple[type, int], collections.deque] = {
            (kind, rank): collections.deque()
            for kind in CONTROL_REPLIES
            for rank in range(self.dp.dp_size)
        }
        self.weight_version = ""  # the scheduler's, known once it is ready
        self._update_lock = asyncio.Lock()  # one weight update at a time
        self.server_info: dict[str, Any] = {}  # the scheduler's info at startup
        self.replica_model_info: dict[int, dict[str, Any]] = {}  # per dp_rank (pid, device)
        self.model_info: dict[str, Any] = {}
        self.draining = False
        self.unhealthy: str | None = None  # why, once the watchdog found the scheduler stuck
        self.limits: RequestLimits | None = None  # known once the scheduler is ready
        self._loop_task: asyncio.Task | None = None
        self.tokenize_pool = TokenizePool(tokenizer)
        self.text_bounds: TextBounds | None = None  # known once the scheduler is ready
        self.heap = HeapTrimmer()  # gives back what large logprob answers freed

    # --- startup and the receive loop -----------------------------------------------------
    async def wait_ready(self, timeout: float, alive: Any) -> None:
        """Wait for the scheduler's ready message; ``alive()`` is false if a child died."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not alive():
                raise RuntimeError("a server process exited during startup (see its log)")
            if await self._pull.poll(200):
                msg = decode(await self._pull.recv())
                if isinstance(msg, SchedulerReady):
                    self.replica_model_info[msg.dp_rank] = msg.model_info
                    if msg.dp_rank == 0:
                        self._ready(msg)
                    if len(self.replica_model_info) == self.dp.dp_size:
                        return
                elif isinstance(msg, ReplicaLoad):
                    self.dp.balancer.on_load(msg)
        raise TimeoutError(f"the scheduler was not ready after {timeout} s")

    def _ready(self, msg: SchedulerReady) -> None:
        """Replica 0's info stands for the server's (the replicas have the same settings)."""
        self.server_info, self.model_info = msg.info, msg.model_info
        self.weight_version = msg.info.get("weight_version", "")
        self.limits = RequestLimits.from_args(
            self.args, msg.info["context_length"], msg.model_info["vocab_size"],
            msg.info["max_total_num_tokens"])
        self.text_bounds = TextBounds(msg.info["context_length"],
                                      self.tokenize_pool.chars_per_token,
                                      self.args.max_batch_prompts, self.args.max_chat_messages)

    def start(self) -> None:
        self._loop_task = asyncio.get_running_loop().create_task(self._recv_loop())

    async def _recv_loop(self) -> None:
        while True:
            msg = decode(await self._pull.recv())
            if isinstance(msg, TextBatch):
                self._dispatch(msg)
            elif isinstance(msg, ReplicaLoad):
                self.dp.balancer.on_load(msg)
            elif isinstance(msg, ReplicaKVEvents):
                self.dp.on_kv_events(msg)
            elif (type(msg), getattr(msg, "dp_rank", 0)) in self._waiters:
                if isinstance(msg, UpdateWeightFromDiskOutput):  # before any later output
                    self.weight_version = msg.weight_version
                waiters = self._waiters[(type(msg), msg.dp_rank)]
                while waiters:
                    fut = waiters.popleft()
                    if not fut.done():
                        fut.set_result(msg)
                        break

    def _dispatch(self, batch: TextBatch) -> None:
        now = time.monotonic()
        self.metrics.on_queue_times(batch.queue_times)
        for out in batch.outputs:
            state = self.states.get(out.rid)
            if state is None:
                continue
            state.weight_version = self.weight_version  # replies arrive in the loop's order
            self._observe(state, out, now)
            if out.finished:
                state.finished = True
                self.dp.balancer.finished(out.rid)
                self.heap.note_finished(state.msg, out)
            state.queue.put_nowait(out)

    def _observe(self, state: ReqState, out: TextOutput, now: float) -> None:
        """Request metrics, with the request's custom labels (unless log_metrics=false)."""
        labels = state.labels
        if out.new_token_ids:
            last, state.last_token_time = state.last_token_time, now
            if last is None:
                state.first_token_time = now
            if labels is not None and last is None:
                self.metrics.on_first_token(now - state.created, labels)
            elif labels is not None:
                self.metrics.on_tokens(now - last, len(out.new_token_ids), labels)
        if not out.finished:
            return
        timings = Timings(state.created, state.first_token_time, now, out.completion_tokens)
        if labels is not None:
            self.metrics.on_finish(out.finish_reason, now - state.created, labels,
                                   out=out, tpot=timings.latency()["tpot"])
        if self.request_log is not None and state.origin is not None:
            self.request_log.add(state.msg, state.origin, out, timings)
            state.origin = None  # one record per request

    def log_origin(self, route: str, prompt: str | list[dict[str, str]] | None = None,
                   tenant: str | None = None, stream: bool = False) -> RequestOrigin | None:
        """What the request log records of a request's HTTP side (None when it is off)."""
        if self.request_log is None:
            return None
        return RequestOrigin(route, prompt, tenant, stream)

    def close(self) -> None:
        if self._loop_task is not None:
            self._loop_task.cancel()
        self.tokenize_pool.close()
        if self.request_log is not None:
            self.request_log.close()
        self.dp.close()
        self._pull.close(linger=0)
        self._pull_ctx.term()

    # --- requests ---------------------------------------------------------------------------
    async def encode_text(self, text: str, add_special_tokens: bool = False,
                          param: str = "text") -> list[int]:
        """Token ids of ``text``; 400 if it cannot fit the context (before tokenizing)."""
        return (await self.encode_texts([text], add_special_tokens, param))[0]

    async def encode_texts(self, texts: list[str], add_special_tokens: bool = False,
                           param: str = "text") -> list[list[int]]:
        """Token ids of each text (``tokenize_pool.py``: bounded, off the event loop); 400
        beyond ``--max-batch-prompts`` texts or for a text longer than the context."""
        bounds = self.text_bounds
        assert bounds is not None, "encode_texts before the scheduler was ready"
        bounds.check_count(len(texts), param)
        for t in texts:
            bounds.check_text(t, param)
        return await self.tokenize_pool.encode(texts, add_special_tokens)

    async def submit(self, items: list[Prepared]) -> list[ReqState]:
        """Send every request (each of its ``n`` samples); n > 1 first caches the prompt
        once, so the samples share its KV. Every message is encoded before any state is
        registered, so a request that cannot be sent leaves nothing behind."""
        subs: list[GenerateReqInput] = []
        labels: list[tuple[str, ...] | None] = []
        origins: list[RequestOrigin | None] = []
        for p in items:
            n = p.params.n
            samples = [p.msg] if n == 1 else [
                msgspec.structs.replace(p.msg, rid=f"{p.msg.rid}-{j}", sampling_params=(
                    sample_sampling_params(p.msg.sampling_params, j))) for j in range(n)]
            subs += with_rooms(samples, p.bootstrap)
            labels += [p.labels] * n
            origins += [p.origin] * n
        await self._build_stop_automata(items)
        self.check_capacity(len(subs))
        if len({m.rid for m in subs}) != len(subs) or any(m.rid in self.states for m in subs):
            raise ApiError(400, "rid is already in use", param="rid")
        wire = [self._encode(m) for m in subs]
        if not self.args.disable_radix_cache:
            for p in items:
                # a decode server never computes a prompt: its samples' KV is sent
                decode = p.bootstrap is not None and self.args.disaggregation_mode == "decode"
                if p.params.n > 1 and not decode:
                    warm = GenerateReqInput(
                        p.msg.rid + "-prefill", p.msg.input_ids, {"max_new_tokens": 0},
                        namespace=p.msg.namespace,
                    )
                    async for out in self.outputs(self._send_req(warm, self._encode(warm))):
                        p.prompt_cached_tokens = out.cached_tokens
        states = [self._send_req(m, data, lab) for m, data, lab in zip(subs, wire, labels)]
        for state, origin in zip(states, origins):
            state.origin = origin
        return states

    @staticmethod
    async def _build_stop_automata(items: list[Prepared]) -> None:
        """The stop_regex automata, built on a worker thread: bounded by their limits, but
        pure Python that would hold the event loop for up to about 0.2 s a pattern."""
        for p in items:
            if p.params.stop_regex:
                try:
                    await asyncio.to_thread(p.params.build_stop_automata)
                except ValueError as e:
                    raise ApiError(400, str(e), param="stop_regex") from None

    @staticmethod
    def _encode(msg: GenerateReqInput) -> bytes:
        try:
            return encode(msg)
        except (OverflowError, TypeError, ValueError, msgspec.EncodeError) as e:
            raise ApiError(400, f"the request cannot be encoded: {e}") from None

    def _send_req(self, msg: GenerateReqInput, data: bytes,
                  labels: tuple[str, ...] | None = ()) -> ReqState:
        state = ReqState(msg, labels=labels)
        try:
            self.dp.send_req(msg, data)
        except NoReplica as e:
            raise ApiError(503, f"{e}: {self.dp.dead}", "service_unavailable") from None
        self.states[msg.rid] = state
        return state

    async def outputs(self, state: ReqState) -> AsyncIterator[TextOutput]:
        """The request's outputs until it finishes; leaving early aborts it."""
        try:
            while True:
                out = await state.queue.get()
                status = (out.finish_reason or {}).get("status_code")
                if status is not None:  # a bad grammar, a stuck scheduler, a failed decode
                    state.finished = status < 500  # the scheduler may still hold a 5xx one
                    kind = ("invalid_request_error" if status < 500 else
                            "service_unavailable" if status == 503 else "server_error")
                    raise ApiError(status, out.finish_reason.get("message", "request failed"),
                                   kind)
                yield out
                if out.finished:
                    return
        finally:
            self.states.pop(state.msg.rid, None)
            if not state.finished:
                self.abort(state.msg.rid)
                self._log_abandoned(state)

    def _log_abandoned(self, state: ReqState) -> None:
        """The request log's record of a request whose client left before it finished."""
        if self.request_log is None or state.origin is None:
            return
        now = time.monotonic()
        reason = {"type": "abort", "message": "the client went away"}
        out = TextOutput(state.msg.rid, "", [], len(state.msg.input_ids), 0, 0,
                         finish_reason=reason)
        self.request_log.add(state.msg, state.origin, out,
                             Timings(state.created, state.first_token_time, now, 0))

    @staticmethod
    def new_builder(state: ReqState) -> ResultBuilder:
        return ResultBuilder(client_rid(state.msg.rid), state.msg.return_logprob,
                             state.msg.top_logprobs_num, state.msg.token_ids_logprob is not None)

    async def collect(self, state: ReqState) -> ResultBuilder:
        builder = self.new_builder(state)
        async for out in self.outputs(state):
            builder.add(out)
            builder.weight_version = state.weight_version
        return builder

    def abort(self, rid: str) -> None:
        self.dp.abort(rid)

    def abort_prefix(self, rid: str, tenant: str | None = None) -> None:
        """SGLang's ``/abort_request`` with a rid: every request whose rid starts with it
        (the ``n`` samples ``rid-0``, ``rid-1``, ... of one request too); a tenant's only
        among its own requests (``tenant_rids.abort_matches``)."""
        known = [r for r in self.states if abort_matches(r, rid, tenant)]
        for r in known or [scoped_rid(tenant, rid)]:
            self.abort(r)

    def abort_all(self) -> None:
        self.dp.broadcast(encode(AbortReq("", abort_all=True)))

    def retire_replica(self, rank: int, why: str) -> None:
        """A data-parallel replica died: its requests fail with a 503 that says which and
        why, control calls stop waiting for it, the others keep serving."""
        reason = {"type": "abort", "message": f"{why}; the request was lost with it",
                  "status_code": 503}
        for rid in self.dp.retire(rank, why):
            state = self.states.get(rid)
            if state is not None:
                state.queue.put_nowait(TextOutput(rid, "", [], len(state.msg.input_ids), 0, 0,
                                                  finish_reason=reason))
        for (_, r), waiters in self._waiters.items():
            while r == rank and waiters:
                fut = waiters.popleft()
                if not fut.done():
                    fut.set_exception(ApiError(503, why, "service_unavailable"))

    def fail_all(self, status: int, message: str) -> None:
        """End every in-flight request with an error (the scheduler is not answering)."""
        reason = {"type": "abort", "message": message, "status_code": status}
        for rid, state in list(self.states.items()):
            state.queue.put_nowait(TextOutput(rid, "", [], len(state.msg.input_ids), 0, 0,
                                              finish_reason=reason))
