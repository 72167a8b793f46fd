"""How the server ends: SIGTERM/SIGINT draining (``DrainingServer``), the scheduler
watchdog (``scheduler_watchdog``), which ends it with exit code 1 when the scheduler's loop
stops turning, and the event-loop watchdog (``LoopWatchdog``), which does the same when the
HTTP process's own event loop stops turning (no signal handler can run then)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator

import uvicorn

from radixlm.runtime.entrypoints.child_processes import ChildProcesses
from radixlm.runtime.managers.tokenizer_manager.tokenizer_manager import TokenizerManager

logger = logging.getLogger(__name__)


class DrainingServer(uvicorn.Server):
    """uvicorn, with SIGTERM/SIGINT draining first: new requests get 503, running ones get
    ``shutdown_timeout`` seconds to finish (then they are aborted), then uvicorn exits.
    A second signal exits at once."""

    def __init__(self, config: uvicorn.Config, tm: TokenizerManager, timeout: float) -> None:
        super().__init__(config)
        self.tm, self.timeout = tm, timeout
        self.drain_task: asyncio.Task | None = None

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._on_signal, sig)
        try:
            yield
        finally:
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.remove_signal_handler(sig)

    def _on_signal(self, sig: int) -> None:
        if self.drain_task is not None:
            logger.warning("second %s: exiting now", signal.Signals(sig).name)
            self.force_exit = self.should_exit = True
            return
        logger.info(
            "%s: draining %d request(s) (up to %.0f s), new requests get 503",
            signal.Signals(sig).name,
            len(self.tm.states),
            self.timeout,
        )
        self.drain_task = asyncio.get_running_loop().create_task(self._drain())

    async def _drain(self) -> None:
        self.tm.draining = True
        deadline = time.monotonic() + self.timeout
        while self.tm.states and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if self.tm.states:
            logger.warning(
                "aborting %d request(s) still running after %.0f s",
                len(self.tm.states),
                self.timeout,
            )
            self.tm.abort_all()
            end = time.monotonic() + 2.0
            while self.tm.states and time.monotonic() < end:
                await asyncio.sleep(0.05)
        self.should_exit = True


async def scheduler_watchdog(tm: TokenizerManager, server: DrainingServer,
                             children: ChildProcesses, timeout: float) -> None:
    """SGLang's watchdog: a scheduler loop that does not turn for ``timeout`` seconds (a
    hung step, a frozen process) fails every in-flight request, marks the server
    unhealthy and ends it with exit code 1. With data-parallel replicas, a stuck one is
    killed and taken out of rotation while another lives (its requests fail with 503).
    A dead child is ChildProcesses' watch."""
    while not server.should_exit:
        await asyncio.sleep(min(1.0, timeout / 4))
        for rank in children.live_replicas():
            age = children.heartbeat_age(rank)
            if age > timeout and len(children.live_replicas()) > 1:
                why = (f"data-parallel replica {rank} made no progress for {age:.0f} s "
                       f"(--watchdog-timeout {timeout:g}); it was stopped")
                logger.error("%s; serving on the other replicas", why)
                children.retire(rank)
                tm.retire_replica(rank, why)
        age = children.heartbeat_age()
        if age <= timeout:
            continue
        msg = (f"the scheduler made no progress for {age:.0f} s (--watchdog-timeout "
               f"{timeout:g}); the server is exiting")
        logger.error(msg)
        children.stalled = True
        tm.unhealthy = msg
        tm.fail_all(503, msg)
        await asyncio.sleep(1.0)  # the failed requests' responses go out
        server.should_exit = True
        return


class LoopWatchdog:
    """Ends the process when its asyncio loop stops turning for ``timeout`` seconds.

    Every check runs before the loop, and bounded work runs off it, so this is the guard
    for a bug: a blocked loop answers nothing, not even ``/health``, and SIGTERM's handler
    (a loop callback) never runs; only SIGKILL would end it. A daemon thread reads the
    loop's heartbeat (``beat``, a loop task) and, past the timeout, logs the main thread's
    stack and calls ``on_stuck`` (``os._exit(1)``: the children die with their parent).
    """

    def __init__(self, timeout: float, on_stuck: Callable[[], None] | None = None) -> None:
        self.timeout = timeout
        self.on_stuck = on_stuck or (lambda: os._exit(1))
        self.last = time.monotonic()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="loop-watchdog", daemon=True)

    async def beat(self) -> None:
        """The loop's side: a heartbeat a few times per timeout, until cancelled."""
        self._thread.start()
        try:
            while True:
                self.last = time.monotonic()
                await asyncio.sleep(min(0.5, self.timeout / 4))
        finally:
            self._stop.set()

    def _watch(self) -> None:
        main = threading.main_thread().ident
        while not self._stop.wait(min(1.0, self.timeout / 4)):
            age = time.monotonic() - self.last
            if age <= self.timeout:
                continue
            frame = sys._current_frames().get(main or 0)
            stack = "".join(traceback.format_stack(frame)) if frame is not None else "?"
            logger.error("the HTTP event loop made no progress for %.0f s (--watchdog-timeout "
                         "%g); the server is exiting. Main thread:\n%s", age, self.timeout,
                         stack)
            self.on_stuck()
            return
