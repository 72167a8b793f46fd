"""Giving the heap that large responses freed back to the system (glibc's malloc_trim).

A request with prompt logprobs and ``top_logprobs_num`` 64 over a 4k prompt holds about
45 MB of Python objects and 9 MB of JSON in the HTTP process while it is answered. They
are freed when it ends, but glibc keeps the freed pages: 10 such requests at once left
the process about 200 MB larger than before, every time (measured in-process; no object
outlives its request). ``HeapTrimmer`` calls ``malloc_trim(0)`` once such requests have
finished (debounced, on a worker thread: ctypes releases the GIL, so the event loop keeps
running). Elsewhere than glibc it does nothing.
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import logging
import sys
from collections.abc import Callable

from radixlm.runtime.managers.messages import GenerateReqInput, TextOutput

logger = logging.getLogger(__name__)

TRIM_ENTRIES = 100_000  # logprob entries of one request that make a trim worth it
TRIM_DELAY_S = 1.0  # after the latest such request finished (its response is sent by then)


def _malloc_trim() -> Callable[[int], int] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):  # not glibc (musl has no malloc_trim)
        return None


def logprob_entries(msg: GenerateReqInput, out: TextOutput) -> int:
    """About how many logprob entries a finished request's answer held."""
    if not msg.return_logprob:
        return 0
    start = msg.logprob_start_len if msg.logprob_start_len >= 0 else out.prompt_tokens
    positions = max(out.prompt_tokens - start, 0) + out.completion_tokens
    per_position = 1 + msg.top_logprobs_num + len(msg.token_ids_logprob or ())
    return positions * per_position


class HeapTrimmer:
    """``note_finished`` after each finished request; trims once the big ones are done."""

    def __init__(self, delay: float = TRIM_DELAY_S) -> None:
        self.delay = delay
        self.trims = 0  # how many trims ran (tests read it)
        self._trim = _malloc_trim()
        self._handle: asyncio.TimerHandle | None = None

    def note_finished(self, msg: GenerateReqInput, out: TextOutput) -> None:
        if self._trim is None or logprob_entries(msg, out) < TRIM_ENTRIES:
            return
        if self._handle is not None:
            self._handle.cancel()
        self._handle = asyncio.get_running_loop().call_later(self.delay, self._start)

    def _start(self) -> None:
        self._handle = None
        asyncio.get_running_loop().run_in_executor(None, self._run)

    def _run(self) -> None:
        assert self._trim is not None
        self._trim(0)
        self.trims += 1
