"""What a server child process (scheduler, detokenizer) does first: die with the parent,
stop on SIGTERM, log with its name. The parent's side is ``entrypoints/child_processes.py``."""

from __future__ import annotations

import logging
import os
import signal
import threading
from collections.abc import Callable

from radixlm.runtime.parent_death import die_with_parent

logger = logging.getLogger(__name__)

LOG_FORMAT = "[%(asctime)s] %(levelname)s %(name)s: %(message)s"


def setup_child(name: str, parent_pid: int, log_level: str) -> Callable[[], bool]:
    """Call first thing in a child. Returns ``should_stop()``: true after SIGTERM or once
    the parent is gone. The child leaves the parent's process group so that a Ctrl-C in
    the terminal reaches only the parent, which drains requests and then stops us."""
    logging.basicConfig(level=log_level.upper(), format=f"{LOG_FORMAT} [{name}]")
    os.setpgrp()
    die_with_parent(parent_pid)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, signal.SIG_IGN)

    def should_stop() -> bool:
        return stop.is_set() or os.getppid() != parent_pid

    return should_stop
