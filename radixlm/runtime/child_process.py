"""The server's child processes (scheduler, detokenizer): the parent's handle on them
(``ChildProcesses``: start, watchdog, stop) and what the children share (dying with the
parent, stopping on SIGTERM, logging)."""

from __future__ import annotations

import atexit
import ctypes
import logging
import multiprocessing
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

logger = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1
LOG_FORMAT = "[%(asctime)s] %(levelname)s %(name)s: %(message)s"


def _set_parent_death_signal(sig: int) -> None:
    """Linux: the kernel sends ``sig`` to this process when its parent dies."""
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, sig, 0, 0, 0)
    except (OSError, AttributeError):  # no prctl: the ppid polling still catches it
        logger.debug("prctl(PR_SET_PDEATHSIG) unavailable")


def setup_child(name: str, parent_pid: int, log_level: str) -> Callable[[], bool]:
    """Call first thing in a child. Returns ``should_stop()``: true after SIGTERM or once
    the parent is gone. The child leaves the parent's process group so that a Ctrl-C in
    the terminal reaches only the parent, which drains requests and then stops us."""
    logging.basicConfig(level=log_level.upper(), format=f"{LOG_FORMAT} [{name}]")
    os.setpgrp()
    _set_parent_death_signal(signal.SIGKILL)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        os._exit(1)

    def should_stop() -> bool:
        return stop.is_set() or os.getppid() != parent_pid

    return should_stop


class ChildProcesses:
    """The scheduler and detokenizer processes; a watchdog exits the server (code 1) if
    either dies while it is not shutting down."""

    def __init__(self) -> None:
        self.ctx = multiprocessing.get_context("spawn")
        self.procs: dict[str, multiprocessing.process.BaseProcess] = {}
        self.stopping = False
        atexit.register(self.kill)

    def start(self, name: str, target: Callable[..., None], *args: Any) -> None:
        proc = self.ctx.Process(target=target, args=args, name=f"radixlm-{name}", daemon=True)
        proc.start()
        self.procs[name] = proc

    def alive(self) -> bool:
        return all(p.is_alive() for p in self.procs.values())

    def pids(self) -> dict[str, int | None]:
        return {name: p.pid for name, p in self.procs.items()}

    def watch(self) -> None:
        threading.Thread(target=self._watch, name="radixlm-watchdog", daemon=True).start()

    def _watch(self) -> None:
        while not self.stopping:
            for name, proc in self.procs.items():
                if proc.exitcode is not None and not self.stopping:
                    logger.error(
                        "the %s process exited with code %s; shutting down", name, proc.exitcode
                    )
                    self.kill()
                    os._exit(1)
            time.sleep(0.2)

    def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM, then SIGKILL whoever is still there after ``timeout``."""
        self.stopping = True
        for proc in self.procs.values():
            if proc.is_alive():
                proc.terminate()
        for proc in self.procs.values():
            proc.join(timeout)
        self.kill()

    def kill(self) -> None:
        self.stopping = True
        for proc in self.procs.values():
            if proc.is_alive():
                proc.kill()
                proc.join(5)
