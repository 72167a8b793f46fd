"""``Engine(dp_size > 1)``: the replicas as scheduler processes, started as ``radixlm serve
--dp-size N`` starts them (``run_scheduler_process``, ``ChildProcesses``), and the Engine's
end of their sockets.

Requests go to the replica the server's dispatcher picks (``DataParallelController``: a
PUSH socket per replica, the ``LoadBalancer``); everything the replicas send (outputs,
loads, KV events, control replies) comes back on one PULL socket, read by a receive
thread: outputs to each request's queue, loads and events to the balancer, replies to the
control call waiting for them. The replicas compute in their own processes with their
share of the cores, so N of them run N steps at once; the callers' threads only tokenize,
detokenize and wait. A replica that exits fails every pending and later request
(``EngineError``), as a failed in-process scheduler does.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import queue
import threading
import time
from typing import Any

import zmq
from msgspec import EncodeError

from radixlm.runtime.config import ServerArgs
from radixlm.runtime.entrypoints.child_processes import SCHEDULER_ENTRY, ChildProcesses
from radixlm.runtime.entrypoints.engine.engine_loop import EngineError, RequestStreams
from radixlm.runtime.managers.data_parallel.data_parallel_controller import DataParallelController
from radixlm.runtime.managers.messages import (
    BatchOutput,
    FlushCacheOutput,
    GenerateReqInput,
    GetInfoReq,
    InfoOutput,
    ReplicaKVEvents,
    ReplicaLoad,
    SchedulerReady,
    UpdateWeightFromDiskOutput,
    UpdateWeightFromDiskReq,
    decode,
    encode,
)
from radixlm.runtime.managers.validation import RequestLimits

logger = logging.getLogger(__name__)

READY_TIMEOUT_S = 600.0  # model load of every replica
POLL_MS = 100  # the receive thread looks at the replicas' exit codes this often
SHUTDOWN_DRAIN_S = 5.0  # how long shutdown waits for the aborted requests' last outputs
REPLIES = (InfoOutput, FlushCacheOutput, UpdateWeightFromDiskOutput)


def replica_process_args(args: ServerArgs) -> ServerArgs:
    """The replicas' settings: ``cpu_threads`` counts the Engine's threads, all cores of
    this process unless set, which each replica divides by ``dp_size``
    (``ServerArgs.resolve_cpu_threads``). They log what the caller's ``radixlm`` logger
    would show in-process (a script that configured no logging sees warnings only), and
    never below ``log_level``."""
    caller = logging.getLogger("radixlm").getEffectiveLevel()
    own = logging.getLevelName(args.log_level.upper())
    level = max(caller, own if isinstance(own, int) else logging.INFO)
    return dataclasses.replace(args, cpu_threads=args.cpu_threads or len(os.sched_getaffinity(0)),
                               log_level=logging.getLevelName(level).lower())


class ReplicaProcesses(RequestStreams):
    """The Engine's replicas as processes; every method may be called from any thread."""

    def __init__(self, args: ServerArgs, model_path: str) -> None:
        super().__init__()
        self.dp_size = args.dp_size
        self.children = ChildProcesses(args.dp_size)
        self._ctx = zmq.Context()
        self._pull = self._ctx.socket(zmq.PULL)
        self._pull.setsockopt(zmq.RCVHWM, 0)
        self._pull.bind(self.children.address("engine"))
        self.dp = DataParallelController(args, [self.children.address(
            self.children.scheduler_name(r)) for r in range(args.dp_size)])
        self.replies: queue.Queue = queue.Queue()
        self._control = threading.Lock()  # one control call at a time
        self._unfinished: set[str] = set()  # rids sent whose last output has not come back
        self._closing = False
        try:
            ready = self._start(replica_process_args(args), model_path)
        except BaseException:
            self._close()
            raise
        info, model_info = ready[0].info, ready[0].model_info  # the replicas' settings agree
        self.limits = RequestLimits.from_args(args, info["context_length"],
                                              model_info["vocab_size"],
                                              info["max_total_num_tokens"])
        self.model_infos = [ready[r].model_info for r in range(self.dp_size)]  # pid, threads
        self.pids = [info["pid"] for info in self.model_infos]
        self.weight_versions = [ready[r].info.get("weight_version", "")
                                for r in range(self.dp_size)]
        self._thread = threading.Thread(target=self._recv_loop, name="radixlm-engine-recv",
                                        daemon=True)
        self._thread.start()

    # --- startup ----------------------------------------------------------------------------
    def _start(self, args: ServerArgs, model_path: str) -> dict[int, SchedulerReady]:
        args_json = json.dumps(dataclasses.asdict(args))
        out_addr = self.children.address("engine")
        for rank in range(self.dp_size):
            name = self.children.scheduler_name(rank)
            self.children.start(name, SCHEDULER_ENTRY, args_json, model_path,
                                self.children.address(name), out_addr, os.getpid(),
                                self.children.heartbeats[rank], rank, False)
        ready: dict[int, SchedulerReady] = {}
        deadline = time.monotonic() + READY_TIMEOUT_S
        while len(ready) < self.dp_size:
            if time.monotonic() > deadline:
                raise TimeoutError(f"the replicas were not ready after {READY_TIMEOUT_S} s")
            if (why := self._exited()) is not None:
                raise RuntimeError(f"{why} while loading (see its log above)")
            if self._pull.poll(POLL_MS):
                msg = decode(self._pull.recv())
                if isinstance(msg, SchedulerReady):
                    ready[msg.dp_rank] = msg
                else:
                    self._handle(msg)
        return ready

    def _exited(self) -> str | None:
        """Why the engine cannot go on: a replica process that exited."""
        for rank in range(self.dp_size):
            proc = self.children.procs[self.children.scheduler_name(rank)]
            if proc.exitcode is not None:
                return (f"data-parallel replica {rank} (pid {proc.pid}) exited with code "
                        f"{proc.exitcode}")
        return None

    # --- the receive thread -----------------------------------------------------------------
    def _recv_loop(self) -> None:
        try:
            while not self._closing:
                if self._pull.poll(POLL_MS):
                    while True:
                        try:
                            data = self._pull.recv(zmq.NOBLOCK)
                        except zmq.Again:
                            break
                        self._handle(decode(data))
                if not self._closing and (why := self._exited()) is not None:
                    logger.error("%s; the engine fails its requests", why)
                    self.fail(EngineError(why))
                    return
        except BaseException as e:  # noqa: BLE001 - every caller must hear of it
            if not self._closing:
                logger.exception("the engine's receive thread failed")
                self.fail(e)

    def _handle(self, msg: Any) -> None:
        if isinstance(msg, BatchOutput):
            self._dispatch(msg)
        elif isinstance(msg, ReplicaLoad):
            with self.lock:
                self.dp.balancer.on_load(msg)
        elif isinstance(msg, ReplicaKVEvents):
            with self.lock:
                self.dp.on_kv_events(msg)
        elif isinstance(msg, REPLIES):
            if isinstance(msg, UpdateWeightFromDiskOutput):  # outputs after it: new weights
                self.weight_versions[msg.dp_rank] = msg.weight_version
            self.replies.put(msg)
        # RegisterReqs: the Engine detokenizes each request itself (engine.py's _Result)

    def _dispatch(self, batch: BatchOutput) -> None:
        with self.lock:
            for out in batch.outputs:
                rank = self.dp.balancer.owner(out.rid)
                if out.finished:
                    self.dp.balancer.finished(out.rid)
                    self._unfinished.discard(out.rid)
                q = self.streams.get(out.rid)
                if q is not None:
                    if rank is not None:
                        self.versions[out.rid] = self.weight_versions[rank]
                    q.put(out)

    # --- requests -----------------------------------------------------------------------------
    def _send(self, msg: GenerateReqInput) -> None:
        try:
            data = encode(msg)
        except (OverflowError, TypeError, ValueError, EncodeError) as e:
            raise ValueError(f"the request cannot be encoded: {e}") from None
        with self.lock:  # the sockets are not thread-safe; the balancer is shared
            self.dp.send_req(msg, data)
            self._unfinished.add(msg.rid)

    def next(self, q: queue.Queue) -> Any:
        return q.get()  # fail() puts the error on every queue

    def abort(self, rid: str) -> None:
        with self.lock:
            self.dp.abort(rid)

    # --- control ------------------------------------------------------------------------------
    def call(self, msg: Any) -> list[Any]:
        """A control message, applied by every replica between two steps; their replies in
        rank order."""
        with self._control:
            self.check_alive()
            with self.lock:
                self.dp.broadcast(encode(msg))
            replies = [self._reply() for _ in range(self.dp_size)]
        return sorted(replies, key=lambda r: r.dp_rank)

    def _reply(self) -> Any:
        while True:
            try:
                return self.replies.get(timeout=POLL_MS / 1000)
            except queue.Empty:
                self.check_alive()

    def update_weights(self, msg: UpdateWeightFromDiskReq) -> list[UpdateWeightFromDiskOutput]:
        """Every replica's reply, once it applied (or refused) the update."""
        return self.call(msg)

    def wait_idle(self, timeout: float) -> None:
        """Block until no request is waiting or running (aborts settle in a step)."""
        deadline = time.monotonic() + timeout
        while True:
            infos = [out.info for out in self.call(GetInfoReq())]
            if all(i["num_running_reqs"] == 0 and i["num_waiting_reqs"] == 0 for i in infos):
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"engine not idle after {timeout} s: {infos}")
            time.sleep(0.005)

    def shutdown(self) -> None:
        """Abort what is still running (its callers get the aborted outputs), stop the
        replica processes; later calls raise EngineError."""
        with self.lock:
            self.stopped = True
            rids = list(self._unfinished)
        for rid in rids:
            self.abort(rid)
        deadline = time.monotonic() + SHUTDOWN_DRAIN_S
        while self.error is None and time.monotonic() < deadline:
            with self.lock:
                if not self._unfinished.intersection(rids):
                    break
            time.sleep(0.01)
        self._closing = True
        self._thread.join()
        failed = self.error
        self.fail(EngineError("the engine is shut down"))  # whoever still waits
        self.error = failed  # check_alive says "shut down" unless a replica had failed
        self._close()

    def _close(self) -> None:
        self._closing = True
        self.children.stop(timeout=10.0)
        self.dp.close()
        self._pull.close(linger=0)
        self._ctx.term()
