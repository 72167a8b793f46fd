"""The scheduler process: the model, KV pool and radix tree behind zmq sockets.

PULL from the tokenizer manager (requests, aborts, control), PUSH to the detokenizer
(outputs, replies). The loop is ``Scheduler.run_loop``; this file only supplies its I/O.
With ``--dp-size N`` there are N of these processes (``dp_rank`` 0..N-1), each with its own
model copy and pool; each stamps its replies with its rank and reports its load
(``ReplicaLoad``) for the front end's dispatcher.
"""

from __future__ import annotations

import json
import logging
import os
import time
from typing import Any

import torch
import zmq

from radixlm.radix_cache.kv_events import KVEventBatch, encode_batch
from radixlm.runtime.config import ServerArgs
from radixlm.runtime.cpu_threads import ThreadSizer
from radixlm.runtime.executor.sampling_params import SamplingParams
from radixlm.runtime.managers.child_setup import setup_child
from radixlm.runtime.managers.data_parallel.data_parallel_controller import (
    replica_args,
    replica_load,
)
from radixlm.runtime.managers.detokenizer import make_register
from radixlm.runtime.managers.messages import (
    BatchOutput,
    FlushCacheOutput,
    GenerateReqInput,
    InfoOutput,
    RegisterReqs,
    ReplicaKVEvents,
    ReplicaLoad,
    SchedulerReady,
    UpdateWeightFromDiskOutput,
    decode,
    encode,
)
from radixlm.runtime.managers.scheduler.kv_event_publisher import attach_publisher
from radixlm.runtime.managers.scheduler.scheduler import Scheduler
from radixlm.runtime.managers.scheduler.tp_ranks import start_tp_ranks
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
                 heartbeat: Any, dp_rank: int = 0) -> None:
        self.scheduler = scheduler
        self.pull = pull
        self.push = push
        self.heartbeat = heartbeat  # a shared double the server's watchdog reads
        self.dp_rank = dp_rank
        self.arrivals: dict[str, float] = {}  # rid -> arrival, until admitted
        self.queue_times: list[float] = []
        self.last_recv = time.monotonic()
        self.received = 0  # requests read so far (ReplicaLoad.received)
        self._load: ReplicaLoad | None = None  # the last one reported

    def recv(self, block: bool) -> list[Any]:
        self.heartbeat.value = time.monotonic()  # the loop turned (at least every POLL_MS)
        self._note_admitted()
        self._report_load()
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
        self.received += len(new)
        return msgs

    def _report_load(self) -> None:
        """Load after the last step, when it changed: every request read before this turn
        is in it (``received``), none read in this turn."""
        load = replica_load(self.scheduler, self.dp_rank, self.received)
        if load != self._load:
            self._load = load
            self.push.send(encode(load))

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

    def send_kv_events(self, batch: KVEventBatch) -> None:
        """A sink of ``Scheduler.kv_event_sinks``: the step's events to the dispatcher."""
        self.push.send(encode(ReplicaKVEvents(self.dp_rank, encode_batch(batch))))

    def send(self, obj: Any) -> None:
        if isinstance(obj, list):
            self._note_admitted()
            obj, self.queue_times = BatchOutput(obj, self.queue_times), []
        elif isinstance(obj, REPLIES):
            obj.dp_rank = self.dp_rank
        self.push.send(encode(obj))


REPLIES = (InfoOutput, FlushCacheOutput, UpdateWeightFromDiskOutput)


def run_scheduler_process(
    args_json: str, model_path: str, in_addr: str, out_addr: str, parent_pid: int,
    heartbeat: Any, dp_rank: int = 0, warm_up_grammar: bool = True,
) -> None:
    """Entry point of the scheduler process (started with the ``spawn`` method). A server's
    starts its grammar compile worker at once (``warm_up_grammar``); an Engine's replica,
    like the in-process Engine, on its first grammar."""
    args = replica_args(ServerArgs(**json.loads(args_json)), dp_rank)
    name = "scheduler" if args.dp_size == 1 else f"scheduler-dp{dp_rank}"
    should_stop = setup_child(name, parent_pid, args.log_level)
    # one core left to the HTTP and detokenizer processes; the replicas and their
    # tensor-parallel ranks split the rest (start_tp_ranks gives the followers their share)
    threads = ThreadSizer(args.cpu_threads, reserved=1,
                          share=args.dp_size * (args.tp_size // args.nnodes))
    torch.set_num_threads(threads.threads)
    if args.device.startswith("cuda:"):
        torch.cuda.set_device(args.device)
    args, tp_ranks = start_tp_ranks(args, model_path)  # --tp-size: this process is rank 0
    tokenizer = load_tokenizer(args.tokenizer_path or model_path)
    # a server's compile worker starts while the model loads, and it is ready before the
    # server is: its start-up takes seconds of a core the first requests would otherwise share
    scheduler = Scheduler(args, model_path, tokenizer, dp_rank, threads,
                          warm_up_grammar=warm_up_grammar)
    if tp_ranks is not None:
        tp_ranks.watch()  # a rank that exits ends this process, and so the server
    publisher = attach_publisher(scheduler, dp_rank)  # --kv-events-config
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
        "torch_threads": torch.get_num_threads(),
    }
    scheduler.grammar_compiler.wait_warm()
    heartbeat.value = time.monotonic()
    push.send(encode(SchedulerReady(scheduler.get_info(), model_info, dp_rank)))
    try:
        io = SchedulerIO(scheduler, pull, push, heartbeat, dp_rank)
        if args.dp_size > 1 and args.balance_method == "cache_aware":
            scheduler.kv_event_sinks.append(io.send_kv_events)
        scheduler.run_loop(io.recv, io.send, should_stop)
        logger.info("scheduler process stopping")
    finally:
        scheduler.grammar_compiler.shutdown()  # a worker still starting would delay the exit
        if scheduler.cache.hicache is not None:
            scheduler.cache.hicache.close()  # write the pages still queued
        pull.close(linger=0)
        push.close(linger=100)
        ctx.term()
        if tp_ranks is not None:
            tp_ranks.stop(scheduler.model_runner)
        if publisher is not None:
            publisher.shutdown()
