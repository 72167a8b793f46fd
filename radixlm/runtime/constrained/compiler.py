"""GrammarCompiler: compiles grammars off the scheduler loop, with a cache and a time limit.

The scheduler submits a grammar when a constrained request arrives and keeps the request
waiting until the returned future is done; it never blocks on the future. outlines-core
releases the GIL while it builds an Index, so a compile in the worker thread does not stall
the loop. The Rust build cannot be interrupted: the time limit fails the caller's future
(the worker finishes or skips the rest in the background) and the size checks in
grammar.py keep any single build bounded.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, InvalidStateError, ThreadPoolExecutor
from typing import Any

from radixlm.runtime.constrained.grammar import (
    GrammarLimits,
    build_byte_dfa,
    build_token_index,
    canonical_schema,
    check_regex,
    schema_to_regex,
)
from radixlm.runtime.constrained.matcher import CompiledGrammar
from radixlm.runtime.constrained.vocabulary import TokenizerInfo, tokenizer_info

logger = logging.getLogger(__name__)

GRAMMAR_KINDS = ("regex", "json_schema")


class _Expired(Exception):
    """The caller's future already failed (time limit); stop compiling."""


def compile_grammar(
    kind: str,
    spec: str,
    info: TokenizerInfo,
    limits: GrammarLimits,
    expired: Callable[[], bool] = lambda: False,
) -> CompiledGrammar:
    """Compile a canonical spec (see GrammarCompiler.canonical_spec) synchronously."""
    start = time.perf_counter()
    regex = schema_to_regex(spec) if kind == "json_schema" else spec
    regex = check_regex(regex, limits)
    if expired():
        raise _Expired
    byte_initial, byte_transitions, byte_accepting = build_byte_dfa(regex, limits)
    if expired():
        raise _Expired
    index = build_token_index(regex, info)
    elapsed = time.perf_counter() - start
    logger.debug("compiled %s grammar (%d states) in %.3f s", kind, len(byte_transitions), elapsed)
    return CompiledGrammar(
        kind,
        spec,
        regex,
        info,
        index,
        byte_initial,
        byte_transitions,
        byte_accepting,
        compile_time_s=elapsed,
    )


class GrammarCompiler:
    """Compiles `regex` / `json_schema` grammars for one tokenizer in worker threads.

    `submit` returns a Future[CompiledGrammar]; the same spec returns the same future (and
    so the same CompiledGrammar) while it stays in the LRU cache. A bad spec or one over a
    limit fails the future with a ValueError naming the problem; so does a compile running
    longer than `timeout_s`.
    """

    def __init__(
        self,
        tokenizer: Any,
        max_cache_entries: int = 256,
        timeout_s: float = 10.0,
        max_regex_len: int = 100_000,
        max_states: int = 10_000,
        num_workers: int = 1,
    ) -> None:
        assert max_cache_entries >= 1 and timeout_s > 0, (max_cache_entries, timeout_s)
        self.info = tokenizer_info(tokenizer)
        self.limits = GrammarLimits(
            max_regex_len=max_regex_len, max_states=max_states, max_expanded_size=2 * max_states
        )
        self.timeout_s = timeout_s
        self.max_cache_entries = max_cache_entries
        self._cache: OrderedDict[tuple[str, str, int], Future[CompiledGrammar]] = OrderedDict()
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(num_workers, thread_name_prefix="grammar-compiler")
        self.cache_hits = 0
        self.cache_misses = 0

    @staticmethod
    def canonical_spec(kind: str, spec: str | dict[str, Any] | bool) -> str:
        """Validate the cheap parts of a spec and return its canonical text (the cache key)."""
        if kind == "json_schema":
            return canonical_schema(spec)
        if kind == "regex":
            if not isinstance(spec, str):
                raise ValueError(f"regex must be a string, got {type(spec).__name__}")
            return spec
        raise ValueError(f"grammar kind must be one of {GRAMMAR_KINDS}, got {kind!r}")

    def submit(self, kind: str, spec: str | dict[str, Any] | bool) -> Future[CompiledGrammar]:
        """Start compiling (or reuse a cached compile) and return its future. Never blocks."""
        try:
            canonical = self.canonical_spec(kind, spec)
        except Exception as e:  # noqa: BLE001 - any malformed spec fails its request only
            failed: Future[CompiledGrammar] = Future()
            failed.set_exception(e if isinstance(e, ValueError)
                                 else ValueError(f"invalid {kind}: {e!r}"))
            return failed
        key = (kind, canonical, id(self.info))
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

    def compile(self, kind: str, spec: str | dict[str, Any] | bool) -> CompiledGrammar:
        """submit + wait; for offline use and tests (raises the future's ValueError)."""
        return self.submit(kind, spec).result()

    def _run(self, kind: str, canonical: str, fut: Future[CompiledGrammar], timer: Any) -> None:
        try:
            if fut.done():  # expired while queued
                return
            grammar = compile_grammar(kind, canonical, self.info, self.limits, fut.done)
            _settle(fut, grammar, None)
        except _Expired:
            pass
        except ValueError as e:
            _settle(fut, None, e)
        except Exception as e:  # a bug or an outlines-core surprise: fail the request only
            logger.exception("grammar compilation failed unexpectedly")
            _settle(fut, None, ValueError(f"grammar compilation failed: {e!r}"))
        finally:
            timer.cancel()

    def _expire(self, fut: Future[CompiledGrammar]) -> None:
        msg = f"grammar compilation exceeded the time limit of {self.timeout_s} s"
        if _settle(fut, None, ValueError(msg)):
            logger.warning(msg)

    def _forget_failed(self, key: tuple[str, str, int], fut: Future[CompiledGrammar]) -> None:
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
    fut: Future[CompiledGrammar], result: CompiledGrammar | None, error: Exception | None
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
