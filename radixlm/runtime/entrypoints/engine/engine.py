"""The offline Engine: tokenizer + the scheduler in one process, no sockets; with
``dp_size`` > 1, one scheduler process per replica (``engine_processes.py``).

``generate`` (callable from any thread) tokenizes, validates and submits; with one
replica the caller then runs the scheduler loop itself (``Scheduler.run_once``, the
server's loop too) until its outputs are there, unless another caller is running it
already (``engine_loop.py``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
import logging
import os
import queue
import threading
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from typing import Any

import msgspec
from pydantic import ValidationError

from radixlm.runtime.config import ServerArgs
from radixlm.runtime.entrypoints.engine.engine_encode import EngineEncode
from radixlm.runtime.entrypoints.engine.engine_loop import EngineError, EngineLoop
from radixlm.runtime.entrypoints.engine.engine_processes import ReplicaProcesses
from radixlm.runtime.entrypoints.protocol import (
    UpdateWeightFromDiskRequest,
    token_ids_for_item,
    typed_sampling_params,
)
from radixlm.runtime.entrypoints.refused_fields import refuse_options
from radixlm.runtime.entrypoints.validation_errors import describe
from radixlm.runtime.executor.sampling_params import (
    SamplingParams,
    sample_sampling_params,
    sampling_defaults,
)
from radixlm.runtime.managers.data_parallel.data_parallel_controller import (
    aggregate_infos,
    replica_args,
)
from radixlm.runtime.managers.detokenizer import RequestDetokenizer, make_register
from radixlm.runtime.managers.messages import (
    FlushCacheReq,
    GenerateReqInput,
    GetInfoReq,
    ReqOutput,
    UpdateWeightFromDiskReq,
)
from radixlm.runtime.managers.scheduler.kv_event_publisher import attach_publisher
from radixlm.runtime.managers.scheduler.scheduler import Scheduler
from radixlm.runtime.managers.scheduler.tp_ranks import start_tp_ranks
from radixlm.runtime.managers.tokenizer_manager.request_log import (
    RequestLog,
    RequestOrigin,
    Timings,
)
from radixlm.runtime.managers.tokenizer_manager.result import ResultBuilder
from radixlm.runtime.managers.validation import (
    cache_namespace,
    request_priority,
    validate_request,
)
from radixlm.runtime.model_config import ModelConfig
from radixlm.runtime.model_dir import check_model_dir
from radixlm.runtime.tokenizer import gguf_served_name, load_tokenizer, resolve_model_path

logger = logging.getLogger(__name__)

class Engine(EngineEncode):
    """Offline generation: ``Engine(model_path=None, **server_args)``; None = tiny model.
    With ``dp_size`` > 1 the replicas are child processes: create it under
    ``if __name__ == "__main__":`` in a script, and ``shutdown`` it (or use ``with``)."""

    def __init__(self, model_path: str | None = None, **kwargs: Any) -> None:
        self.server_args = ServerArgs.from_kwargs(model_path=model_path, **kwargs)
        self.model_path = resolve_model_path(model_path, self.server_args.load_format)
        name = gguf_served_name(model_path, self.model_path)
        if name and self.server_args.served_model_name is None:  # a GGUF file's own name
            self.server_args = dataclasses.replace(self.server_args, served_model_name=name)
        check_model_dir(self.model_path, self.server_args.tokenizer_path)  # one clear error
        self.tokenizer = load_tokenizer(self.server_args.tokenizer_path or self.model_path)
        self.sampling_defaults = sampling_defaults(self.server_args, self.model_path)
        if self.server_args.dp_size > 1 and self.server_args.tp_size > 1:
            # each replica process would lead its own group, as in the server; not tried here
            raise ValueError("Engine: dp_size > 1 together with tp_size > 1 is not supported "
                             "(radixlm serve runs dp x tp processes)")
        self._tp_ranks = None
        self._kv_publishers: list[Any] = []
        self.scheduler: Scheduler | None = None  # the in-process one (dp_size 1)
        self.loop: EngineLoop | ReplicaProcesses
        if self.server_args.dp_size > 1:
            # the server's scheduler processes, N times the cores (engine_processes.py)
            self.loop = ReplicaProcesses(self.server_args, self.model_path)
            self.limits = self.loop.limits
            self.model_config = ModelConfig.from_hf(
                self.model_path, dtype=self.server_args.dtype,
                context_length=self.server_args.context_length)
        else:
            self._start_in_process()
        self._update_lock = threading.Lock()  # one weight update at a time
        self.request_log = RequestLog.from_args(self.server_args)  # --log-requests(-file)
        if self._tp_ranks is not None:
            self._tp_ranks.watch(self._on_rank_exit)

    def _start_in_process(self) -> None:
        """One replica: the scheduler in this process, driven by the callers (engine_loop.py)."""
        # --tp-size: this process is rank 0; the other ranks are processes (tp_ranks.py)
        args, self._tp_ranks = start_tp_ranks(self.server_args, self.model_path)
        try:
            self.scheduler = Scheduler(replica_args(args, 0), self.model_path, self.tokenizer)
        except BaseException:
            if self._tp_ranks is not None:
                self._tp_ranks.kill()
            raise
        self.limits = self.scheduler.limits
        self.model_config = self.scheduler.model_config
        attach = attach_publisher(self.scheduler)  # --kv-events-config
        self._kv_publishers = [attach] if attach is not None else []
        self.loop = EngineLoop(self.scheduler)

    def _on_rank_exit(self, why: str) -> None:
        """A tensor-parallel rank died (watch thread): fail every request, now and later."""
        logger.error("%s; the engine fails its requests", why)
        self.loop.fail(EngineError(why))

    # --- requests ---------------------------------------------------------------------------
    def _prepare(self, prompt: str | None, ids: list[int] | None, sp: dict | None,
                 return_logprob: bool, logprob_start_len: int, top_logprobs_num: int,
                 rid: str | None, namespace: str | None = None,
                 token_ids_logprob: list[int] | None = None
                 ) -> tuple[GenerateReqInput, SamplingParams]:
        if ids is None:
            if not isinstance(prompt, str):
                raise ValueError(f"text must be a string, got {type(prompt).__name__}")
            ids = self.tokenizer.encode(prompt, add_special_tokens=False)
        params = SamplingParams.with_defaults(typed_sampling_params(sp), self.sampling_defaults)
        for name, value in (("top_logprobs_num", top_logprobs_num),
                            ("logprob_start_len", logprob_start_len)):
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"{name} must be an integer, got {value!r}")
        validate_request(list(ids), params, self.limits, top_logprobs_num,
                         token_ids_logprob)
        msg = GenerateReqInput(rid or uuid.uuid4().hex, list(ids), params.to_dict(),
                               return_logprob, logprob_start_len, top_logprobs_num, namespace,
                               token_ids_logprob=token_ids_logprob)
        return msg, params

    def generate(self, prompt: str | list[str] | None = None,
                 sampling_params: dict | list[dict] | None = None,
                 input_ids: list[int] | list[list[int]] | None = None,
                 return_logprob: bool = False, logprob_start_len: int = -1,
                 top_logprobs_num: int = 0, stream: bool = False,
                 rid: str | list[str] | None = None,
                 return_text_in_logprobs: bool = False, extra_key: str | None = None,
                 cache_salt: str | None = None,
                 token_ids_logprob: list[int] | list[list[int]] | None = None,
                 priority: int | None = None, routed_dp_rank: int | None = None,
                 data_parallel_rank: int | None = None, **sglang_options: Any) -> Any:
        """SGLang's ``Engine.generate``: a dict for one prompt, a list for a batch;
        ``stream=True`` (one prompt) yields dicts whose ``text`` is the increment.
        ``extra_key`` / ``cache_salt``: requests share cached KV only with the same ones.
        ``token_ids_logprob``: with return_logprob, the logprobs of these ids at each
        position. ``priority``: with ``enable_priority_scheduling``, the request's place in
        the queue (``validation.request_priority``). ``routed_dp_rank`` (old name
        ``data_parallel_rank``): with ``dp_size`` > 1, the replica that serves it.
        SGLang's other arguments (``image_data``, ``lora_path``, ...) are accepted only at
        their defaults (``refused_fields.refuse_options``)."""
        refuse_options(sglang_options)
        if self.server_args.is_embedding:
            raise ValueError("this Engine serves an embedding model (is_embedding=True): "
                             "use Engine.encode")
        batch = isinstance(prompt, list) or (input_ids is not None and bool(input_ids)
                                             and isinstance(input_ids[0], list))
        prompts = prompt if isinstance(prompt, list) else [prompt]
        ids_list = (input_ids if batch else [input_ids]) if input_ids is not None else None
        n_items = len(ids_list) if ids_list is not None else len(prompts)
        sps = sampling_params if isinstance(sampling_params, list) else [sampling_params] * n_items
        if isinstance(rid, str) and n_items > 1:
            raise ValueError("rid must be a list with one id per prompt for a batch")
        rids = rid if isinstance(rid, list) else [rid] * n_items
        if len(sps) != n_items or len(rids) != n_items:
            raise ValueError(f"sampling_params/rid lists must have {n_items} entries")
        opts = (return_logprob, logprob_start_len, top_logprobs_num)
        namespace = cache_namespace(extra_key, cache_salt)
        prepared = [self._prepare(None if ids_list else prompts[i],
                                  ids_list[i] if ids_list else None, sps[i], *opts, rids[i],
                                  namespace, token_ids_for_item(token_ids_logprob, i, batch))
                    for i in range(n_items)]
        resolved_priority = request_priority(priority, self.server_args)
        rank = self._routed_rank(routed_dp_rank, data_parallel_rank)
        for msg, _ in prepared:
            msg.priority, msg.routed_dp_rank = resolved_priority, rank
        texts = [None if ids_list else prompts[i] for i in range(n_items)]
        if stream:
            if n_items != 1 or prepared[0][1].n != 1:
                raise ValueError("stream=True takes one prompt and n=1")
            return self._stream(*prepared[0], return_text_in_logprobs, texts[0])
        results = self._run_all(prepared, return_text_in_logprobs, texts)
        return results if batch or len(results) > 1 else results[0]

    async def async_generate(self, *args: Any, **kwargs: Any) -> Any:
        """SGLang's ``Engine.async_generate``: ``generate`` for an asyncio caller (same
        arguments and results). The loop runs on a worker thread, so the event loop keeps
        serving; with ``stream=True`` it returns an async iterator of the chunks."""
        result = await asyncio.to_thread(self.generate, *args, **kwargs)
        return _aiter_chunks(result) if inspect.isgenerator(result) else result

    def _routed_rank(self, routed: int | None, legacy: int | None) -> int | None:
        rank, name = (routed, "routed_dp_rank") if routed is not None else (
            legacy, "data_parallel_rank")
        dp_size = self.server_args.dp_size
        if rank is not None and (type(rank) is not int or not 0 <= rank < dp_size):
            raise ValueError(f"{name} must be in [0, {dp_size}) "
                             f"(dp_size), got {rank!r}")
        return rank

    def _run_all(self, prepared: list[tuple[GenerateReqInput, SamplingParams]],
                 text_in_logprobs: bool, texts: list[str | None]) -> list[dict]:
        """Submit everything, then collect; n > 1 first caches the prompt once so the n
        samples share its KV instead of computing it n times."""
        if not self.server_args.disable_radix_cache:
            warm = [(GenerateReqInput(m.rid + "-prefill", m.input_ids, {"max_new_tokens": 0},
                                      namespace=m.namespace), None)
                    for m, p in prepared if p.n > 1]
            for m, _ in warm:
                list(self.loop.outputs(m.rid, self.loop.submit(m)))
        jobs = []
        for (m, p), text in zip(prepared, texts):
            for j in range(p.n):
                sub = m if p.n == 1 else msgspec.structs.replace(
                    m, rid=f"{m.rid}-{j}",
                    sampling_params=sample_sampling_params(m.sampling_params, j))
                result = _Result(self.tokenizer, sub, p, text_in_logprobs)
                jobs.append((result, self.loop.submit(sub), text))
        return [self._collect(result, q, text) for result, q, text in jobs]

    def _collect(self, result: _Result, q: queue.Queue, text: str | None) -> dict:
        rid = result.msg.rid
        for out in self.loop.outputs(rid, q):
            result.add(out)
            result.builder.weight_version = self.loop.versions.get(rid)
            self._log_finished(result, out, text, stream=False)
        return result.to_dict(time.monotonic() - result.t0)

    def _stream(self, msg: GenerateReqInput, params: SamplingParams,
                text_in_logprobs: bool, text: str | None) -> Iterator[dict]:
        result = _Result(self.tokenizer, msg, params, text_in_logprobs)
        q = self.loop.submit(msg)
        finished = False
        try:
            for out in self.loop.outputs(msg.rid, q):
                result.add(out)
                result.builder.weight_version = self.loop.versions.get(msg.rid)
                finished = out.finished
                self._log_finished(result, out, text, stream=True)
                yield result.chunk(time.monotonic() - result.t0)
        finally:
            if not finished:
                self.abort(msg.rid)

    def _log_finished(self, result: _Result, out: ReqOutput, text: str | None,
                      stream: bool) -> None:
        """``--log-requests`` / ``--log-requests-file``: the record of a finished request,
        as the server writes it (route ``Engine.generate``)."""
        if self.request_log is None or not out.finished:
            return
        timings = Timings(result.t0, result.first_token_time, time.monotonic(),
                          out.completion_tokens)
        self.request_log.add(result.msg, RequestOrigin("Engine.generate", text, None, stream),
                             out, timings)

    def abort(self, rid: str) -> None:
        self.loop.abort(rid)

    # --- control ------------------------------------------------------------------------------
    def flush_cache(self) -> bool:
        return all(out.success for out in self.loop.call(FlushCacheReq()))

    def update_weights_from_disk(self, model_path: str | os.PathLike,
                                 load_format: str | None = None,
                                 abort_all_requests: bool = False,
                                 weight_version: str | None = None,
                                 **options: Any) -> tuple[bool, str, int]:
        """SGLang's ``Engine.update_weights_from_disk``: ``(success, message,
        num_paused_requests)``. Takes the route's fields (``options``: ``torch_empty_cache``,
        ...); an unsupported one is a ValueError. Requests already submitted finish on the
        old weights first (or are aborted: ``abort_all_requests``); later ones wait."""
        fields = {"model_path": os.fspath(model_path), "load_format": load_format,
                  "abort_all_requests": abort_all_requests, "weight_version": weight_version,
                  **options}
        try:
            body = UpdateWeightFromDiskRequest.model_validate(fields)
        except ValidationError as e:
            raise ValueError(describe(e)[0]) from None
        refused = body.refused()
        if refused is not None:
            raise ValueError(refused[1])
        with self._update_lock:
            outs = self.loop.update_weights(UpdateWeightFromDiskReq(
                body.model_path, abort_all_requests, weight_version, body.torch_empty_cache))
        out = next((o for o in outs if not o.success), outs[0])
        if out.success:
            self.model_path = body.model_path
        return out.success, out.message, out.num_paused_requests

    def get_server_info(self) -> dict[str, Any]:
        """Summed over the replicas when ``dp_size`` > 1 (``internal_states``: each one's)."""
        infos = [out.info for out in self.loop.call(GetInfoReq())]
        extra = {"internal_states": infos} if len(infos) > 1 else {}
        return {"model_path": self.model_path, **aggregate_infos(infos), **extra}

    def check_invariants(self) -> None:
        """Assert the KV accounting invariant; the engine must be idle."""
        for out in self.loop.call(GetInfoReq(check_invariants=True)):
            if out.info.get("invariant_error"):
                raise AssertionError(out.info["invariant_error"])

    def wait_idle(self, timeout: float = 30.0) -> None:
        """Block until no request is waiting or running (aborts settle in a step)."""
        self.loop.wait_idle(timeout)

    @property
    def is_alive(self) -> bool:
        return not self.loop.stopped and self.loop.error is None

    def shutdown(self) -> None:
        """Abort what is still running and refuse new requests (dp_size > 1: and stop the
        replica processes)."""
        if self.loop.stopped:
            return
        self.loop.shutdown()
        if self.scheduler is not None and self.scheduler.cache.hicache is not None:
            self.scheduler.cache.hicache.close()  # write the pages still queued
        for publisher in self._kv_publishers:
            publisher.shutdown()
        if self.request_log is not None:
            self.request_log.close()
        if self._tp_ranks is not None:
            self._tp_ranks.stop(self.scheduler.model_runner)

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()


async def _aiter_chunks(chunks: Iterator[dict]) -> AsyncIterator[dict]:
    """A stream's chunks, each taken on a worker thread; closing early aborts it."""
    done = object()
    try:
        while (chunk := await asyncio.to_thread(next, chunks, done)) is not done:
            yield chunk
    finally:
        await asyncio.to_thread(chunks.close)


class _Result:
    """One request in the Engine: in-process detokenisation, then the shared builder."""

    def __init__(self, tokenizer: Any, msg: GenerateReqInput, params: SamplingParams,
                 text_in_logprobs: bool) -> None:
        self.msg = msg
        self.t0 = time.monotonic()  # submitted (just before)
        self.first_token_time: float | None = None
        self.detok = RequestDetokenizer(tokenizer, make_register(msg.rid, params,
                                                                 text_in_logprobs))
        self.builder = ResultBuilder(msg.rid, msg.return_logprob, msg.top_logprobs_num,
                                     msg.token_ids_logprob is not None)

    def add(self, out: ReqOutput) -> None:
        if self.first_token_time is None and out.new_token_ids:
            self.first_token_time = time.monotonic()
        self.builder.add(self.detok.process(out))

    def to_dict(self, latency: float) -> dict[str, Any]:
        return self.builder.to_dict(latency)

    def chunk(self, latency: float) -> dict[str, Any]:
        return self.builder.chunk(latency)
