"""The storage tier's moving parts: a writer thread, a prefetch thread, and their counts.

``StorageTier`` never touches the KV pool or the radix tree: the scheduler thread hands it
copies of pages to write (``write``) and takes back pages it loaded (``start_load`` ->
``PageLoad``). Every failure on the way (a full or read-only directory, a missing,
truncated or corrupt page, too many bytes in flight) is a miss that is counted and, where
it is new, logged: the tokens are recomputed, the request never fails.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from radixlm.radix_cache.storage.base import StorageBackend
from radixlm.radix_cache.storage.page_format import CorruptPage, decode_page, encode_page

logger = logging.getLogger(__name__)

MAX_PENDING_WRITE_BYTES = 512 << 20  # pages copied but not yet written; past it: dropped
MAX_PREFETCH_BYTES = 1 << 30  # pages loaded but not yet taken by their request
MAX_KNOWN_KEYS = 1 << 18  # keys remembered as stored (not copied again): about 40 MB


@dataclass
class PageLoad:
    """Pages ``first_page ..`` of one request, read in order by the prefetch thread until
    the first miss or ``cancel``; ``pages[i]``: ``[2 * layers, block, heads, head_dim]``."""

    keys: list[str]
    tokens: list[list[int]]
    first_page: int
    pages: list[torch.Tensor] = field(default_factory=list)
    cancelled: bool = False
    abandoned: bool = False  # released before it was done (see StorageTier.release)
    done: threading.Event = field(default_factory=threading.Event)
    nbytes: int = 0

    def cancel(self) -> None:
        """Stop after the page being read (``done`` is set soon after)."""
        self.cancelled = True


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
             "pages_corrupt", "writes_dropped", "writes_failed", "writes_skipped"), 0)
        self._writes: queue.Queue = queue.Queue()
        self._writer = threading.Thread(target=self._write_loop, name="hicache-writer",
                                        daemon=True)
        self._writer.start()
        self._loader = ThreadPoolExecutor(1, thread_name_prefix="hicache-prefetch")

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
        """Write what is queued, then stop both threads."""
        self._writes.put(None)
        self._writer.join(timeout=30)
        self._loader.shutdown(wait=True, cancel_futures=True)

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
        try:
            self._loader.submit(self._load, load)
        except RuntimeError:  # shut down
            load.done.set()
        return load

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

    def _load(self, load: PageLoad) -> None:
        try:
            for i in range(load.first_page, len(load.keys)):
                if load.cancelled or not self._reserve(load):
                    break
                kv = self.read(load.keys[i], load.tokens[i])
                if kv is None:  # the pages after it cannot be reached: write them again
                    self._reserve(load, -1)
                    for key in load.keys[i:]:
                        self._forget(key)
                    break
                load.pages.append(kv)
        finally:
            with self._lock:
                load.done.set()
                if load.abandoned:
                    self._prefetched_bytes -= load.nbytes
                    load.nbytes = 0

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
        data = self.backend.get(key)
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
