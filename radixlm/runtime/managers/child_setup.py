"""What a server child process (scheduler, detokenizer) does first: die with the parent,
stop on SIGTERM, log with its name. The parent's side is ``entrypoints/child_processes.py``."""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import sys
import threading
from collections.abc import Callable

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
