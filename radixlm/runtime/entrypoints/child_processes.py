"""The server's child processes (scheduler, detokenizer), as the parent sees them: start,
watchdog, stop. What a child does first is ``managers/child_setup.py``."""

from __future__ import annotations

import atexit
import importlib
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
    """The scheduler processes (one per data-parallel replica) and the detokenizer, and
    what the parent shares with them:

    - a private 0700 directory for their ipc sockets, removed on every exit of this
      process that runs Python (stop, a child's death, atexit); one left by a process
      that was SIGKILLed is removed by the next server that starts;
    - each scheduler's heartbeat (``heartbeat_age``), which its loop refreshes each turn.

    A watchdog thread exits the server (code 1) if a child dies while it is not shutting
    down, except a replica while another one lives: that one is ``retire``d and
    ``on_replica_exit`` is told (the server takes it out of rotation)."""

    def __init__(self, dp_size: int = 1) -> None:
        self.ctx = multiprocessing.get_context("spawn")
        self.procs: dict[str, multiprocessing.process.BaseProcess] = {}
        self.stopping = False
        self.stalled = False  # set when the server's watchdog found every scheduler stuck
        _remove_stale_ipc_dirs()
        self.ipc_dir = tempfile.mkdtemp(prefix=f"{IPC_PREFIX}{os.getpid()}-")
        os.chmod(self.ipc_dir, 0o700)
        self.dp_size = dp_size
        self.heartbeats = [self.ctx.Value("d", time.monotonic(), lock=False)
                           for _ in range(dp_size)]
        self.retired: set[int] = set()  # replicas taken out of rotation
        atexit.register(self.kill)

    def address(self, name: str) -> str:
        return f"ipc://{self.ipc_dir}/{name}"

    def scheduler_name(self, dp_rank: int) -> str:
        return "scheduler" if self.dp_size == 1 else f"scheduler-dp{dp_rank}"

    def live_replicas(self) -> list[int]:
        return [r for r in range(self.dp_size) if r not in self.retired]

    def heartbeat_age(self, dp_rank: int | None = None) -> float:
        """Seconds since a scheduler's loop last turned (CLOCK_MONOTONIC is system-wide);
        without ``dp_rank``, that of the live replica that turned last."""
        ranks = [dp_rank] if dp_rank is not None else self.live_replicas() or [0]
        return time.monotonic() - max(self.heartbeats[r].value for r in ranks)

    def retire(self, dp_rank: int) -> None:
        """Take replica ``dp_rank`` out: it is killed if it still runs (a stuck one)."""
        self.retired.add(dp_rank)
        proc = self.procs.get(self.scheduler_name(dp_rank))
        if proc is not None and proc.is_alive():
            proc.kill()

    def start(self, name: str, target: str, *args: Any) -> None:
        """Spawn ``target(*args)``, named ``"package.module:function"``: the child imports
        it, so this process need not have (a scheduler's imports take seconds of a core,
        and the server starts its children before its own)."""
        proc = self.ctx.Process(target=run_named, args=(target, *args), name=f"radixlm-{name}",
                                daemon=True)
        proc.start()
        self.procs[name] = proc

    def alive(self) -> bool:
        return all(p.is_alive() for p in self.procs.values())

    def pids(self) -> dict[str, int | None]:
        return {name: p.pid for name, p in self.procs.items()}

    def watch(self, on_replica_exit: Callable[[int, str], None] | None = None) -> None:
        """``on_replica_exit(dp_rank, why)`` is called from the watchdog thread."""
        threading.Thread(target=self._watch, args=(on_replica_exit,), name="radixlm-watchdog",
                         daemon=True).start()

    def _watch(self, on_replica_exit: Callable[[int, str], None] | None) -> None:
        ranks = {self.scheduler_name(r): r for r in range(self.dp_size)}
        while not self.stopping:
            for name, proc in self.procs.items():
                rank = ranks.get(name)
                if proc.exitcode is None or self.stopping or rank in self.retired:
                    continue
                if rank is not None and on_replica_exit is not None and len(
                        self.live_replicas()) > 1:
                    why = (f"data-parallel replica {rank} (the {name} process, pid {proc.pid}) "
                           f"exited with code {proc.exitcode}")
                    logger.error("%s; serving on the other replicas", why)
                    self.retire(rank)
                    on_replica_exit(rank, why)
                    continue
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
# the children's entry points (``ChildProcesses.start`` imports them in the child)
SCHEDULER_ENTRY = "radixlm.runtime.managers.scheduler.scheduler_process:run_scheduler_process"
DETOKENIZER_ENTRY = "radixlm.runtime.managers.detokenizer:run_detokenizer_process"


def run_named(target: str, *args: Any) -> None:
    """In the child: import ``"package.module:function"`` and call it with ``args``."""
    module, function = target.split(":")
    getattr(importlib.import_module(module), function)(*args)


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
