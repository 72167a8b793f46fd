"""GrammarCompiler: compiles grammars off the scheduler loop, with a cache and limits.

The scheduler submits a grammar when a constrained request arrives and keeps the request
waiting until the returned future is done; it never blocks on the future. The backends'
compilers (C++ or Rust) release the GIL, so a compile in the worker thread does not stall
the loop. A build cannot be interrupted, so with ``memory_mb`` set each new spec is first
probed in a child process (compile_worker.py) that is killed past the memory or time
limit: the spec is then refused, and only a spec whose probe finished within the limits is
compiled here (deterministically: within the same bounds). Every compiled grammar must
match some string (probe.py), and its first decode steps must keep ``step_budget_ms``
(step_budget.py). The time limit also fails the caller's future on its own.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import OrderedDict, deque
from concurrent.futures import CancelledError, Future, InvalidStateError, ThreadPoolExecutor
from typing import Any

from radixlm.runtime.constrained.base import Grammar, GrammarBackend, canonical_spec
from radixlm.runtime.constrained.compile_worker import CompileWorker, WorkerConfig
from radixlm.runtime.constrained.probe import check_matches_something
from radixlm.runtime.constrained.regex_size import check_min_match
from radixlm.runtime.constrained.step_budget import probe_steps
from radixlm.runtime.metrics import GRAMMAR_COMPILE_BUCKETS, CumulativeHistogram

logger = logging.getLogger(__name__)


class GrammarCompiler:
    """Compiles grammars with one backend (one tokenizer) in a worker thread.

    ``submit`` returns a Future[Grammar]; the same spec returns the same future (and so the
    same compiled grammar) while it stays in the LRU cache. A bad spec, one the backend
    cannot enforce, or one over a limit fails the future with a ValueError naming the
    problem; so does a compile running longer than ``timeout_s``, (``memory_mb`` set:
    probes in a child process) one whose probe needs more than ``memory_mb`` MB, and one
    whose first decode steps cost more than ``step_budget_ms`` each (0: no budget); a
    regex whose shortest match has more than ``max_match_chars`` characters (0: no limit)
    is refused before it is probed.
    New specs wait for the worker in one queue per owner (a tenant; None: everyone
    untenanted), taken in turn (``FairQueue``), so a tenant's burst of costly specs, each
    running to the limits, delays its own next spec, not another tenant's.
    ``compile_delay_s`` slows every compile down on purpose (tests of the time limit, never
    a slow machine); ``worker_hooks`` (WorkerConfig's delay_s / alloc_mb) do so in the child.
    """

    def __init__(self, backend: GrammarBackend, max_cache_entries: int = 256,
                 timeout_s: float = 10.0, num_workers: int = 1,
                 compile_delay_s: float = 0.0, memory_mb: int = 0,
                 worker_hooks: dict[str, Any] | None = None,
                 step_budget_ms: float = 0.0, max_match_chars: int = 0) -> None:
        assert max_cache_entries >= 1 and timeout_s > 0, (max_cache_entries, timeout_s)
        self.backend = backend
        self.timeout_s = timeout_s
        self.step_budget_ms = step_budget_ms
        self.max_match_chars = max_match_chars  # regex_size.check_min_match (0: none)
        self.worker = _make_worker(backend, memory_mb, timeout_s,
                                   {"step_budget_ms": step_budget_ms, **(worker_hooks or {})})
        self._worker_lock = threading.Lock()
        self.compile_delay_s = compile_delay_s
        self.max_cache_entries = max_cache_entries
        self._cache: OrderedDict[tuple[str, str], Future[Grammar]] = OrderedDict()
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(num_workers, thread_name_prefix="grammar-compiler")
        self._queue = FairQueue()  # each pool task runs the next job taken from it
        self.cache_hits = 0
        self.cache_misses = 0
        self.compile_time = CumulativeHistogram(GRAMMAR_COMPILE_BUCKETS)  # successful ones
        self._stopped = False  # shutdown() was called
        self._warming: list[Future[Any]] = []  # warm_up's start of the worker, warm_specs

    def warm_up(self, wait: bool = False) -> None:
        """Start the compile worker and compile the backend's ``warm_specs`` (OpenAI's
        json_object, in the worker and here) now, in the background unless ``wait``. A
        server does, while its model loads: the child's start takes seconds of a core and
        about 400 MB, a backend's first JSON grammar builds its token tables, and the
        server answers health checks only once ``wait_warm`` returned, so its first
        json_object request is a cache hit. Otherwise the first compile starts the
        worker; an Engine that never constrains a request never pays for it."""
        if not self._warming:
            if self.worker is not None:
                self._warming.append(self._pool.submit(self._start_worker))
            # queued behind the worker's start
            self._warming += [self.submit(kind, spec) for kind, spec in self.backend.warm_specs]
        if wait:
            self.wait_warm()

    def wait_warm(self) -> None:
        """Return once a ``warm_up`` has finished (at once if none was asked for); a worker
        that failed to start was logged, and the first compile tries again."""
        for fut in self._warming:
            try:
                error = fut.exception()
            except CancelledError:  # shut down meanwhile
                continue
            if error is not None:  # a request compiles it again
                logger.warning("warming the grammar compiler failed: %s", error)

    def _start_worker(self) -> None:
        try:
            with self._worker_lock:
                self.worker.ensure_started()  # type: ignore[union-attr]
        except Exception:  # noqa: BLE001 - retried (and reported) by the first compile
            if self._stopped:  # shut down while it started: nothing went wrong
                return
            logger.exception("the grammar compile worker did not start")

    def submit(self, kind: str, spec: Any, owner: str | None = None) -> Future[Grammar]:
        """Start compiling (or reuse a cached compile) and return its future; a new spec
        waits in ``owner``'s queue. Never blocks."""
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
        timer = None
        if self.worker is None:  # else the worker's kill bounds the time; its start-up not
            timer = threading.Timer(self.timeout_s, self._expire, (fut,))
            timer.daemon = True
            timer.start()
        fut.add_done_callback(lambda f: self._forget_failed(key, f))
        self._queue.put(owner, (kind, canonical, fut, timer))
        self._pool.submit(self._run_next)
        return fut

    def compile(self, kind: str, spec: Any) -> Grammar:
        """submit + wait; for offline use and tests (raises the future's ValueError)."""
        return self.submit(kind, spec).result()

    def _run_next(self) -> None:
        """One pool task: the next job in turn (one task is submitted per job)."""
        self._run(*self._queue.take())

    def _run(self, kind: str, canonical: str, fut: Future[Grammar], timer: Any) -> None:
        try:
            if fut.done():  # expired while queued
                return
            if self.compile_delay_s:
                time.sleep(self.compile_delay_s)
            start = time.perf_counter()
            payload = None
            if kind == "regex":
                check_min_match(canonical, self.max_match_chars)
            if self.worker is not None:
                with self._worker_lock:
                    refusal, payload = self.worker.probe(kind, canonical)
                if refusal is not None:
                    raise ValueError(refusal)
            grammar = (self.backend.restore(kind, canonical, payload) if payload is not None
                       else self.backend.compile(kind, canonical))
            check_matches_something(grammar, kind, self.backend.vocab_size,
                                    self.backend.stop_token_ids)
            if self.worker is None:  # else the worker's probe timed its steps
                probe_steps(grammar, self.backend.tokenizer, self.backend.vocab_size,
                            self.backend.stop_token_ids, self.step_budget_ms)
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
            if timer is not None:
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
        self._stopped = True
        self._pool.shutdown(wait=wait, cancel_futures=True)
        if self.worker is not None:
            self.worker.kill()
        with self._lock:
            pending = [f for f in self._cache.values() if not f.done()]
        for fut in pending:
            _settle(fut, None, ValueError("the grammar compiler was shut down"))


class FairQueue:
    """Jobs in one FIFO per owner, taken from the owners in turn (round robin)."""

    def __init__(self) -> None:
        self._queues: OrderedDict[str | None, deque[Any]] = OrderedDict()
        self._lock = threading.Lock()

    def put(self, owner: str | None, job: Any) -> None:
        with self._lock:
            self._queues.setdefault(owner, deque()).append(job)

    def take(self) -> Any:
        """The oldest job of the owner next in turn; that owner goes to the back."""
        with self._lock:
            owner, queue = next(iter(self._queues.items()))
            job = queue.popleft()
            del self._queues[owner]
            if queue:
                self._queues[owner] = queue
            return job

    def __len__(self) -> int:
        with self._lock:
            return sum(len(q) for q in self._queues.values())


def _make_worker(backend: GrammarBackend, memory_mb: int, timeout_s: float,
                 hooks: dict[str, Any]) -> CompileWorker | None:
    """The child process that probes specs (None: memory_mb is 0, or the tokenizer has no
    local directory the child could load it from)."""
    if not memory_mb:
        return None
    path = getattr(backend.tokenizer, "name_or_path", "")
    if not path or not os.path.isdir(path):
        logger.warning("grammar compiles are not isolated: the tokenizer has no local "
                       "directory (%r) a compile worker could load", path)
        return None
    config = WorkerConfig(backend.name, path, backend.vocab_size,
                          list(backend.stop_token_ids), memory_mb, **hooks)
    return CompileWorker(config, timeout_s)


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
