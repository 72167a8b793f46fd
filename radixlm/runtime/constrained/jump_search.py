"""The text each grammar forces next, found off the scheduler's thread, with a deadline.

A grammar's jump-forward search cannot be interrupted, and a spec can pass the compile
worker's probe of its first steps and force millions of characters later
(``x(b(a{2600}){2600}|a)``: xgrammar's ``find_jump_forward_string`` then takes seconds and
hundreds of MB at every step). So the scheduler does not search on its own thread: one step's
searches go to a worker thread together (``JumpSearch.run``), and the scheduler waits for
them at most ``deadline_s``:

    found = searches.run([req.grammar for req in rows])   # None: no thread free, no jumps
    found.texts[i]        # row i's forced text; None if its search did not run
    found.stuck           # the row whose search passed the deadline (or None)

Rows searched in time jump as before. The row whose search passed the deadline is ended by
the caller (its matcher stays with the thread until the search returns; nobody else may
touch it), and the rows after it skip their jump this step (the mask still holds them to the
grammar: jump-forward only saves forwards). At most ``threads`` searches run at once,
abandoned ones included; with every thread held, a step takes no jumps at all rather than
wait.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Found:
    """One step's searches: each row's forced text (None: not searched) and the CPU
    seconds its search took; ``stuck``: the row still searching at the deadline."""

    matchers: list[Any]
    texts: list[str | None] = field(init=False)
    cpu_s: list[float] = field(init=False)
    stuck: int | None = None
    _current: int = -1
    _cancelled: bool = False
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def __post_init__(self) -> None:
        self.texts = [None] * len(self.matchers)
        self.cpu_s = [0.0] * len(self.matchers)


class JumpSearch:
    """Runs a step's forced-text searches on worker threads, waiting ``deadline_s``."""

    def __init__(self, deadline_s: float, threads: int = 2) -> None:
        assert deadline_s > 0 and threads >= 1, (deadline_s, threads)
        self.deadline_s = deadline_s
        self.threads = threads
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="jump-forward")
        self._running = 0  # searches not yet returned, abandoned ones included
        self._lock = threading.Lock()
        self.abandoned = 0  # searches the scheduler stopped waiting for, since start

    def run(self, matchers: list[Any]) -> Found | None:
        """Each matcher's forced text, searched in order on one worker thread; None when
        every thread is held by a search that passed its deadline."""
        with self._lock:
            if self._running >= self.threads:
                return None
            self._running += 1
        found = Found(matchers)
        future = self._pool.submit(self._search, found)
        try:
            future.result(timeout=self.deadline_s)
        except FutureTimeout:
            with found._lock:
                found._cancelled = True
                if found._current >= 0 and found.texts[found._current] is None:
                    found.stuck = found._current
            self.abandoned += 1
        return found

    def _search(self, found: Found) -> None:
        try:
            for i, matcher in enumerate(found.matchers):
                with found._lock:
                    if found._cancelled:
                        return
                    found._current = i
                start = time.thread_time()  # CPU time, as StepCost counts it
                text = matcher.forced_string()
                with found._lock:
                    found.cpu_s[i] = time.thread_time() - start
                    found.texts[i] = text
        finally:
            with self._lock:
                self._running -= 1

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
