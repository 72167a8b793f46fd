"""glibc's malloc while a CPU forward runs: the activations freed by one forward are kept
for the next instead of being unmapped and faulted in again.

torch allocates a forward's activations afresh and frees them as it goes. glibc serves a
block above its mmap threshold (which never grows past 32 MiB) with a new mapping and
unmaps it when freed, so every such block costs a page fault and a zeroed page per 4 KiB,
every time: a float32 prefill chunk of 2,048 rows at the Qwen2.5-0.5B shape makes an 80 MB
gate/up product and a 40 MB SiLU product in each of its 24 layers (3.1 million page faults
and 7.7 s of system time in a 44 s run). While a forward runs, ``ForwardHeap`` turns
glibc's mmap off (``M_MMAP_MAX`` 0: every block from the heap); and it sets the trim
threshold to 2 GiB once (``M_TRIM_THRESHOLD``, which also fixes the mmap threshold where it
stands), so the heap keeps its free top instead of giving it back to the OS whenever a
block at the top is freed. The process so holds on to its largest forward's activations, as
a caching allocator does (vLLM's CPU worker preloads tcmalloc for the same reason). Outside
forwards (weights, the KV pool, weight updates) large blocks are mapped and unmapped as
before.

Only on Linux with glibc, on a CPU device, and not where the user tuned malloc already
(``MALLOC_MMAP_MAX_`` and the like, a malloc tunable in ``GLIBC_TUNABLES``, another
allocator in ``LD_PRELOAD``); ``--disable-cpu-malloc-cache`` keeps glibc's defaults.
"""

from __future__ import annotations

import ctypes
import logging
import os
import platform
import sys
from functools import cache

logger = logging.getLogger(__name__)

M_TRIM_THRESHOLD = -1
M_MMAP_MAX = -4
DEFAULT_MMAP_MAX = 65536  # glibc's
TRIM_THRESHOLD = (1 << 31) - 1  # mallopt takes an int: 2 GiB
# what the user may have set already (then it stands)
USER_SETTINGS = ("MALLOC_MMAP_MAX_", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_",
                 "MALLOC_TOP_PAD_")
USER_TUNABLES = ("glibc.malloc.mmap_max", "glibc.malloc.mmap_threshold",
                 "glibc.malloc.trim_threshold", "glibc.malloc.top_pad")


def user_tuned_malloc() -> str | None:
    """The environment variable by which the user set what ForwardHeap would, or None."""
    for name in USER_SETTINGS:
        if name in os.environ:
            return name
    if any(t in os.environ.get("GLIBC_TUNABLES", "") for t in USER_TUNABLES):
        return "GLIBC_TUNABLES"
    preload = os.environ.get("LD_PRELOAD", "")
    if any(lib in preload for lib in ("tcmalloc", "jemalloc", "mimalloc")):
        return "LD_PRELOAD"
    return None


@cache
def _mallopt() -> ctypes._CFuncPtr | None:
    if not sys.platform.startswith("linux") or platform.libc_ver()[0] != "glibc":
        return None
    try:
        fn = ctypes.CDLL(None).mallopt
    except (AttributeError, OSError):
        return None
    fn.argtypes, fn.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return fn


def release_free_heap() -> None:
    """Give the heap's free pages back to the system (glibc's ``malloc_trim``): after a
    load, the freed dense buffers of quantized layers and the conversions' temporaries
    would otherwise stay resident (a 1B-class Q4_K_M file: 1.95 -> 1.10 GB)."""
    if _mallopt() is None:
        return
    ctypes.CDLL(None).malloc_trim(0)


class ForwardHeap:
    """``with heap:`` around a forward (a no-op when off)."""

    def __init__(self, on: bool) -> None:
        self.mallopt = _mallopt() if on else None
        why = user_tuned_malloc() if self.mallopt is not None else None
        if why is not None:
            logger.info("%s is set: malloc is left as configured during forwards (no "
                        "heap kept between them, forward_heap.py)", why)
            self.mallopt = None
        if self.mallopt is not None and not self.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD):
            self.mallopt = None
        if self.mallopt is not None:
            logger.info("forwards take their activations from the heap, which keeps them "
                        "for the next one (--disable-cpu-malloc-cache: glibc's defaults)")

    @property
    def on(self) -> bool:
        return self.mallopt is not None

    def __enter__(self) -> None:
        if self.mallopt is not None:
            self.mallopt(M_MMAP_MAX, 0)

    def __exit__(self, *exc: object) -> None:
        if self.mallopt is not None:
            self.mallopt(M_MMAP_MAX, DEFAULT_MMAP_MAX)
