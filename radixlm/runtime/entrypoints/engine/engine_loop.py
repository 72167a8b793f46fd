"""The offline Engine's scheduler loop (one replica), with no thread of its own.

Whichever caller is waiting for outputs runs the loop (one at a time, under ``drive``), so
the model runs on the caller's thread with all its torch threads. Other callers wait on
their queues and take over the loop when it is free. Messages from any thread go through
``inbox``; each request's outputs come back on its own queue (``submit`` / ``outputs``,
``RequestStreams``, which ``Engine(dp_size > 1)``'s ``ReplicaProcesses`` shares).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Iterator
from typing import Any

import torch

from radixlm.runtime.managers.messages import (
    AbortReq,
    GenerateReqInput,
    ReqOutput,
    UpdateWeightFromDiskOutput,
    UpdateWeightFromDiskReq,
)
from radixlm.runtime.managers.scheduler.scheduler import Scheduler

logger = logging.getLogger(__name__)


class EngineError(RuntimeError):
    """The engine can serve no more requests: its scheduler failed or it was shut down."""


class RequestStreams:
    """Each request's queue of outputs (``submit`` / ``outputs``) and the engine's failure
    state, shared by both ways of running the replicas: ``EngineLoop`` (in the callers'
    threads) and ``ReplicaProcesses`` (``engine_processes.py``). A subclass supplies
    ``next(q)`` (the next item of a queue, waiting as it must) and ``_send(msg)`` (deliver
    a request to the replicas)."""

    def __init__(self) -> None:
        self.streams: dict[str, queue.Queue] = {}
        self.versions: dict[str, str] = {}  # rid -> weight version of its latest output
        self.lock = threading.Lock()  # guards streams, versions and error
        self.stopped = False
        self.error: BaseException | None = None

    def next(self, q: queue.Queue) -> Any:
        raise NotImplementedError

    def _send(self, msg: GenerateReqInput) -> None:
        raise NotImplementedError

    def fail(self, error: BaseException) -> None:
        """Every pending request and every later one fails with ``error``."""
        with self.lock:
            self.error = error
            for q in self.streams.values():
                q.put(error)

    def check_alive(self) -> None:
        if self.error is not None:
            raise EngineError(f"the scheduler failed: {self.error!r}") from self.error
        if self.stopped:
            raise EngineError("the engine is shut down")

    def submit(self, msg: GenerateReqInput) -> queue.Queue:
        """Queue a request; its outputs arrive on the returned queue (``outputs``)."""
        q: queue.Queue = queue.Queue()
        with self.lock:  # a failure either sees this stream or is seen by check_alive
            self.check_alive()
            if msg.rid in self.streams:
                raise ValueError(f"rid {msg.rid!r} is already in use")
            self.streams[msg.rid] = q
        try:
            self._send(msg)
        except BaseException:
            with self.lock:
                self.streams.pop(msg.rid, None)
            raise
        return q

    def outputs(self, rid: str, q: queue.Queue) -> Iterator[ReqOutput]:
        """``rid``'s outputs until it finishes; a 400 from the scheduler is a ValueError."""
        try:
            while True:
                out = self.next(q)
                if isinstance(out, BaseException):
                    raise EngineError(f"the scheduler failed: {out!r}") from out
                reason = out.finish_reason or {}
                if reason.get("status_code") == 400:  # a bad request found by the scheduler
                    raise ValueError(reason.get("message", "bad request"))
                yield out
                if out.finished:
                    return
        finally:
            with self.lock:
                self.streams.pop(rid, None)
                self.versions.pop(rid, None)


class EngineLoop(RequestStreams):
    """The scheduler's loop, driven by the callers; every method may be called from any
    thread."""

    def __init__(self, scheduler: Scheduler) -> None:
        super().__init__()
        self.scheduler = scheduler
        self.inbox: queue.Queue = queue.Queue()
        self.update_replies: queue.Queue = queue.Queue()
        self.drive = threading.Lock()  # held by the thread running the loop

    def _drain_inbox(self) -> list[Any]:
        msgs = []
        try:
            while True:
                msgs.append(self.inbox.get_nowait())
        except queue.Empty:
            return msgs

    def _send(self, msg: GenerateReqInput) -> None:
        self.inbox.put(msg)

    def _emit(self, obj: Any) -> None:
        if isinstance(obj, UpdateWeightFromDiskOutput):
            self.update_replies.put(obj)
        elif isinstance(obj, list):
            # sent before any update is applied
            version = self.scheduler.weight_version
            with self.lock:
                for out in obj:
                    q = self.streams.get(out.rid)
                    if q is not None:
                        self.versions[out.rid] = version
                        q.put(out)

    def turn(self) -> None:
        """One loop turn; the caller holds ``drive``. A failure fails every request."""
        self.check_alive()
        try:
            with torch.inference_mode():
                self.scheduler.run_once(self._drain_inbox(), self._emit)
        except BaseException as e:
            logger.exception("the scheduler failed")
            self.fail(e)
            raise

    def next(self, q: queue.Queue) -> Any:
        """The next item of ``q``, running the loop while nobody else does."""
        while True:
            try:
                return q.get_nowait()
            except queue.Empty:
                pass
            if self.drive.acquire(blocking=False):
                try:
                    self.turn()
                finally:
                    self.drive.release()
            else:
                try:
                    return q.get(timeout=0.005)
                except queue.Empty:
                    continue

    def call(self, msg: Any) -> list[Any]:
        """A control message, applied between two steps; the reply (in a list, as
        ``ReplicaProcesses.call`` answers with one per replica).
        The caller runs one turn of the loop first: Python's lock is not fair, so a thread
        that polls (``get_server_info`` in a loop) would otherwise take ``drive`` back at
        every release and starve the threads waiting for their outputs."""
        with self.drive:
            self.turn()
            return [self.scheduler.handle(msg)]

    def abort(self, rid: str) -> None:
        self.inbox.put(AbortReq(rid))

    def update_weights(self, msg: UpdateWeightFromDiskReq) -> list[UpdateWeightFromDiskOutput]:
        """The reply (in a list), once the scheduler applied (or refused) the update."""
        self.check_alive()
        self.inbox.put(msg)
        return [self.next(self.update_replies)]

    def wait_idle(self, timeout: float) -> None:
        """Block until no request is waiting or running (aborts settle in a step)."""
        deadline = time.monotonic() + timeout
        while True:
            with self.drive:
                self.turn()
                if self.scheduler.is_idle() and self.inbox.empty():
                    return
            if time.monotonic() > deadline:
                raise TimeoutError(f"engine not idle after {timeout} s: "
                                   f"{self.scheduler.get_info()}")

    def shutdown(self) -> None:
        """Abort what is still running; later calls raise EngineError."""
        with self.drive:
            with self.lock:
                rids = list(self.streams)
            for rid in rids:
                self.scheduler.abort(rid, "the engine shut down")
            self.scheduler.grammar_compiler.shutdown()
            self.stopped = True
