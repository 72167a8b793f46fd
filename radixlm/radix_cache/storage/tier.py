"""The storage tier's moving parts: a writer thread, a prefetch thread, and their counts.

``StorageTier`` never touches the KV pool or the radix tree: the scheduler thread hands it
copies of pages to write (``write``) and takes back pages it loaded (``start_load`` ->
``PageLoad``). Every failure on the way (a full or read-only directory, a missing,
truncated, corrupt or refused page, too many bytes in flight, a read past its deadline) is
a miss that is counted and, where it is new, logged: the tokens are recomputed, the request
never fails.

The scheduler never waits on the prefetch thread: it polls a ``PageLoad`` (``done``,
``pages``, ``stalled``). A read that outlives ``page_deadline`` (a hung filesystem) makes
its page a miss, and ``poll`` retires its thread (left blocked in the read; it drops what it
read) and starts another for the loads queued behind it; past ``MAX_STUCK_READERS`` such
threads reads stop and every page is a miss.
"""

from __future__ import annotations

import logging
import math
import queue
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field

import torch

from radixlm.radix_cache.storage.base import StorageBackend
from radixlm.radix_cache.storage.page_format import (
    CorruptPage,
    decode_page,
    encode_page,
    page_bytes,
)
from radixlm.radix_cache.storage.prefetch_policy import moving_average

logger = logging.getLogger(__name__)

MAX_PENDING_WRITE_BYTES = 512 << 20  # pages copied but not yet written; past it: dropped
MAX_PREFETCH_BYTES = 1 << 30  # pages loaded but not yet taken by their request
MAX_KNOWN_KEYS = 1 << 18  # keys remembered as stored (not copied again): about 40 MB
PAGE_DEADLINE_S = 5.0  # a page read that takes longer is a miss (its thread is replaced)
MAX_STUCK_READERS = 4  # prefetch threads left blocked in a read before reads stop


@dataclass
class PageLoad:
    """Pages ``first_page ..`` of one request, read in order by the prefetch thread until
    the first miss or ``cancel``; ``pages[i]``: ``[2 * layers, block, heads, head_dim]``.
    ``deadline`` (monotonic): when its request stops waiting for it (the prefetch policy's,
    set by its owner)."""

    keys: list[str]
    tokens: list[list[int]]
    first_page: int
    pages: list[torch.Tensor] = field(default_factory=list)
    cancelled: bool = False
    abandoned: bool = False  # released before it was done (see StorageTier.release)
    done: threading.Event = field(default_factory=threading.Event)
    nbytes: int = 0
    started: float = field(default_factory=time.monotonic)
    deadline: float = math.inf
    reading_since: float | None = None  # when the read of the page in flight began

    def cancel(self) -> None:
        """Stop after the page being read (``done`` is set soon after)."""
        self.cancelled = True

    def stalled(self, now: float, page_deadline: float) -> bool:
        """Whether the page in flight has been read for longer than ``page_deadline``."""
        since = self.reading_since
        return since is not None and now - since > page_deadline


class _Reader:
    """One prefetch thread and the load it is reading; ``retired`` once a read of it
    outlived the page deadline (it then drops what it read and ends)."""

    def __init__(self, tier: StorageTier) -> None:
        self.retired = False
        self.load: PageLoad | None = None
        self.thread = threading.Thread(target=tier._read_loop, args=(self,), daemon=True,
                                       name="hicache-prefetch")
        self.thread.start()


class StorageTier:
    """Pages of ``shape`` = ``[2 * layers, block_tokens, kv heads, head_dim]`` in ``dtype``
    on ``backend``."""

    def __init__(self, backend: StorageBackend, dtype: torch.dtype,
                 shape: tuple[int, int, int, int]) -> None:
        self.backend = backend
        self.dtype = dtype
        self.shape = shape
        self.page_bytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        self._known: OrderedDict[str, None] = OrderedDict()
        self._lock = threading.Lock()
        self._pending_write_bytes = 0
        self._prefetched_bytes = 0
        self.stats: dict[str, int] = dict.fromkeys(
            ("pages_written", "bytes_written", "pages_read", "bytes_read", "pages_missed",
             "pages_corrupt", "writes_dropped", "writes_failed", "writes_skipped",
             "reads_timed_out"), 0)
        self._writes: queue.Queue = queue.Queue()
        self._writer = threading.Thread(target=self._write_loop, name="hicache-writer",
                                        daemon=True)
        self._writer.start()
        self.page_deadline = PAGE_DEADLINE_S
        self.page_seconds: float | None = None  # measured: one page read and checked
        self.progress = threading.Event()  # set whenever a page arrives or a load ends
        self.reads_stopped = False  # MAX_STUCK_READERS threads hung in reads
        self._loads: queue.Queue[PageLoad | None] = queue.Queue()
        self._stuck: list[_Reader] = []
        self._reader = _Reader(self)

    # --- writes (scheduler thread enqueues, writer thread writes) -----------------------
    def known(self, key: str) -> bool:
        """Whether this tier wrote or read ``key`` (and has not missed it since)."""
        with self._lock:
            return key in self._known

    def write(self, key: str, tokens: list[int], kv: torch.Tensor) -> bool:
        """Queue one page (``kv``: a CPU copy the caller no longer touches); False if
        dropped because ``MAX_PENDING_WRITE_BYTES`` are already queued."""
        with self._lock:
            if self._pending_write_bytes + self.page_bytes > MAX_PENDING_WRITE_BYTES:
                self.stats["writes_dropped"] += 1
                return False
            self._pending_write_bytes += self.page_bytes
            self._remember(key)
        self._writes.put((key, tokens, kv))
        return True

    def pending_write_bytes(self) -> int:
        with self._lock:
            return self._pending_write_bytes

    def flush(self, timeout: float | None = None) -> None:
        """Wait until every queued page is written (tests, shutdown)."""
        done = threading.Event()
        self._writes.put(done)
        done.wait(timeout)

    def close(self) -> None:
        """Write what is queued, then stop both threads (loads not started are dropped)."""
        self._writes.put(None)
        self._writer.join(timeout=30)
        self._stop_reads()
        self._loads.put(None)
        self._reader.thread.join(timeout=self.page_deadline)

    def _write_loop(self) -> None:
        while True:
            item = self._writes.get()
            if item is None:
                return
            if isinstance(item, threading.Event):
                item.set()
                continue
            key, tokens, kv = item
            try:
                self._write_one(key, tokens, kv)
            except Exception:  # noqa: BLE001 - the writer must outlive any one page
                logger.exception("hicache: writing page %s failed", key)
                self._forget(key)
            finally:
                with self._lock:
                    self._pending_write_bytes -= self.page_bytes

    def _write_one(self, key: str, tokens: list[int], kv: torch.Tensor) -> None:
        data = encode_page(key, tokens, kv)
        if self.backend.size(key) == len(data):  # another server (or an earlier run) wrote it
            self.stats["writes_skipped"] += 1
            return
        if self.backend.put(key, data):
            self.stats["pages_written"] += 1
            self.stats["bytes_written"] += len(data)
        else:
            self.stats["writes_failed"] += 1
            self._forget(key)

    # --- reads (prefetch thread) ----------------------------------------------------------
    def start_load(self, keys: list[str], tokens: list[list[int]], first_page: int) -> PageLoad:
        """Read pages ``first_page ..`` of ``keys`` in the background."""
        load = PageLoad(keys, tokens, first_page)
        if self.reads_stopped:
            load.done.set()
        else:
            self._loads.put(load)
        return load

    def poll(self, now: float) -> None:
        """Scheduler thread: retire the prefetch thread if its read is past the page
        deadline, and start another (or, past ``MAX_STUCK_READERS``, stop reading)."""
        reader = self._reader
        load = reader.load
        if load is None or not load.stalled(now, self.page_deadline):
            return
        reader.retired = True
        self.stats["reads_timed_out"] += 1
        self._stuck = [r for r in self._stuck if r.thread.is_alive()] + [reader]
        if len(self._stuck) >= MAX_STUCK_READERS:
            logger.error("hicache: %d prefetch threads are blocked in reads of %s; storage "
                         "reads stop (every page is recomputed)", len(self._stuck),
                         self.backend.info().get("dir", self.backend.name))
            self._stop_reads()
            return
        logger.warning("hicache: a page read took over %.1f s; it is a miss, and reads go on "
                       "in a new thread", self.page_deadline)
        self._reader = _Reader(self)

    def _stop_reads(self) -> None:
        self.reads_stopped = True
        while True:
            try:
                load = self._loads.get_nowait()
            except queue.Empty:
                break
            if load is not None:
                load.done.set()
        self.progress.set()

    def _read_loop(self, reader: _Reader) -> None:
        while not reader.retired:
            load = self._loads.get()
            if load is None:
                return
            reader.load = load
            self._load(load, reader)
            reader.load = None

    def release(self, load: PageLoad) -> None:
        """``load``'s pages were taken or are dropped: their bytes leave the prefetch
        budget (now if it is done, else when its thread stops: it is cancelled)."""
        load.cancel()
        with self._lock:
            if not load.done.is_set():
                load.abandoned = True
                return
            self._prefetched_bytes -= load.nbytes
            load.nbytes = 0

    def _load(self, load: PageLoad, reader: _Reader) -> None:
        try:
            for i in range(load.first_page, len(load.keys)):
                if load.cancelled or reader.retired or not self._reserve(load):
                    break
                start = load.reading_since = time.monotonic()
                kv = self.read(load.keys[i], load.tokens[i])
                load.reading_since = None
                if kv is None or reader.retired:  # a miss (or too late): write them again
                    self._reserve(load, -1)
                    for key in load.keys[i:]:
                        self._forget(key)
                    break
                self.page_seconds = moving_average(self.page_seconds,
                                                   time.monotonic() - start)
                load.pages.append(kv)
                self.progress.set()
        finally:
            with self._lock:
                load.done.set()
                if load.abandoned:
                    self._prefetched_bytes -= load.nbytes
                    load.nbytes = 0
            self.progress.set()


    def _reserve(self, load: PageLoad, pages: int = 1) -> bool:
        """Count ``pages`` more (or fewer) pages of ``load`` against ``MAX_PREFETCH_BYTES``."""
        with self._lock:
            delta = pages * self.page_bytes
            if delta > 0 and self._prefetched_bytes + delta > MAX_PREFETCH_BYTES:
                return False
            self._prefetched_bytes += delta
            load.nbytes += delta
            return True

    def read(self, key: str, tokens: list[int]) -> torch.Tensor | None:
        """One page, checked (``page_format``); None on a miss or a bad page (deleted)."""
        data = self.backend.get(key, page_bytes(key, tokens, self.dtype, self.shape))
        if data is None:
            self.stats["pages_missed"] += 1
            self._forget(key)
            return None
        try:
            kv = decode_page(data, key, tokens, self.dtype, self.shape)
        except CorruptPage as e:
            self.stats["pages_corrupt"] += 1
            logger.warning("hicache: %s; deleting it, its tokens are recomputed", e)
            self.backend.delete(key)
            self._forget(key)
            return None
        self.stats["pages_read"] += 1
        self.stats["bytes_read"] += len(data)
        with self._lock:
            self._remember(key)
        return kv

    # --- known keys ------------------------------------------------------------------------
    def _remember(self, key: str) -> None:
        self._known[key] = None
        self._known.move_to_end(key)
        if len(self._known) > MAX_KNOWN_KEYS:
            self._known.popitem(last=False)

    def _forget(self, key: str) -> None:
        with self._lock:
            self._known.pop(key, None)
