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
import uuid
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from radixlm.runtime.config import ServerArgs
from radixlm.runtime.executor.sampling_params import SamplingParams
from radixlm.runtime.managers.messages import (
    AbortReq,
    FlushCacheOutput,
    FlushCacheReq,
    GenerateReqInput,
    GetInfoReq,
    InfoOutput,
    SchedulerReady,
    TextBatch,
    TextOutput,
    decode,
    encode,
)
from radixlm.runtime.managers.result import ResultBuilder
from radixlm.runtime.managers.validation import (
    RequestLimits,
    cache_namespace,
    validate_request,
)
from radixlm.runtime.metrics import ServerMetrics

logger = logging.getLogger(__name__)

CONTROL_TIMEOUT_S = 60.0


class ApiError(Exception):
    """An error for the HTTP client, rendered as OpenAI's ``{"error": {...}}``."""

    def __init__(
        self,
        status: int,
        message: str,
        type_: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param = status, message, type_, param
        self.code = code if code is not None else str(status)

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }


# texts longer than this are tokenized on a worker thread, not on the event loop
LONG_TEXT_CHARS = 4096


@dataclass
class ReqState:
    msg: GenerateReqInput
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    created: float = field(default_factory=time.monotonic)
    last_token_time: float | None = None
    finished: bool = False


@dataclass
class Prepared:
    """A validated request, before it is split into its ``n`` samples."""

    msg: GenerateReqInput
    params: SamplingParams


class TokenizerManager:
    def __init__(
        self, args: ServerArgs, model_path: str, tokenizer: Any, sched_addr: str, recv_addr: str
    ) -> None:
        self.args = args
        self.model_path = model_path
        self.tokenizer = tokenizer
        self.metrics = ServerMetrics()
        self._push_ctx = zmq.Context()
        self._push = self._push_ctx.socket(zmq.PUSH)
        self._push.setsockopt(zmq.SNDHWM, 0)
        self._push.connect(sched_addr)
        self._pull_ctx = zmq.asyncio.Context()
        self._pull = self._pull_ctx.socket(zmq.PULL)
        self._pull.setsockopt(zmq.RCVHWM, 0)
        self._pull.bind(recv_addr)
        self.states: dict[str, ReqState] = {}
        self._waiters: dict[type, collections.deque] = {
            InfoOutput: collections.deque(),
            FlushCacheOutput: collections.deque(),
        }
        self.server_info: dict[str, Any] = {}  # the scheduler's info at startup
        self.model_info: dict[str, Any] = {}
        self.draining = False
        self.unhealthy: str | None = None  # why, once the watchdog found the scheduler stuck
        self.limits: RequestLimits | None = None  # known once the scheduler is ready
        self._loop_task: asyncio.Task | None = None
        self._tokenize_pool = ThreadPoolExecutor(1, thread_name_prefix="tokenize")

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
                    self.server_info, self.model_info = msg.info, msg.model_info
                    self.limits = RequestLimits.from_args(
                        self.args, msg.info["context_length"], msg.model_info["vocab_size"],
                        msg.info["max_total_num_tokens"])
                    return
        raise TimeoutError(f"the scheduler was not ready after {timeout} s")

    def start(self) -> None:
        self._loop_task = asyncio.get_running_loop().create_task(self._recv_loop())

    async def _recv_loop(self) -> None:
        while True:
            msg = decode(await self._pull.recv())
            if isinstance(msg, TextBatch):
                self._dispatch(msg)
            elif type(msg) in self._waiters:
                waiters = self._waiters[type(msg)]
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
            if out.new_token_ids:
                if state.last_token_time is None:
                    self.metrics.on_first_token(now - state.created)
                else:
                    self.metrics.on_tokens(now - state.last_token_time, len(out.new_token_ids))
                state.last_token_time = now
            if out.finished:
                state.finished = True
                self.metrics.on_finish(out.finish_reason, now - state.created)
            state.queue.put_nowait(out)

    def close(self) -> None:
        if self._loop_task is not None:
            self._loop_task.cancel()
        self._tokenize_pool.shutdown(wait=False, cancel_futures=True)
        self._push.close(linger=0)
        self._pull.close(linger=0)
        self._push_ctx.term()
        self._pull_ctx.term()

    # --- requests ---------------------------------------------------------------------------
    async def encode_text(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of ``text``; a long text is tokenized off the event loop."""
        if len(text) <= LONG_TEXT_CHARS:
            return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)
        return await asyncio.get_running_loop().run_in_executor(
            self._tokenize_pool,
            lambda: self.tokenizer.encode(text, add_special_tokens=add_special_tokens))

    def prepare(
        self,
        input_ids: list[int],
        sampling_params: dict[str, Any] | None,
        rid: str | None = None,
        return_logprob: bool = False,
        logprob_start_len: int = -1,
        top_logprobs_num: int = 0,
        text_in_logprobs: bool = False,
        namespace: str | None = None,
    ) -> Prepared:
        """Validate one request whose types were checked at the edge (400 on bad input:
        ranges, vocabulary, context, the server's caps); nothing is sent yet."""
        assert self.limits is not None, "prepare() before the scheduler was ready"
        try:
            params = SamplingParams.from_dict(sampling_params)
            validate_request(input_ids, params, self.limits, top_logprobs_num)
        except ValueError as e:
            code = "context_length_exceeded" if "context length" in str(e) else None
            raise ApiError(400, str(e), code=code) from None
        msg = GenerateReqInput(
            rid or uuid.uuid4().hex,
            input_ids,
            params.to_dict(),
            bool(return_logprob),
            logprob_start_len,
            top_logprobs_num,
            namespace=namespace,
            return_text_in_logprobs=bool(text_in_logprobs),
        )
        return Prepared(msg, params)

    @staticmethod
    def namespace(extra_key: str | None, cache_salt: str | None) -> str | None:
        """The cache namespace of a request (400 on a bad key)."""
        try:
            return cache_namespace(extra_key, cache_salt)
        except ValueError as e:
            raise ApiError(400, str(e), param="cache_salt") from None

    def check_capacity(self, n_new: int) -> None:
        """503 while shutting down or when ``--max-queued-requests`` are already queued."""
        if self.draining:
            raise ApiError(503, "the server is shutting down", "service_unavailable")
        limit = self.args.max_queued_requests
        if limit is not None:
            running = self.server_info["max_running_requests"]
            queued = len(self.states) + n_new - running
            if queued > limit:
                raise ApiError(
                    503,
                    f"too many queued requests: the limit is {limit} "
                    "(--max-queued-requests); retry later",
                    "service_unavailable",
                )

    async def submit(self, items: list[Prepared]) -> list[ReqState]:
        """Send every request (each of its ``n`` samples); n > 1 first caches the prompt
        once, so the samples share its KV. Every message is encoded before any state is
        registered, so a request that cannot be sent leaves nothing behind."""
        subs: list[GenerateReqInput] = []
        for p in items:
            n = p.params.n
            subs += [p.msg] if n == 1 else [
                msgspec.structs.replace(p.msg, rid=f"{p.msg.rid}-{j}") for j in range(n)]
        self.check_capacity(len(subs))
        if len({m.rid for m in subs}) != len(subs) or any(m.rid in self.states for m in subs):
            raise ApiError(400, "rid is already in use", param="rid")
        wire = [self._encode(m) for m in subs]
        if not self.args.disable_radix_cache:
            for p in items:
                if p.params.n > 1:
                    warm = GenerateReqInput(
                        p.msg.rid + "-prefill", p.msg.input_ids, {"max_new_tokens": 0},
                        namespace=p.msg.namespace,
                    )
                    async for _ in self.outputs(self._send_req(warm, self._encode(warm))):
                        pass
        return [self._send_req(m, data) for m, data in zip(subs, wire)]

    @staticmethod
    def _encode(msg: GenerateReqInput) -> bytes:
        try:
            return encode(msg)
        except (OverflowError, TypeError, ValueError, msgspec.EncodeError) as e:
            raise ApiError(400, f"the request cannot be encoded: {e}") from None

    def _send_req(self, msg: GenerateReqInput, data: bytes) -> ReqState:
        state = ReqState(msg)
        self._push.send(data)
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
                    raise ApiError(status, out.finish_reason.get("message", "request failed"),
                                   "invalid_request_error" if status < 500 else "server_error")
                yield out
                if out.finished:
                    return
        finally:
            self.states.pop(state.msg.rid, None)
            if not state.finished:
                self.abort(state.msg.rid)

    async def merged_outputs(self, states: list[ReqState]) -> AsyncIterator[tuple[int, TextOutput]]:
        """``(index, output)`` pairs of several requests, as they arrive."""
        if len(states) == 1:
            async for out in self.outputs(states[0]):
                yield 0, out
            return
        merged: asyncio.Queue = asyncio.Queue()

        async def pump(i: int, state: ReqState) -> None:
            async for out in self.outputs(state):
                merged.put_nowait((i, out))
            merged.put_nowait((i, None))

        tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(states)]
        try:
            remaining = len(tasks)
            while remaining:
                i, out = await merged.get()
                if out is None:
                    remaining -= 1
                else:
                    yield i, out
        finally:
            for t in tasks:
                t.cancel()

    @staticmethod
    def new_builder(state: ReqState) -> ResultBuilder:
        return ResultBuilder(state.msg.rid, state.msg.return_logprob, state.msg.top_logprobs_num)

    async def collect(self, state: ReqState) -> ResultBuilder:
        builder = self.new_builder(state)
        async for out in self.outputs(state):
            builder.add(out)
        return builder

    def abort(self, rid: str) -> None:
        self._push.send(encode(AbortReq(rid)))

    def abort_all(self) -> None:
        for rid in list(self.states):
            self.abort(rid)

    def fail_all(self, status: int, message: str) -> None:
        """End every in-flight request with an error (the scheduler is not answering)."""
        reason = {"type": "abort", "message": message, "status_code": status}
        for rid, state in list(self.states.items()):
            state.queue.put_nowait(TextOutput(rid, "", [], len(state.msg.input_ids), 0, 0,
                                              finish_reason=reason))

    # --- control ------------------------------------------------------------------------------
    async def _call(self, msg: Any, reply_type: type) -> Any:
        fut = asyncio.get_running_loop().create_future()
        self._waiters[reply_type].append(fut)
        self._push.send(encode(msg))
        return await asyncio.wait_for(fut, CONTROL_TIMEOUT_S)

    async def get_info(self) -> dict[str, Any]:
        return (await self._call(GetInfoReq(), InfoOutput)).info

    async def flush_cache(self) -> FlushCacheOutput:
        return await self._call(FlushCacheReq(), FlushCacheOutput)
