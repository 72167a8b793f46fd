"""The server's child processes (scheduler, detokenizer), as the parent sees them: start,
watchdog, stop. What a child does first is ``managers/child_setup.py``."""

from __future__ import annotations

import atexit
import logging
import multiprocessing
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)


class ChildProcesses:
    """The scheduler and detokenizer processes, and what the parent shares with them:

    - a private 0700 directory for their ipc sockets, removed on every exit of this
      process that runs Python (stop, a child's death, atexit); one left by a process
      that was SIGKILLed is removed by the next server that starts;
    - the scheduler's heartbeat (``heartbeat_age``), which its loop refreshes each turn.

    A watchdog thread exits the server (code 1) if a child dies while it is not shutting
    down."""

    def __init__(self) -> None:
        self.ctx = multiprocessing.get_context("spawn")
        self.procs: dict[str, multiprocessing.process.BaseProcess] = {}
        self.stopping = False
        self.stalled = False  # set when the server's watchdog found the scheduler stuck
        _remove_stale_ipc_dirs()
        self.ipc_dir = tempfile.mkdtemp(prefix=f"{IPC_PREFIX}{os.getpid()}-")
        os.chmod(self.ipc_dir, 0o700)
        self.heartbeat = self.ctx.Value("d", time.monotonic(), lock=False)
        atexit.register(self.kill)

    def address(self, name: str) -> str:
        return f"ipc://{self.ipc_dir}/{name}"

    def heartbeat_age(self) -> float:
        """Seconds since the scheduler's loop last turned (CLOCK_MONOTONIC is system-wide)."""
        return time.monotonic() - self.heartbeat.value

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
        shutil.rmtree(self.ipc_dir, ignore_errors=True)


IPC_PREFIX = "radixlm-"


def _remove_stale_ipc_dirs() -> None:
    """ipc directories of servers that were killed before they could remove their own."""
    for path in Path(tempfile.gettempdir()).glob(f"{IPC_PREFIX}*-*"):
        pid = path.name[len(IPC_PREFIX):].split("-", 1)[0]
        if not pid.isdigit() or not path.is_dir() or path.stat().st_uid != os.getuid():
            continue
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            shutil.rmtree(path, ignore_errors=True)
        except PermissionError:
            pass
