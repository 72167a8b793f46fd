"""The offline Engine's scheduler loop, with no thread of its own.

Whichever caller is waiting for outputs runs the loop (one at a time, under ``drive``), so
the model runs on the caller's thread with all its torch threads. Other callers wait on
their queues and take over the loop when it is free. Messages from any thread go through
``inbox``; each request's outputs come back on its own queue (``submit`` / ``outputs``).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Iterator
from typing import Any

import torch

from radixlm.runtime.managers.data_parallel_controller import SchedulerReplicas
from radixlm.runtime.managers.messages import (
    GenerateReqInput,
    ReqOutput,
    UpdateWeightFromDiskOutput,
)

logger = logging.getLogger(__name__)


class EngineError(RuntimeError):
    """The engine can serve no more requests: its scheduler failed or it was shut down."""


class EngineLoop:
    """The replicas' loop, driven by the callers; every method may be called from any
    thread."""

    def __init__(self, replicas: SchedulerReplicas) -> None:
        self.replicas = replicas
        self.inbox: queue.Queue = queue.Queue()
        self.streams: dict[str, queue.Queue] = {}
        self.versions: dict[str, str] = {}  # rid -> weight version of its latest output
        self.update_replies: queue.Queue = queue.Queue()
        self.lock = threading.Lock()  # guards streams and versions
        self.drive = threading.Lock()  # held by the thread running the loop
        self.stopped = False
        self.error: BaseException | None = None

    def _drain_inbox(self) -> list[Any]:
        msgs = []
        try:
            while True:
                msgs.append(self.inbox.get_nowait())
        except queue.Empty:
            return msgs

    def _send(self, dp_rank: int, obj: Any) -> None:
        if isinstance(obj, UpdateWeightFromDiskOutput):
            self.update_replies.put(obj)
        elif isinstance(obj, list):
            # sent before any update is applied
            version = self.replicas.schedulers[dp_rank].weight_version
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
                self.replicas.run_once(self._drain_inbox(), self._send)
        except BaseException as e:
            logger.exception("the scheduler failed")
            self.fail(e)
            raise

    def fail(self, error: BaseException) -> None:
        """Every pending request and every later one fails with ``error``."""
        self.error = error
        with self.lock:
            for q in self.streams.values():
                q.put(error)

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
        """A control message, applied by every replica between two steps; their replies.
        The caller runs one turn of the loop first: Python's lock is not fair, so a thread
        that polls (``get_server_info`` in a loop) would otherwise take ``drive`` back at
        every release and starve the threads waiting for their outputs."""
        with self.drive:
            self.turn()
            return self.replicas.handle_all(msg)

    def check_alive(self) -> None:
        if self.error is not None:
            raise EngineError(f"the scheduler failed: {self.error!r}") from self.error
        if self.stopped:
            raise EngineError("the engine is shut down")

    def submit(self, msg: GenerateReqInput) -> queue.Queue:
        """Queue a request; its outputs arrive on the returned queue (``outputs``)."""
        self.check_alive()
        q: queue.Queue = queue.Queue()
        with self.lock:
            if msg.rid in self.streams:
                raise ValueError(f"rid {msg.rid!r} is already in use")
            self.streams[msg.rid] = q
        self.inbox.put(msg)
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

    def wait_idle(self, timeout: float) -> None:
        """Block until no request is waiting or running (aborts settle in a step)."""
        deadline = time.monotonic() + timeout
        while True:
            with self.drive:
                self.turn()
                if self.replicas.is_idle() and self.inbox.empty():
                    return
            if time.monotonic() > deadline:
                raise TimeoutError(f"engine not idle after {timeout} s: "
                                   f"{self.replicas.schedulers[0].get_info()}")
