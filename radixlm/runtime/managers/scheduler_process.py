"""The scheduler process: the model, KV pool and radix tree behind zmq sockets.

PULL from the tokenizer manager (requests, aborts, control), PUSH to the detokenizer
(outputs, replies). The loop is ``Scheduler.run_loop``; this file only supplies its I/O.
"""

from __future__ import annotations

import json
import logging
import os
import time
from typing import Any

import torch
import zmq

from radixlm.runtime.config import ServerArgs
from radixlm.runtime.executor.sampling_params import SamplingParams
from radixlm.runtime.managers.child_setup import setup_child
from radixlm.runtime.managers.detokenizer import make_register
from radixlm.runtime.managers.messages import (
    BatchOutput,
    GenerateReqInput,
    RegisterReqs,
    SchedulerReady,
    decode,
    encode,
)
from radixlm.runtime.managers.scheduler import Scheduler
from radixlm.runtime.tokenizer import load_tokenizer

logger = logging.getLogger(__name__)

POLL_MS = 100  # while idle: how often the loop looks at the stop flag


class SchedulerIO:
    """``recv`` / ``send`` for ``Scheduler.run_loop`` over zmq.

    Each new request is registered with the detokenizer (its decode options) on the same
    socket as, and so before, its outputs. Queue times are measured at step granularity:
    a request that left ``scheduler.waiting`` was admitted right after the previous recv.
    """

    def __init__(self, scheduler: Scheduler, pull: zmq.Socket, push: zmq.Socket,
                 heartbeat: Any) -> None:
        self.scheduler = scheduler
        self.pull = pull
        self.push = push
        self.heartbeat = heartbeat  # a shared double the server's watchdog reads
        self.arrivals: dict[str, float] = {}  # rid -> arrival, until admitted
        self.queue_times: list[float] = []
        self.last_recv = time.monotonic()

    def recv(self, block: bool) -> list[Any]:
        self.heartbeat.value = time.monotonic()  # the loop turned (at least every POLL_MS)
        self._note_admitted()
        msgs: list[Any] = []
        if self.pull.poll(POLL_MS if block else 0):
            while True:
                try:
                    msgs.append(decode(self.pull.recv(zmq.NOBLOCK)))
                except zmq.Again:
                    break
        new = [m for m in msgs if isinstance(m, GenerateReqInput)]
        if new:
            regs = [self._register(m) for m in new]
            self.push.send(encode(RegisterReqs(regs)))
        self.last_recv = time.monotonic()
        for m in new:
            self.arrivals[m.rid] = self.last_recv
        return msgs

    @staticmethod
    def _register(m: GenerateReqInput) -> Any:
        try:
            params = SamplingParams.from_dict(m.sampling_params)
        except Exception:  # noqa: BLE001 - the scheduler refuses it; decode with defaults
            params = SamplingParams()
        return make_register(m.rid, params, m.return_text_in_logprobs)

    def _note_admitted(self) -> None:
        if not self.arrivals:
            return
        waiting = {r.rid for r in self.scheduler.waiting} | {m.rid for m in self.scheduler.held}
        for rid in [r for r in self.arrivals if r not in waiting]:
            self.queue_times.append(max(self.last_recv - self.arrivals.pop(rid), 0.0))

    def send(self, obj: Any) -> None:
        if isinstance(obj, list):
            self._note_admitted()
            obj, self.queue_times = BatchOutput(obj, self.queue_times), []
        self.push.send(encode(obj))


def run_scheduler_process(
    args_json: str, model_path: str, in_addr: str, out_addr: str, parent_pid: int,
    heartbeat: Any,
) -> None:
    """Entry point of the scheduler process (started with the ``spawn`` method)."""
    args = ServerArgs(**json.loads(args_json))
    should_stop = setup_child("scheduler", parent_pid, args.log_level)
    torch.set_num_threads(args.resolve_cpu_threads())
    tokenizer = load_tokenizer(args.tokenizer_path or model_path)
    scheduler = Scheduler(args, model_path, tokenizer)
    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    pull.bind(in_addr)
    push = ctx.socket(zmq.PUSH)
    push.connect(out_addr)
    cfg = scheduler.model_config
    model_info = {
        "dtype": str(scheduler.model_runner.dtype).removeprefix("torch."),
        "device": str(scheduler.model_runner.device),
        "vocab_size": cfg.vocab_size,
        "pid": os.getpid(),
    }
    heartbeat.value = time.monotonic()
    push.send(encode(SchedulerReady(scheduler.get_info(), model_info)))
    try:
        io = SchedulerIO(scheduler, pull, push, heartbeat)
        scheduler.run_loop(io.recv, io.send, should_stop)
        logger.info("scheduler process stopping")
    finally:
        pull.close(linger=0)
        push.close(linger=100)
        ctx.term()
