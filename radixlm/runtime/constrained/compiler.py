"""GrammarCompiler: compiles grammars off the scheduler loop, with a cache and a time limit.

The scheduler submits a grammar when a constrained request arrives and keeps the request
waiting until the returned future is done; it never blocks on the future. The backends'
compilers (C++ or Rust) release the GIL, so a compile in the worker thread does not stall
the loop. A build cannot be interrupted: the time limit fails the caller's future (the
worker finishes in the background), and the backends' own size limits bound each build.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, InvalidStateError, ThreadPoolExecutor
from typing import Any

from radixlm.runtime.constrained.base import Grammar, GrammarBackend, canonical_spec
from radixlm.runtime.metrics import GRAMMAR_COMPILE_BUCKETS, CumulativeHistogram

logger = logging.getLogger(__name__)


class GrammarCompiler:
    """Compiles grammars with one backend (one tokenizer) in a worker thread.

    ``submit`` returns a Future[Grammar]; the same spec returns the same future (and so the
    same compiled grammar) while it stays in the LRU cache. A bad spec, one the backend
    cannot enforce, or one over a limit fails the future with a ValueError naming the
    problem; so does a compile running longer than ``timeout_s``. ``compile_delay_s`` slows
    every compile down on purpose (tests of the time limit, never a slow machine).
    """

    def __init__(self, backend: GrammarBackend, max_cache_entries: int = 256,
                 timeout_s: float = 10.0, num_workers: int = 1,
                 compile_delay_s: float = 0.0) -> None:
        assert max_cache_entries >= 1 and timeout_s > 0, (max_cache_entries, timeout_s)
        self.backend = backend
        self.timeout_s = timeout_s
        self.compile_delay_s = compile_delay_s
        self.max_cache_entries = max_cache_entries
        self._cache: OrderedDict[tuple[str, str], Future[Grammar]] = OrderedDict()
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(num_workers, thread_name_prefix="grammar-compiler")
        self.cache_hits = 0
        self.cache_misses = 0
        self.compile_time = CumulativeHistogram(GRAMMAR_COMPILE_BUCKETS)  # successful ones

    def submit(self, kind: str, spec: Any) -> Future[Grammar]:
        """Start compiling (or reuse a cached compile) and return its future. Never blocks."""
        try:
            canonical = canonical_spec(kind, spec)
        except Exception as e:  # noqa: BLE001 - any malformed spec fails its request only
            failed: Future[Grammar] = Future()
            failed.set_exception(e if isinstance(e, ValueError)
                                 else ValueError(f"invalid {kind}: {e!r}"))
            return failed
        key = (kind, canonical)
        with self._lock:
            fut = self._cache.get(key)
            if fut is not None:
                self._cache.move_to_end(key)
                self.cache_hits += 1
                return fut
            self.cache_misses += 1
            fut = Future()
            fut.set_running_or_notify_cancel()
            self._cache[key] = fut
            while len(self._cache) > self.max_cache_entries:
                self._cache.popitem(last=False)
        timer = threading.Timer(self.timeout_s, self._expire, (fut,))
        timer.daemon = True
        timer.start()
        fut.add_done_callback(lambda f: self._forget_failed(key, f))
        self._pool.submit(self._run, kind, canonical, fut, timer)
        return fut

    def compile(self, kind: str, spec: Any) -> Grammar:
        """submit + wait; for offline use and tests (raises the future's ValueError)."""
        return self.submit(kind, spec).result()

    def _run(self, kind: str, canonical: str, fut: Future[Grammar], timer: Any) -> None:
        try:
            if fut.done():  # expired while queued
                return
            if self.compile_delay_s:
                time.sleep(self.compile_delay_s)
            start = time.perf_counter()
            grammar = self.backend.compile(kind, canonical)
            elapsed = time.perf_counter() - start
            self.compile_time.observe(elapsed)
            logger.debug("compiled a %s grammar with %s in %.3f s", kind, self.backend.name,
                         elapsed)
            _settle(fut, grammar, None)
        except ValueError as e:
            _settle(fut, None, e)
        except Exception as e:  # a bug or a backend surprise: fail the request only
            logger.exception("grammar compilation failed unexpectedly")
            _settle(fut, None, ValueError(f"grammar compilation failed: {e!r}"))
        finally:
            timer.cancel()

    def _expire(self, fut: Future[Grammar]) -> None:
        msg = f"grammar compilation exceeded the time limit of {self.timeout_s} s"
        if _settle(fut, None, ValueError(msg)):
            logger.warning(msg)

    def _forget_failed(self, key: tuple[str, str], fut: Future[Grammar]) -> None:
        if fut.exception() is None:
            return
        with self._lock:  # a failed compile (e.g. a timeout) may succeed when retried
            if self._cache.get(key) is fut:
                del self._cache[key]

    def shutdown(self, wait: bool = False) -> None:
        """Stop the workers; queued compiles are dropped, running ones finish unobserved."""
        self._pool.shutdown(wait=wait, cancel_futures=True)
        with self._lock:
            pending = [f for f in self._cache.values() if not f.done()]
        for fut in pending:
            _settle(fut, None, ValueError("the grammar compiler was shut down"))


def _settle(
    fut: Future[Grammar], result: Grammar | None, error: Exception | None
) -> bool:
    """Complete `fut` unless the other side (worker or timer) already did."""
    try:
        if error is not None:
            fut.set_exception(error)
        else:
            fut.set_result(result)  # type: ignore[arg-type]
    except InvalidStateError:
        return False
    return True
