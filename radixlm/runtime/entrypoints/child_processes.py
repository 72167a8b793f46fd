"""The server's child processes (scheduler, detokenizer), as the parent sees them: start,
watchdog, stop. What a child does first is ``managers/child_setup.py``."""

from __future__ import annotations

import atexit
import logging
import multiprocessing
import os
import threading
import time
from collections.abc import Callable
from typing import Any

logger = logging.getLogger(__name__)


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
