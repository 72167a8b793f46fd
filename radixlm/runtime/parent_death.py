"""die_with_parent: a child process of radixlm's (scheduler, detokenizer, grammar compile
worker) ends when its parent does, even when the parent is SIGKILLed and runs no cleanup."""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import sys

logger = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1


def die_with_parent(parent_pid: int, sig: int = signal.SIGKILL) -> None:
    """Linux: the kernel sends ``sig`` to this process when its parent dies; a parent that
    died before that took effect ends this process now."""
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(_PR_SET_PDEATHSIG, sig, 0, 0, 0)
        except (OSError, AttributeError):  # no prctl: callers poll the ppid as well
            logger.debug("prctl(PR_SET_PDEATHSIG) unavailable")
    if os.getppid() != parent_pid:
        os._exit(1)
